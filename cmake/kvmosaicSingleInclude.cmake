# Checks of the single-file headers (single_include/kvmosaic/) and of the Compiler Explorer
# examples (examples/compiler-explorer/), run by CTest (test/single_include/CMakeLists.txt).
#
#   cmake -DMODE=header -DCOMPILER=<c++ or nvcc> -DHEADERS=<name|name> -DSINGLE_INCLUDE_DIR=<dir>
#         -DEIGEN_INCLUDE_DIRS=<dir|dir> -DWORK_DIR=<dir> [-DCUDA_ARCH=sm_75]
#         [-DCUDA_HOST_COMPILER=<c++>] -P kvmosaicSingleInclude.cmake
#     Each header alone (included twice: #pragma once must hold) in a translation unit that sees
#     nothing of include/: `c++ -std=c++17 -Wall -Wextra -Werror -isystem <Eigen> -c`, or
#     `nvcc -std=c++17 -arch=<CUDA_ARCH> -Xcompiler=-Wall,-Wextra,-Werror --Werror=all-warnings`.
#
#   cmake -DMODE=run|compile|compile_fail -DCOMPILER=<c++ or nvcc> -DEXAMPLE=<file>
#         -DREADME=<README.md> -DSINGLE_INCLUDE_DIR=<dir> -DEIGEN_INCLUDE_DIRS=<dir|dir>
#         -DWORK_DIR=<dir> [-DCUDA_ARCH=sm_75] [-DCUDA_HOST_COMPILER=<c++>] -P kvmosaicSingleInclude.cmake
#     An example as Compiler Explorer compiles it. Its `#include <https://...>` line becomes an
#     #include of the committed single-file header the URL names, as Compiler Explorer puts the
#     file it fetched in its place; include/ is never on the path. The flags are the example's
#     own "//   Flags:" line (-arch=sm_90 replaced by -arch=<CUDA_ARCH> when given), which
#     README.md must show too; Eigen comes in the way Compiler Explorer adds a library (-isystem
#     for g++, -I for nvcc).
#       run:          compile and link, with -Wall -Wextra added; the program must exit 0 and
#                     print something;
#       compile:      `nvcc <flags> -c` (Compiler Explorer's compile-only mode);
#       compile_fail: cmake/kvmosaicCompileFail.cmake on the rewritten source, as is (its own
#                     `-std=c++17 -fsyntax-only`): the compiler must fail, with output matching
#                     the example's "// EXPECT: <regex>" line.
#     run and compile also fail on any compiler warning, which Compiler Explorer would show to
#     every reader.
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.21)

foreach(_var MODE COMPILER SINGLE_INCLUDE_DIR EIGEN_INCLUDE_DIRS WORK_DIR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "kvmosaicSingleInclude.cmake: -D${_var}=... is required")
  endif()
endforeach()

string(REPLACE "|" ";" _eigen_dirs "${EIGEN_INCLUDE_DIRS}")
get_filename_component(_compiler_name "${COMPILER}" NAME)
set(_is_nvcc OFF)
if(_compiler_name MATCHES "nvcc")
  set(_is_nvcc ON)
endif()
set(_nvcc_prefix "")
if(_is_nvcc AND DEFINED CUDA_HOST_COMPILER AND NOT CUDA_HOST_COMPILER STREQUAL "")
  set(_nvcc_prefix -ccbin "${CUDA_HOST_COMPILER}")
endif()

# Stable, plain diagnostics: no locale quotes, no colour escapes.
set(ENV{LC_ALL} C)
set(ENV{GCC_COLORS} "")

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# run_step(<what> <command...>): runs, fails loudly; sets step_output.
function(run_step what)
  string(REPLACE ";" " " _shown "${ARGN}")
  message(STATUS "[${what}] ${_shown}")
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${WORK_DIR}"
                  RESULT_VARIABLE _result OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "[${what}] failed (exit ${_result}):\n  ${_shown}\n${_out}")
  endif()
  set(step_output "${_out}" PARENT_SCOPE)
endfunction()

