# Warning flags for kvmosaic's own targets (tests, examples, benchmarks). Never applied to the
# kvmosaic interface target, so consumers keep their own flags.
# SPDX-License-Identifier: Apache-2.0
include_guard(GLOBAL)

# kvmosaic_target_warnings(<target> [WERROR])
#   C++ (g++/clang): -Wall -Wextra [-Werror]
#   CUDA (nvcc):     -Xcompiler=-Wall,-Wextra [-Xcompiler=-Werror --Werror=all-warnings]
#
# --Werror=all-warnings makes nvcc's own front-end diagnostics (cudafe++, e.g. #177-D, #20012-D)
# errors too. Unlike g++, nvcc does NOT exempt -isystem headers from all of them: Eigen 3.4 under
# nvcc emits #20012-D ("__host__ annotation is ignored ... explicitly defaulted") from
# DenseStorage.h unless EIGEN_NO_CUDA is defined -- include/kvmosaic/host/eigen.hpp defines it
# when compiled by nvcc. Checked with nvcc 13.0: CCCL 3.0 (Thrust, CUB, libcu++), Catch2 2.13
# and Eigen 3.4 with EIGEN_NO_CUDA compile cleanly under it. If a future dependency does warn,
# suppress that diagnostic number (-diag-suppress=<n>) or drop --Werror=all-warnings here and
# keep -Xcompiler=-Werror.
function(kvmosaic_target_warnings target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "WERROR" "" "")
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    set(_scope INTERFACE)
  else()
    set(_scope PRIVATE)
  endif()
  set(_gnu_like "$<OR:$<CXX_COMPILER_ID:GNU>,$<CXX_COMPILER_ID:Clang>,$<CXX_COMPILER_ID:AppleClang>>")
  target_compile_options(${target} ${_scope}
    "$<$<AND:$<COMPILE_LANGUAGE:CXX>,${_gnu_like}>:-Wall;-Wextra>"
    "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>")
  if(arg_WERROR)
    target_compile_options(${target} ${_scope}
      "$<$<AND:$<COMPILE_LANGUAGE:CXX>,${_gnu_like}>:-Werror>"
      "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Werror;--Werror=all-warnings>")
  endif()
endfunction()
