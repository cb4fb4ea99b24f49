#!/usr/bin/env bash
# Prepares .device-deps/ in the repository root: a small CMake prefix with the third-party build
# dependencies that the GPU machine lacks (it has no internet and no Debian packages). It travels
# to the GPU machine as a carried (git-ignored) folder; scripts/device/run-gpu-suite.sh configures
# with -DCMAKE_PREFIX_PATH=$PWD/.device-deps. See docs/gpu-suite.md.
#
#   .device-deps/
#     include/catch2/, include/eigen3/, include/benchmark/
#     lib/cmake/Catch2/          Catch2Config.cmake, Catch.cmake, CatchAddTests.cmake, ...  (Debian catch2)
#     lib/libCatch2WithMain.a    (only because Debian's Catch2Targets checks that it exists)
#     share/eigen3/cmake/        Eigen3Config.cmake, Eigen3Targets.cmake, ...             (Debian libeigen3-dev)
#     lib/libbenchmark.a, lib/libbenchmark_main.a, lib/cmake/benchmark/                    (see below)
#     src/benchmark-<version>.tar.gz   the patched Google Benchmark source, for a rebuild on the device
#     MANIFEST.txt, .stamp
#
# Google Benchmark: Debian's libbenchmark-dev ships libbenchmark as a SHARED library only, and its
# CMake config points at that .so. A static library is far safer to carry to another distribution
# (its objects bind to whatever glibc/libstdc++ the device has at link time), so this script builds
# the very same source Debian ships (`apt-get source benchmark=<installed version>`, Debian patches
# applied) as static, position-independent libraries (-fPIC: the device may link PIE executables),
# without LTO and without -march flags, and installs them with upstream's CMake package files
# (imported targets benchmark::benchmark and benchmark::benchmark_main, static, Threads::Threads as
# a link dependency). If that build fails, the script stops: nothing half-built is left behind.
#
# Run here (Debian 12, as root if packages are missing):  bash scripts/device/prepare-carry.sh
# Idempotent: when .device-deps/ is complete and was made by this same script from the same
# package versions, it only prints the size. FORCE=1 rebuilds. JOBS overrides the parallelism.
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail

