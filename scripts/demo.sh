#!/usr/bin/env bash
# Builds and runs the kvmosaic demo:  scripts/demo.sh [demo arguments...]
# e.g.  scripts/demo.sh --context 2048 --kv-heads 2 --q-heads 8 --steps 2 --json out.json
# Installs missing dependencies, configures a build folder (Release, examples ON, tests OFF),
# builds only kvmosaic_demo and runs it with the given arguments. Setup output goes to stderr, so
# stdout is the demo's own.
#
# CUDA is built only when a GPU is usable, and only for that GPU's architecture:
#   - a GPU is present when `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` succeeds and
#     prints compute capabilities ("9.0" -> sm_90; several GPUs: each distinct one). Then CUDA is ON
#     with CMAKE_CUDA_ARCHITECTURES set to those, in build-cuda-<archs>/ (e.g. build-cuda-90/);
#   - otherwise (or when no nvcc is found) CUDA is OFF and the host demo is built in build/: one
#     C++ file, no nvcc; on 2 cores the table comes about a minute after the start (README.md).
# KVMOSAIC_ENABLE_CUDA=ON|OFF (environment) overrides the detection. ON without a GPU builds for
# $CUDAARCHS if set, else for the library's defaults (sm_75 and sm_90), in build-cuda-75-90/.
# scripts/test.sh is unaffected: it always compiles every kernel for sm_75 and sm_90.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="$(nproc)"

note() { echo "demo.sh: $*" >&2; }

bash "${repo_root}/scripts/install-deps.sh" >&2

# Sets archs to the distinct compute capabilities of the usable GPUs as CUDA architectures ("90",
# "86;90"; nvidia-smi prints "9.0" for sm_90), or to nothing, with no_gpu saying why.
archs=""
no_gpu=""
detect_gpus() {
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    no_gpu="nvidia-smi not found"
    return
  fi
  local caps line list=()
  # timeout: a broken driver can make nvidia-smi hang.
  if ! caps="$(timeout 60 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null)"; then
    no_gpu="nvidia-smi failed"
    return
  fi
  while IFS= read -r line; do
    line="${line//[[:space:]]/}"
    [[ "$line" =~ ^([0-9]+)\.([0-9]+)$ ]] && list+=("${BASH_REMATCH[1]}${BASH_REMATCH[2]}")
  done <<<"$caps"
  if (( ${#list[@]} == 0 )); then
    no_gpu="nvidia-smi reports no compute capability"
    return
  fi
  archs="$(printf '%s\n' "${list[@]}" | sort -n -u | paste -sd ';' -)"
}
detect_gpus
sm_list() { local a="$1"; echo "sm_${a//;/, sm_}"; }

# nvcc often lives in /usr/local/cuda/bin without being on PATH.
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
have_nvcc() { [[ -n "${CUDACXX:-}" ]] || command -v nvcc >/dev/null 2>&1; }

enable_cuda="${KVMOSAIC_ENABLE_CUDA:-}"
case "${enable_cuda^^}" in
  "")
    if [[ -z "$archs" ]]; then
      enable_cuda=OFF
      why="no GPU: ${no_gpu}; KVMOSAIC_ENABLE_CUDA=ON builds the CUDA kernels anyway"
    elif ! have_nvcc; then
      enable_cuda=OFF
      why="a GPU ($(sm_list "$archs")) but no nvcc (set CUDACXX)"
    else
      enable_cuda=ON
      why="nvidia-smi reports $(sm_list "$archs")"
    fi
    ;;
  ON|1|TRUE|YES)
    enable_cuda=ON
    if [[ -n "$archs" ]]; then
      why="KVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA}; nvidia-smi reports $(sm_list "$archs")"
    elif [[ -n "${CUDAARCHS:-}" ]]; then
      archs="${CUDAARCHS}"
      why="KVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA} without a GPU (${no_gpu}): CUDAARCHS"
    else
      archs="75;90"
      why="KVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA} without a GPU (${no_gpu}): the default architectures"
    fi
    ;;
  OFF|0|FALSE|NO)
    enable_cuda=OFF
    why="KVMOSAIC_ENABLE_CUDA=${KVMOSAIC_ENABLE_CUDA}"
    ;;
  *)
    note "KVMOSAIC_ENABLE_CUDA must be ON or OFF, not '${enable_cuda}'"
    exit 2
    ;;
esac

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DKVMOSAIC_BUILD_EXAMPLES=ON -DKVMOSAIC_BUILD_TESTS=OFF
            -DKVMOSAIC_BUILD_BENCHMARKS=OFF "-DKVMOSAIC_ENABLE_CUDA=${enable_cuda}")
if [[ "$enable_cuda" == ON ]]; then
  # One folder per architecture list, so a CUDA build is never reused for another GPU or without one.
  build_dir="${repo_root}/build-cuda-${archs//;/-}"
  cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=${archs}")
  note "building kvmosaic_demo with the CUDA backend for $(sm_list "$archs") in ${build_dir#"${repo_root}"/}/ (${why})"
else
  # Host only: CUDA OFF is passed explicitly, so a build/ configured with CUDA by an earlier
  # version of this script is switched off rather than reused.
  build_dir="${repo_root}/build"
  note "building kvmosaic_demo with the host backend only in build/ (${why})"
fi

cmake -S "${repo_root}" -B "${build_dir}" "${cmake_args[@]}" >&2
cmake --build "${build_dir}" --target kvmosaic_demo -j "${jobs}" >&2

exec "${build_dir}/examples/kvmosaic_demo" "$@"