# require_no_warning(<what> <output>)
function(require_no_warning what output)
  string(TOLOWER "${output}" _lower)
  if(_lower MATCHES "warning")
    message(FATAL_ERROR "[${what}] the compiler warned; Compiler Explorer would show it to every reader:\n${output}")
  endif()
endfunction()

# --- MODE=header -----------------------------------------------------------------------------------

if(MODE STREQUAL "header")
  if(NOT DEFINED HEADERS OR HEADERS STREQUAL "")
    message(FATAL_ERROR "kvmosaicSingleInclude.cmake: MODE=header needs -DHEADERS=<name|name>")
  endif()
  string(REPLACE "|" ";" _headers "${HEADERS}")
  foreach(_header IN LISTS _headers)
    if(NOT EXISTS "${SINGLE_INCLUDE_DIR}/kvmosaic/${_header}")
      message(FATAL_ERROR "${SINGLE_INCLUDE_DIR}/kvmosaic/${_header} is missing (python3 scripts/amalgamate.py)")
    endif()
    string(MAKE_C_IDENTIFIER "${_header}" _id)
    set(_tu "${WORK_DIR}/${_id}.cpp")
    set(_flags -std=c++17 -Wall -Wextra -Werror)
    if(_is_nvcc)
      set(_tu "${WORK_DIR}/${_id}.cu")
      if(NOT DEFINED CUDA_ARCH OR CUDA_ARCH STREQUAL "")
        message(FATAL_ERROR "kvmosaicSingleInclude.cmake: nvcc needs -DCUDA_ARCH=sm_XX")
      endif()
      set(_flags ${_nvcc_prefix} -std=c++17 -arch=${CUDA_ARCH} -Xcompiler=-Wall,-Wextra,-Werror --Werror=all-warnings)
    endif()
    file(WRITE "${_tu}"
         "// Written by cmake/kvmosaicSingleInclude.cmake: <kvmosaic/${_header}> alone, twice.\n"
         "#include <kvmosaic/${_header}>\n"
         "#include <kvmosaic/${_header}>\n")
    set(_includes "-I${SINGLE_INCLUDE_DIR}")
    foreach(_dir IN LISTS _eigen_dirs)
      list(APPEND _includes -isystem "${_dir}")
    endforeach()
    run_step("${_header}" "${COMPILER}" ${_flags} ${_includes} -c "${_tu}" -o "${_tu}.o")
  endforeach()
  message(STATUS "single-file headers compile on their own: ${HEADERS}")
  return()
endif()

# --- MODE=run|compile|compile_fail: a Compiler Explorer example --------------------------------------

foreach(_var EXAMPLE README)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "kvmosaicSingleInclude.cmake: MODE=${MODE} needs -D${_var}=...")
  endif()
endforeach()
get_filename_component(_example_name "${EXAMPLE}" NAME)

# The settings the example states at its top.
file(STRINGS "${EXAMPLE}" _flags_line LIMIT_COUNT 1 REGEX "^//[ \t]+Flags:")
file(STRINGS "${EXAMPLE}" _libraries_line LIMIT_COUNT 1 REGEX "^//[ \t]+Libraries:")
if(NOT _flags_line OR NOT _libraries_line)
  message(FATAL_ERROR "${EXAMPLE}: its header must name the flags and libraries ('//   Flags: ...', '//   Libraries: ...')")
endif()
string(REGEX REPLACE "^//[ \t]+Flags:[ \t]*" "" _flags_text "${_flags_line}")
string(STRIP "${_flags_text}" _flags_text)
if(NOT _libraries_line MATCHES "Eigen")
  message(FATAL_ERROR "${EXAMPLE}: the single-file headers need Eigen; '${_libraries_line}' does not name it")
endif()

# README.md must show the same flags for this example.
file(READ "${README}" _readme)
string(FIND "${_readme}" "${_example_name}" _at_name)
string(FIND "${_readme}" "${_flags_text}" _at_flags)
if(_at_name EQUAL -1 OR _at_flags EQUAL -1)
  message(FATAL_ERROR "${README} must name ${_example_name} and its flags '${_flags_text}' (section \"Try it in Compiler Explorer\")")
endif()

