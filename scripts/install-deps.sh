#!/usr/bin/env bash
# Installs kvmosaic's build dependencies on Debian 12 (bookworm), but only those that are missing:
#   cmake (>= 3.21), g++, make, python3 (scripts/amalgamate.py and its test), libeigen3-dev,
#   catch2 (v2), libbenchmark-dev, and for the sanitizer and fuzzer tests (scripts/test.sh step 2,
#   scripts/fuzz.sh) clang with its sanitizer and libFuzzer runtimes (libclang-rt-14-dev)
# cmake/g++/make/python3/clang count as present when the command is on PATH (any source); the
# libraries are checked with `dpkg -s` (the clang runtimes also count as present when clang finds
# libFuzzer).
# `apt-get update` runs only when something has to be installed.
# Needs root for that; as another user it lists what is missing and exits 1.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

log() { echo "install-deps: $*" >&2; }

if ! command -v dpkg >/dev/null 2>&1; then
  log "dpkg not found: not a Debian-like system. Install by hand: cmake (>= 3.21), a C++17 compiler,"
  log "make, python3, Eigen 3.3+, Catch2 v2, Google Benchmark, clang with libFuzzer and sanitizer runtimes. Continuing."
  exit 0
fi

dpkg_installed() {
  dpkg -s "$1" 2>/dev/null | grep -qx 'Status: install ok installed'
}

cmake_ok() {
  command -v cmake >/dev/null 2>&1 || return 1
  local version
  version="$(cmake --version | sed -n '1s/^cmake version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')"
  [[ -n "$version" ]] || return 1
  local major="${version%%.*}" minor="${version#*.}"
  (( major > 3 || (major == 3 && minor >= 21) ))
}

missing=()
cmake_ok || dpkg_installed cmake || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || dpkg_installed g++ || missing+=(g++)
command -v make >/dev/null 2>&1 || dpkg_installed make || missing+=(make)
command -v python3 >/dev/null 2>&1 || dpkg_installed python3 || missing+=(python3)
command -v clang++ >/dev/null 2>&1 || dpkg_installed clang || missing+=(clang)
# libFuzzer and the sanitizer runtimes: Debian 12 ships them in libclang-rt-14-dev (clang 14).
if ! dpkg_installed libclang-rt-14-dev; then
  fuzzer_lib=""
  if command -v clang++ >/dev/null 2>&1; then
    fuzzer_lib="$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null || true)"
  fi
  [[ -n "$fuzzer_lib" && -f "$fuzzer_lib" ]] || missing+=(libclang-rt-14-dev)
fi
for pkg in libeigen3-dev catch2 libbenchmark-dev; do
  dpkg_installed "$pkg" || missing+=("$pkg")
done

if (( ${#missing[@]} == 0 )); then
  log "all dependencies present"
  exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
  log "missing packages: ${missing[*]}"
  log "run this script as root, or install them yourself:"
  log "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}"
  exit 1
fi

log "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
