#!/usr/bin/env bash
# Runs a kvmosaic libFuzzer target for longer than CI does:
#   bash scripts/fuzz.sh [seconds (default 600)] [target (default fuzz_cache_ops)] [libFuzzer flags...]
# Builds it in build-fuzz/ (clang, address + undefined, -O1), fuzzes with a corpus kept in
# build-fuzz/corpus/<target>/ (seeded from test/fuzz/corpus/<target>/, growing from run to run)
# on all cores (-fork=nproc), and writes crashing inputs to build-fuzz/artifacts/<target>/.
# Reproduce one with: build-fuzz/test/fuzz/kvmosaic_<target> <artifact>. Exits non-zero on a finding.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-600}"
target="${2:-fuzz_cache_ops}"
shift $(( $# > 2 ? 2 : $# ))
build_dir="${repo_root}/build-fuzz"
jobs="${JOBS:-$(nproc)}"

bash "${repo_root}/scripts/install-deps.sh"

CC=clang CXX=clang++ cmake -S "${repo_root}" -B "${build_dir}" \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" \
  -DKVMOSAIC_ENABLE_CUDA=OFF -DKVMOSAIC_BUILD_TESTS=ON -DKVMOSAIC_BUILD_EXAMPLES=OFF \
  -DKVMOSAIC_BUILD_BENCHMARKS=OFF -DKVMOSAIC_INSTALL=OFF -DKVMOSAIC_BUILD_FUZZERS=ON
cmake --build "${build_dir}" -j "${jobs}" --target "kvmosaic_${target}"

corpus="${build_dir}/corpus/${target}"
artifacts="${build_dir}/artifacts/${target}"
mkdir -p "${corpus}" "${artifacts}"
cp -n "${repo_root}/test/fuzz/corpus/${target}/"* "${corpus}/" 2>/dev/null || true

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
exec "${build_dir}/test/fuzz/kvmosaic_${target}" "-max_total_time=${seconds}" -timeout=20 -rss_limit_mb=2048 \
  "-fork=${jobs}" -print_final_stats=1 "-artifact_prefix=${artifacts}/" "$@" "${corpus}"
