# Package tests for kvmosaic, run by CTest (see test/CMakeLists.txt):
#
#   cmake -DMODE=find_package|add_subdirectory|fetch_content -DWORK_DIR=<scratch dir>
#         -DKVMOSAIC_SOURCE_DIR=<src> -DKVMOSAIC_BINARY_DIR=<build> -DKVMOSAIC_VERSION=<x.y.z>
#         -DGENERATOR=<cmake generator> -DCXX_COMPILER=<c++> -DBUILD_TYPE=<type>
#         [-DCUDA_COMPILER=<nvcc> -DCUDA_ARCHITECTURE=<arch>]
#         -P run_package_test.cmake
#
# find_package:     `cmake --install <build> --prefix <WORK_DIR>/prefix`, then configure, build and
#                   run test/package/consumer against that prefix (C++ only). With CUDA_COMPILER
#                   given, a second consumer build enables CUDA and checks that kvmosaic::kvmosaic
#                   then links CCCL::CCCL (and that a host .cpp sees CCCL's headers).
# add_subdirectory: configure, build and run test/package/subdir_consumer, which vendors the
#                   kvmosaic source tree with add_subdirectory() and checks the options default OFF.
#                   With CUDA_COMPILER given, again with CUDA enabled by the parent (CCCL linked).
# fetch_content:    packs what a consumer's build reads from the source tree (CMakeLists.txt,
#                   cmake/, include/, LICENSE) into <WORK_DIR>/kvmosaic-<version>.tar.gz, laid out
#                   as a release archive (one top-level directory), then configures, builds and runs
#                   test/package/fetch_content_consumer, which gets it with FetchContent_Declare(URL
#                   file://... URL_HASH SHA256=...) and FetchContent_MakeAvailable: no network, and
#                   the working tree as it is, committed or not. Host only: FetchContent_MakeAvailable
#                   is add_subdirectory, whose CUDA case the add_subdirectory mode covers.
# SPDX-License-Identifier: Apache-2.0
cmake_minimum_required(VERSION 3.21)

foreach(_var MODE WORK_DIR KVMOSAIC_SOURCE_DIR KVMOSAIC_BINARY_DIR KVMOSAIC_VERSION GENERATOR CXX_COMPILER BUILD_TYPE)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_package_test.cmake: -D${_var}=... is required")
  endif()
endforeach()

set(_here "${CMAKE_CURRENT_LIST_DIR}")

