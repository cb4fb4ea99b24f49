#!/usr/bin/env bash
# Builds and runs all kvmosaic tests: installs missing dependencies, then
#   1. build-test/ (Release, tests ON, examples ON): builds everything and runs ctest;
#   2. build-test-sanitize/ (host only, clang, -O1 with line tables, AddressSanitizer + UndefinedBehaviorSanitizer
#      with float-cast-overflow, every finding fatal): builds the unit tests and the libFuzzer
#      targets only, runs the unit tests (the [random] test at a tenth of its iterations) and each
#      fuzzer for KVMOSAIC_FUZZ_SECONDS from its seed corpus.
# Environment: KVMOSAIC_TORCH_TESTS=OFF skips the PyTorch example's tests (and the Python
# environment they need, scripts/install-python-deps.sh); KVMOSAIC_ENABLE_CUDA=ON|OFF overrides the CUDA auto-detection of step 1 (default: ON
# when nvcc is found); KVMOSAIC_CUDA_ARCHITECTURES sets CMAKE_CUDA_ARCHITECTURES (default: PTX for
# sm_90 on a machine without a GPU, below; else the project's 75;90); JOBS overrides the parallelism (default: nproc); KVMOSAIC_SANITIZE_TESTS=OFF
# skips step 2; KVMOSAIC_FUZZ_SECONDS (default 60) sets each fuzzer's time in step 2.
# docs/testing.md lists what runs and how long it takes.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${repo_root}/build-test"
sanitize_dir="${repo_root}/build-test-sanitize"
jobs="${JOBS:-$(nproc)}"

bash "${repo_root}/scripts/install-deps.sh"
# The PyTorch example's tests (examples/pytorch/): a virtual environment with PyTorch and
# transformers; KVMOSAIC_TORCH_TESTS=OFF skips them.
python_args=()
if [[ "${KVMOSAIC_TORCH_TESTS:-ON}" != "OFF" ]]; then
  python_args+=("-DKVMOSAIC_PYTHON=$(bash "${repo_root}/scripts/install-python-deps.sh")")
fi

# nvcc often lives in /usr/local/cuda/bin without being on PATH.
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DKVMOSAIC_BUILD_TESTS=ON -DKVMOSAIC_BUILD_EXAMPLES=ON)
if [[ -n "${KVMOSAIC_ENABLE_CUDA:-}" ]]; then
  cmake_args+=("-DKVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA}")
fi
# Without a GPU nothing CUDA runs, so the GPU tests and examples are compiled to PTX for sm_90
# alone (every template instantiated, every shape, no ptxas), the GPU tests unoptimized (host and
# NVVM at -O0: test/gpu/CMakeLists.txt), and every engine is compiled to machine code for sm_75
# and sm_90 once, one shape, as shipped (test/cuda_every_engine); the headers are checked with
# nvcc for sm_75. With a GPU, or CUDAARCHS / KVMOSAIC_CUDA_ARCHITECTURES set: the
# project's default architectures (75;90), or that list.
if [[ -n "${KVMOSAIC_CUDA_ARCHITECTURES:-}" ]]; then
  cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=${KVMOSAIC_CUDA_ARCHITECTURES}")
elif [[ -z "${CUDAARCHS:-}" ]] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "test.sh: no GPU: CUDA tests and examples compiled to PTX for sm_90 (the tests unoptimized); every engine to sm_75 and sm_90 machine code" >&2
  cmake_args+=(-DCMAKE_CUDA_ARCHITECTURES=90-virtual -DKVMOSAIC_CUDA_HEADER_CHECK_ARCHITECTURES=75
               -DKVMOSAIC_CUDA_EVERY_ENGINE_CHECK=ON -DKVMOSAIC_GPU_TESTS_COMPILE_ONLY=ON)
fi

# Each phase's wall time goes to stderr, so that a CI log says where the time went.
phase() { echo "test.sh: ${1} done at ${SECONDS} s" >&2; }
phase "dependencies"
cmake -S "${repo_root}" -B "${build_dir}" "${cmake_args[@]}" "${python_args[@]}"
cmake --build "${build_dir}" -j "${jobs}"
phase "step 1 build"
ctest --test-dir "${build_dir}" --output-on-failure -j "${jobs}"
phase "step 1 tests"

if [[ "${KVMOSAIC_SANITIZE_TESTS:-ON}" == "OFF" ]]; then
  echo "test.sh: KVMOSAIC_SANITIZE_TESTS=OFF: sanitizer and fuzzer tests skipped" >&2
  exit 0
fi

# Step 2. clang for libFuzzer; CC is set too so that the configure step of a C-less project
# never mixes compilers.
CC=clang CXX=clang++ cmake -S "${repo_root}" -B "${sanitize_dir}" \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -gline-tables-only" \
  -DKVMOSAIC_ENABLE_CUDA=OFF -DKVMOSAIC_BUILD_TESTS=ON -DKVMOSAIC_BUILD_EXAMPLES=OFF \
  -DKVMOSAIC_BUILD_BENCHMARKS=OFF -DKVMOSAIC_INSTALL=OFF \
  "-DKVMOSAIC_SANITIZE=address;undefined" -DKVMOSAIC_BUILD_FUZZERS=ON \
  "-DKVMOSAIC_FUZZ_SECONDS=${KVMOSAIC_FUZZ_SECONDS:-60}"
cmake --build "${sanitize_dir}" -j "${jobs}" --target kvmosaic_tests kvmosaic_fuzz_cache_ops
phase "step 2 build"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
KVMOSAIC_RANDOM_OPS_SCALE="${KVMOSAIC_RANDOM_OPS_SCALE:-0.1}" \
  ctest --test-dir "${sanitize_dir}" --output-on-failure -j "${jobs}" -L '^(unit|fuzz)$'
phase "step 2 tests"