log() { echo "prepare-carry: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="${repo_root}/.device-deps"
jobs="${JOBS:-$(nproc)}"
size_limit_mib=40

command -v dpkg >/dev/null 2>&1 || die "dpkg not found: this script expects Debian 12 (bookworm)"
for tool in cmake tar; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found"
done
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler (c++/g++) found"

# --- Debian packages -------------------------------------------------------------------------------

packages=(catch2 libbenchmark-dev libeigen3-dev)

dpkg_installed() { dpkg -s "$1" 2>/dev/null | grep -qx 'Status: install ok installed'; }
pkg_version() { dpkg-query -W -f='${Version}' "$1"; }

missing=()
for pkg in "${packages[@]}"; do
  dpkg_installed "$pkg" || missing+=("$pkg")
done
if (( ${#missing[@]} > 0 )); then
  [[ "$(id -u)" -eq 0 ]] || die "missing packages: ${missing[*]} (run as root, or: sudo apt-get install -y ${missing[*]})"
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi

# First installed file of <package> whose path matches the extended regex <pattern>.
pkg_file() {
  local pkg="$1" pattern="$2" f
  f="$(dpkg -L "$pkg" | grep -E "$pattern" | head -n 1 || true)"
  [[ -n "$f" && -e "$f" ]] || die "package $pkg: no installed file matches '$pattern'"
  printf '%s\n' "$f"
}

catch2_version="$(pkg_version catch2)"
benchmark_deb_version="$(pkg_version libbenchmark-dev)"
eigen_version="$(pkg_version libeigen3-dev)"
benchmark_upstream_version="${benchmark_deb_version#*:}"            # drop an epoch
benchmark_upstream_version="${benchmark_upstream_version%-*}"      # drop the Debian revision
case "$catch2_version" in 2.*) ;; *) die "catch2 $catch2_version is not Catch2 v2" ;; esac

script_hash="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
stamp="script=${script_hash} catch2=${catch2_version} libbenchmark-dev=${benchmark_deb_version} libeigen3-dev=${eigen_version} cxx=$(c++ -dumpfullversion 2>/dev/null || echo unknown)"

required_files=(
  include/catch2/catch.hpp
  lib/cmake/Catch2/Catch2Config.cmake
  lib/cmake/Catch2/Catch.cmake
  lib/cmake/Catch2/CatchAddTests.cmake
  include/eigen3/Eigen/Core
  share/eigen3/cmake/Eigen3Config.cmake
  include/benchmark/benchmark.h
  lib/libbenchmark.a
  lib/libbenchmark_main.a
  lib/cmake/benchmark/benchmarkConfig.cmake
)

report_size() {
  local kib
  kib="$(du -sk "$dest" | cut -f1)"
  log "$(du -sh "$dest" | cut -f1) in $(find "$dest" -type f | wc -l) files: ${dest}"
  (( kib < size_limit_mib * 1024 )) || die ".device-deps is ${kib} KiB, over the ${size_limit_mib} MiB budget"
}

if [[ "${FORCE:-0}" != 1 && -f "${dest}/.stamp" && "$(cat "${dest}/.stamp")" == "$stamp" ]]; then
  complete=1
  for f in "${required_files[@]}"; do [[ -e "${dest}/${f}" ]] || complete=0; done
  if (( complete )); then
    log "up to date (${stamp})"
    report_size
    exit 0
  fi
fi

# Everything is assembled in a staging folder next to the destination and moved into place at the
# end, so an interrupted run never leaves a half-filled .device-deps/ that looks complete.
staging="${dest}.staging"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvmosaic-prepare-carry.XXXXXX")"
cleanup() { rm -rf "$work" "$staging"; }
trap cleanup EXIT
rm -rf "$staging"
mkdir -p "$staging"/{include,lib/cmake,share,src}

# --- Catch2 v2 (header-only; the CMake files from /usr/lib/cmake/Catch2) ---------------------------

catch_hpp="$(pkg_file catch2 '/catch2/catch\.hpp$')"
catch_cmake_dir="$(dirname "$(pkg_file catch2 '/cmake/Catch2/Catch2Config\.cmake$')")"
catch_main_lib="$(pkg_file catch2 '/libCatch2WithMain\.a$')"
cp -a "$(dirname "$catch_hpp")" "$staging/include/"                   # include/catch2/
cp -a "$catch_cmake_dir" "$staging/lib/cmake/"                        # lib/cmake/Catch2/
# Catch2Targets-*.cmake refers to ${prefix}/lib/libCatch2WithMain.a and fails if it is absent.
grep -q '_IMPORT_PREFIX}/lib/libCatch2WithMain.a' "$staging"/lib/cmake/Catch2/Catch2Targets-*.cmake \
  || die "unexpected layout of Catch2Targets-*.cmake (libCatch2WithMain.a not under \${prefix}/lib)"
cp -a "$catch_main_lib" "$staging/lib/"
for f in Catch.cmake CatchAddTests.cmake; do
  [[ -f "$staging/lib/cmake/Catch2/$f" ]] || die "catch2 package lacks $f"
done

# --- Eigen3 (header-only; the CMake files from /usr/share/eigen3/cmake) -----------------------------

eigen_core="$(pkg_file libeigen3-dev '/eigen3/Eigen/Core$')"
eigen_include_dir="$(dirname "$(dirname "$eigen_core")")"             # .../include/eigen3
eigen_cmake_dir="$(dirname "$(pkg_file libeigen3-dev '/Eigen3Config\.cmake$')")"
[[ "$eigen_cmake_dir" == */share/eigen3/cmake ]] || die "unexpected Eigen3 CMake folder $eigen_cmake_dir"
cp -a "$eigen_include_dir" "$staging/include/"                        # include/eigen3/
mkdir -p "$staging/share/eigen3"
cp -a "$eigen_cmake_dir" "$staging/share/eigen3/"                     # share/eigen3/cmake/
grep -q 'include/eigen3' "$staging/share/eigen3/cmake/Eigen3Targets.cmake" \
  || die "unexpected Eigen3Targets.cmake (include/eigen3 not relative to the prefix)"

# --- Google Benchmark, static, from Debian's source package -----------------------------------------

log "fetching the source of benchmark ${benchmark_deb_version} (apt-get source, signed Debian index)"
apt_dir="${work}/apt"
mkdir -p "${apt_dir}/parts" "${apt_dir}/lists/partial" "${apt_dir}/cache/archives/partial" "${work}/dl"
# A private deb-src list and package index: the system's APT configuration is not touched.
# shellcheck source=/dev/null
suites="$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")"
cat >"${apt_dir}/parts/debian-src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: ${suites} ${suites}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
touch "${apt_dir}/empty.list"
apt_opts=(-o "Dir::Etc::SourceList=${apt_dir}/empty.list" -o "Dir::Etc::SourceParts=${apt_dir}/parts"
          -o "Dir::State::Lists=${apt_dir}/lists" -o "Dir::Cache=${apt_dir}/cache")
# As root, apt would hand the download to the _apt user, who cannot write into our temp folder.
[[ "$(id -u)" -eq 0 ]] && apt_opts+=(-o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" -qq update >&2 || die "apt-get update of the deb-src index failed (network?)"
(cd "${work}/dl" && apt-get "${apt_opts[@]}" -qq source --download-only "benchmark=${benchmark_deb_version}" >&2) \
  || die "apt-get source benchmark=${benchmark_deb_version} failed"

orig="$(find "${work}/dl" -maxdepth 1 -name "benchmark_${benchmark_upstream_version}.orig.tar.*" | head -n 1)"
debian_tar="$(find "${work}/dl" -maxdepth 1 -name 'benchmark_*.debian.tar.*' | head -n 1)"
[[ -n "$orig" ]] || die "no benchmark_${benchmark_upstream_version}.orig.tar.* downloaded"
mkdir -p "${work}/src"
tar -xf "$orig" -C "${work}/src"
src_dir="${work}/src/benchmark-${benchmark_upstream_version}"
[[ -f "${src_dir}/CMakeLists.txt" ]] || die "unexpected layout of $orig"
if [[ -n "$debian_tar" ]]; then
  tar -xf "$debian_tar" -C "${work}"
  if [[ -f "${work}/debian/patches/series" ]]; then
    command -v patch >/dev/null 2>&1 || die "'patch' not found (apt-get install patch)"
    while read -r p; do
      [[ -z "$p" || "$p" == \#* ]] && continue
      patch -d "$src_dir" -p1 --quiet --forward <"${work}/debian/patches/${p}" || die "Debian patch $p failed"
    done <"${work}/debian/patches/series"
  fi
fi

# The patched source goes along (about 200 KB) so that run-gpu-suite.sh can rebuild the library with
# the device's own compiler if linking against this one ever fails there.
tar -czf "${staging}/src/benchmark-${benchmark_upstream_version}.tar.gz" -C "${work}/src" "benchmark-${benchmark_upstream_version}"

log "building static Google Benchmark ${benchmark_upstream_version}"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
build_benchmark() {
  cmake -S "$src_dir" -B "${work}/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="${work}/prefix" \
    -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DGIT_VERSION="${benchmark_upstream_version}" \
    -DBENCHMARK_ENABLE_TESTING=OFF \
    -DBENCHMARK_ENABLE_GTEST_TESTS=OFF \
    -DBENCHMARK_ENABLE_LTO=OFF \
    -DBENCHMARK_ENABLE_WERROR=OFF \
    -DBENCHMARK_ENABLE_LIBPFM=OFF \
    -DBENCHMARK_INSTALL_DOCS=OFF \
    -DBENCHMARK_ENABLE_DOXYGEN=OFF || return 1
  cmake --build "${work}/build" -j "$jobs" || return 1
  cmake --install "${work}/build" || return 1
}
if ! build_benchmark >"${work}/benchmark-build.log" 2>&1; then
  tail -n 40 "${work}/benchmark-build.log" >&2
  die "Google Benchmark build failed"
fi

for f in include/benchmark/benchmark.h lib/libbenchmark.a lib/libbenchmark_main.a lib/cmake/benchmark/benchmarkConfig.cmake; do
  [[ -e "${work}/prefix/${f}" ]] || die "Google Benchmark install lacks $f"
done
grep -q 'Threads' "${work}/prefix/lib/cmake/benchmark/benchmarkConfig.cmake" \
  "${work}/prefix/lib/cmake/benchmark/benchmarkTargets.cmake" \
  || die "benchmark's CMake config does not bring in Threads::Threads"
cp -a "${work}/prefix/include/benchmark" "$staging/include/"
cp -a "${work}/prefix/lib/libbenchmark.a" "${work}/prefix/lib/libbenchmark_main.a" "$staging/lib/"
cp -a "${work}/prefix/lib/cmake/benchmark" "$staging/lib/cmake/"
strip --strip-debug "$staging"/lib/libbenchmark*.a 2>/dev/null || true

# --- Manifest, stamp, move into place ---------------------------------------------------------------

# shellcheck source=/dev/null
os_name="$(. /etc/os-release && echo "${PRETTY_NAME:-unknown}")"
cat >"${staging}/MANIFEST.txt" <<EOF
kvmosaic .device-deps (made by scripts/device/prepare-carry.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ))
Use: cmake -DCMAKE_PREFIX_PATH=<repo>/.device-deps ...
  Catch2        ${catch2_version} (Debian catch2): include/catch2, lib/cmake/Catch2
  Eigen3        ${eigen_version} (Debian libeigen3-dev): include/eigen3, share/eigen3/cmake
  benchmark     ${benchmark_deb_version} (Debian source, built static -fPIC by $(c++ --version | head -n 1)):
                include/benchmark, lib/libbenchmark.a, lib/libbenchmark_main.a, lib/cmake/benchmark
                source: src/benchmark-${benchmark_upstream_version}.tar.gz
Built on: ${os_name}, glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}')
EOF
printf '%s\n' "$stamp" >"${staging}/.stamp"

rm -rf "$dest"
mv "$staging" "$dest"
log "done"
report_size
