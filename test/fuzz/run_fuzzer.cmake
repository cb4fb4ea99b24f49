# Runs a libFuzzer binary for SECONDS seconds over a copy of the seed corpus SEEDS in WORK_DIR;
# fails when the fuzzer reports a crash, a sanitizer finding or a timeout (its exit status), and
# leaves the crashing input in WORK_DIR/artifacts/.
#   cmake -DFUZZER=<binary> -DSEEDS=<dir> -DWORK_DIR=<dir> -DSECONDS=<n> -P run_fuzzer.cmake
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.21)
foreach(_var FUZZER SEEDS WORK_DIR SECONDS)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "run_fuzzer.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}/corpus")
file(MAKE_DIRECTORY "${WORK_DIR}/corpus" "${WORK_DIR}/artifacts")
file(GLOB _seeds "${SEEDS}/*")
if(_seeds)
  file(COPY ${_seeds} DESTINATION "${WORK_DIR}/corpus")
endif()

execute_process(
  COMMAND "${FUZZER}" "-max_total_time=${SECONDS}" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
          "-artifact_prefix=${WORK_DIR}/artifacts/" "${WORK_DIR}/corpus"
  RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  file(GLOB _artifacts "${WORK_DIR}/artifacts/*")
  message(FATAL_ERROR "run_fuzzer.cmake: ${FUZZER} exited with ${_rc}; reproduce with: ${FUZZER} ${_artifacts}")
endif()
