#!/usr/bin/env bash
# Builds and runs all kvmosaic tests: installs missing dependencies, configures build-test/
# (Release, tests ON, examples ON), builds everything and runs ctest.
# Environment: KVMOSAIC_ENABLE_CUDA=ON|OFF overrides the CUDA auto-detection (default: ON when
# nvcc is found); JOBS overrides the parallelism (default: nproc).
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${repo_root}/build-test"
jobs="${JOBS:-$(nproc)}"

bash "${repo_root}/scripts/install-deps.sh"

# nvcc often lives in /usr/local/cuda/bin without being on PATH.
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DKVMOSAIC_BUILD_TESTS=ON -DKVMOSAIC_BUILD_EXAMPLES=ON)
if [[ -n "${KVMOSAIC_ENABLE_CUDA:-}" ]]; then
  cmake_args+=("-DKVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA}")
fi

cmake -S "${repo_root}" -B "${build_dir}" "${cmake_args[@]}"
cmake --build "${build_dir}" -j "${jobs}"
ctest --test-dir "${build_dir}" --output-on-failure -j "${jobs}"