separate_arguments(_flags UNIX_COMMAND "${_flags_text}")
if(DEFINED CUDA_ARCH AND NOT CUDA_ARCH STREQUAL "")
  if(NOT _flags MATCHES "-arch=sm_90")
    message(FATAL_ERROR "${EXAMPLE}: CUDA_ARCH=${CUDA_ARCH} given, but its flags have no -arch=sm_90 to replace")
  endif()
  string(REPLACE "-arch=sm_90" "-arch=${CUDA_ARCH}" _flags "${_flags}")
endif()

# Compiler Explorer's URL include (its client-side regex): the line is replaced by the fetched file.
file(READ "${EXAMPLE}" _source)
string(REGEX MATCHALL "#[ \t]*include[ \t]*[<\"]https?://[^\">]+[\">]" _url_includes "${_source}")
list(LENGTH _url_includes _url_count)
if(NOT _url_count EQUAL 1)
  message(FATAL_ERROR "${EXAMPLE}: expected exactly one '#include <https://...>' line, found ${_url_count}")
endif()
string(REGEX REPLACE "^#[ \t]*include[ \t]*[<\"](https?://[^\">]+)[\">]$" "\\1" _url "${_url_includes}")
if(NOT _url MATCHES "^https://raw\\.githubusercontent\\.com/[^/]+/[^/]+/[^/]+/single_include/kvmosaic/(kvmosaic\\.(hpp|cuh))$")
  message(FATAL_ERROR "${EXAMPLE}: '${_url}' is not https://raw.githubusercontent.com/<owner>/<repo>/<ref>/single_include/kvmosaic/kvmosaic.hpp or .cuh")
endif()
set(_header "${SINGLE_INCLUDE_DIR}/kvmosaic/${CMAKE_MATCH_1}")
if(NOT EXISTS "${_header}")
  message(FATAL_ERROR "${_header} is missing (python3 scripts/amalgamate.py)")
endif()
string(REPLACE "${_url_includes}" "#include \"${_header}\"  // ${_url}" _source "${_source}")
set(_rewritten "${WORK_DIR}/${_example_name}")
file(WRITE "${_rewritten}" "${_source}")

if(MODE STREQUAL "compile_fail")
  # kvmosaicCompileFail.cmake's check on the rewritten source: it fails unless the compiler fails
  # with output matching the EXPECT line.
  set(SOURCE "${_rewritten}")
  string(REPLACE ";" "|" INCLUDE_DIRS "${_eigen_dirs}")
  include("${CMAKE_CURRENT_LIST_DIR}/kvmosaicCompileFail.cmake")
  return()
endif()

set(_libraries "")
foreach(_dir IN LISTS _eigen_dirs)
  if(_is_nvcc)
    list(APPEND _libraries "-I${_dir}")
  else()
    list(APPEND _libraries -isystem "${_dir}")
  endif()
endforeach()

if(MODE STREQUAL "run")
  set(_program "${WORK_DIR}/example")
  run_step("${_example_name}: compile" "${COMPILER}" ${_flags} -Wall -Wextra ${_libraries} "${_rewritten}" -o "${_program}")
  require_no_warning("${_example_name}: compile" "${step_output}")
  run_step("${_example_name}: run" "${_program}")
  if(step_output STREQUAL "")
    message(FATAL_ERROR "[${_example_name}: run] printed nothing")
  endif()
  message("${step_output}")
elseif(MODE STREQUAL "compile")
  run_step("${_example_name}: compile" "${COMPILER}" ${_nvcc_prefix} ${_flags} ${_libraries} -c "${_rewritten}" -o "${WORK_DIR}/example.o")
  require_no_warning("${_example_name}: compile" "${step_output}")
else()
  message(FATAL_ERROR "kvmosaicSingleInclude.cmake: unknown MODE '${MODE}'; allowed: header, run, compile, compile_fail")
endif()
if(DEFINED CUDA_ARCH AND NOT CUDA_ARCH STREQUAL "")
  message(STATUS "${_example_name}: OK (${MODE}, ${CUDA_ARCH})")
else()
  message(STATUS "${_example_name}: OK (${MODE})")
endif()
