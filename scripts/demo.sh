#!/usr/bin/env bash
# Builds and runs the kvmosaic demo:  scripts/demo.sh [demo arguments...]
# e.g.  scripts/demo.sh --context 2048 --kv-heads 2 --q-heads 8 --steps 2 --json out.json
# Installs missing dependencies, configures build/ (Release, examples ON, tests OFF), builds
# kvmosaic_demo and runs it with the given arguments. Setup output goes to stderr, so stdout is
# the demo's own. KVMOSAIC_ENABLE_CUDA=ON|OFF (environment) overrides the CUDA auto-detection.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${repo_root}/build"
jobs="$(nproc)"

bash "${repo_root}/scripts/install-deps.sh" >&2

# nvcc often lives in /usr/local/cuda/bin without being on PATH.
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DKVMOSAIC_BUILD_EXAMPLES=ON -DKVMOSAIC_BUILD_TESTS=OFF)
if [[ -n "${KVMOSAIC_ENABLE_CUDA:-}" ]]; then
  cmake_args+=("-DKVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA}")
fi

cmake -S "${repo_root}" -B "${build_dir}" "${cmake_args[@]}" >&2
cmake --build "${build_dir}" --target kvmosaic_demo -j "${jobs}" >&2

exec "${build_dir}/examples/kvmosaic_demo" "$@"