# run(<step name> <command...>): echo, run, fail loudly.
function(run step)
  string(REPLACE ";" " " _shown "${ARGN}")
  message(STATUS "[${step}] ${_shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _result OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "[${step}] failed (exit ${_result}):\n  ${_shown}\n${_out}")
  endif()
  set(run_output "${_out}" PARENT_SCOPE)
endfunction()

# consumer(<name> <source dir> <extra configure args...>): configure + build in WORK_DIR/<name>.
function(consumer name source_dir)
  set(_build "${WORK_DIR}/${name}")
  run("${name}: configure" "${CMAKE_COMMAND}" -S "${source_dir}" -B "${_build}"
      -G "${GENERATOR}"
      "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
      "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
      -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
      "-DEXPECTED_KVMOSAIC_VERSION=${KVMOSAIC_VERSION}"
      ${ARGN})
  message("${run_output}")
  run("${name}: build" "${CMAKE_COMMAND}" --build "${_build}" --config "${BUILD_TYPE}")
endfunction()

# run_exe(<name> <program>): run a program of consumer build <name> (single- or multi-config
# layout) and check that it printed "kvmosaic <version>".
function(run_exe name exe)
  if(EXISTS "${WORK_DIR}/${name}/${exe}")
    set(_path "${WORK_DIR}/${name}/${exe}")
  else()
    set(_path "${WORK_DIR}/${name}/${BUILD_TYPE}/${exe}")
  endif()
  run("${name}: run" "${_path}")
  message("${run_output}")
  if(NOT run_output MATCHES "kvmosaic ${KVMOSAIC_VERSION}")
    message(FATAL_ERROR "[${name}: run] expected 'kvmosaic ${KVMOSAIC_VERSION}' in the output")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

if(MODE STREQUAL "find_package")
  set(_prefix "${WORK_DIR}/prefix")
  run("install" "${CMAKE_COMMAND}" --install "${KVMOSAIC_BINARY_DIR}" --prefix "${_prefix}" --config "${BUILD_TYPE}")
  foreach(_file
      include/kvmosaic/kvmosaic.hpp
      include/kvmosaic/core/config.hpp
      share/cmake/kvmosaic/kvmosaicConfig.cmake
      share/cmake/kvmosaic/kvmosaicConfigVersion.cmake
      share/cmake/kvmosaic/kvmosaicTargets.cmake)
    if(NOT EXISTS "${_prefix}/${_file}")
      message(FATAL_ERROR "[install] ${_prefix}/${_file} is missing")
    endif()
  endforeach()
  # Nothing from the build tree (tests, examples, generated sources) may be installed.
  file(GLOB_RECURSE _installed RELATIVE "${_prefix}" "${_prefix}/*")
  foreach(_file IN LISTS _installed)
    if(NOT _file MATCHES "^(include/kvmosaic/|share/cmake/kvmosaic/|share/doc/kvmosaic/)")
      message(FATAL_ERROR "[install] unexpected file installed: ${_file}")
    endif()
  endforeach()

  set(_consumer_args
      "-DCMAKE_PREFIX_PATH=${_prefix}"
      "-DEXPECTED_KVMOSAIC_DIR=${_prefix}/share/cmake/kvmosaic")

  consumer(consumer "${_here}/consumer" ${_consumer_args} -DCONSUMER_WITH_CUDA=OFF)
  run_exe(consumer kvmosaic_consumer)

  if(DEFINED CUDA_COMPILER AND NOT CUDA_COMPILER STREQUAL "")
    consumer(consumer_cuda "${_here}/consumer" ${_consumer_args} -DCONSUMER_WITH_CUDA=ON
             "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}"
             "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURE}")
    run_exe(consumer_cuda kvmosaic_consumer)
    run_exe(consumer_cuda kvmosaic_consumer_cuda)
  endif()
elseif(MODE STREQUAL "add_subdirectory")
  consumer(subdir_consumer "${_here}/subdir_consumer" "-DKVMOSAIC_SOURCE_DIR=${KVMOSAIC_SOURCE_DIR}")
  run_exe(subdir_consumer kvmosaic_subdir_consumer)

  if(DEFINED CUDA_COMPILER AND NOT CUDA_COMPILER STREQUAL "")
    consumer(subdir_consumer_cuda "${_here}/subdir_consumer" "-DKVMOSAIC_SOURCE_DIR=${KVMOSAIC_SOURCE_DIR}"
             -DCONSUMER_WITH_CUDA=ON
             "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}"
             "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURE}")
    run_exe(subdir_consumer_cuda kvmosaic_subdir_consumer)
    run_exe(subdir_consumer_cuda kvmosaic_subdir_consumer_cuda)
  endif()
elseif(MODE STREQUAL "fetch_content")
  set(_stage "${WORK_DIR}/archive/kvmosaic-${KVMOSAIC_VERSION}")
  file(MAKE_DIRECTORY "${_stage}")
  file(COPY "${KVMOSAIC_SOURCE_DIR}/CMakeLists.txt" "${KVMOSAIC_SOURCE_DIR}/LICENSE"
            "${KVMOSAIC_SOURCE_DIR}/cmake" "${KVMOSAIC_SOURCE_DIR}/include"
       DESTINATION "${_stage}")
  set(_archive "${WORK_DIR}/kvmosaic-${KVMOSAIC_VERSION}.tar.gz")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E tar czf "${_archive}" "kvmosaic-${KVMOSAIC_VERSION}"
                  WORKING_DIRECTORY "${WORK_DIR}/archive" RESULT_VARIABLE _result)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "[archive] could not write ${_archive}")
  endif()
  file(SHA256 "${_archive}" _sha256)
  consumer(fetch_content_consumer "${_here}/fetch_content_consumer"
           "-DKVMOSAIC_URL=file://${_archive}" "-DKVMOSAIC_URL_HASH=SHA256=${_sha256}")
  run_exe(fetch_content_consumer kvmosaic_fetch_content_consumer)
else()
  message(FATAL_ERROR "run_package_test.cmake: unknown MODE '${MODE}'")
endif()

message(STATUS "package test '${MODE}' passed")
