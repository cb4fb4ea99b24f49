#!/usr/bin/env bash
# kvmosaic GPU suite: build everything with CUDA and run GPU tests, host tests, compute-sanitizer,
# benchmarks, the PyTorch SDPA baseline and the demo, in one go. Meant for the GPU machine, which
# runs one command per call in a copy of the working tree and returns the files under $OUT:
#
#   bash scripts/device/run-gpu-suite.sh          (carry [".device-deps"], made by prepare-carry.sh)
#
# Files written to $OUT (at most 8, all directly in $OUT):
#   env.txt          nvidia-smi, nvcc/cmake/compiler/torch versions, OS, options of this run
#   log.txt          the full log of every step (build output included)
#   gpu_tests.xml    JUnit report of build-gpu/test/kvmosaic_gpu_tests
#   bench_<name>.json  Google Benchmark JSON per benchmark program <name> (a leading "bench_" is not
#                    doubled: bench_decode -> bench_decode.json); up to 3, with more they are
#                    merged into bench_all.json, each entry tagged with "executable")
#   sdpa.json        benchmark/sdpa_baseline.py (PyTorch SDPA decode timings + HBM read bandwidth)
#   demo.json        build-gpu/examples/kvmosaic_demo --json (default shape)
# The summary (one line per step, then a digest of each JSON) is printed LAST on stdout, since the
# caller sees only the tail of the output. Exit status: 0 when every step that ran passed, 1 when a
# step failed, timed out or was skipped for lack of time.
#
# Environment (all optional):
#   ONLY_BUILD=1          configure + build only
#   SKIP_SANITIZER=1      no compute-sanitizer runs        SANITIZER_TOOLS  default "memcheck racecheck"
#   SKIP_BENCH=1          no benchmarks and no SDPA baseline
#   SKIP_GPU_TESTS=1, SKIP_HOST_TESTS=1, SKIP_SDPA=1, SKIP_DEMO=1
#   BENCH_ARGS            extra arguments for every benchmark, e.g. "--benchmark_filter=dense"
#   GPU_TEST_ARGS         extra arguments (e.g. a test spec "[dense]") for the GPU test run
#   SANITIZE_SPEC         Catch2 test spec for the sanitizer runs (default "[sanitize]")
#   SDPA_ARGS             extra arguments for sdpa_baseline.py, e.g. "--quick"
#   DEMO_ARGS             extra arguments for kvmosaic_demo
#   CUDA_ARCHS            CMAKE_CUDA_ARCHITECTURES (default "90;75"; "90" builds faster)
#   CMAKE_ARGS            extra configure arguments
#   WITH_PACKAGE_TESTS=1  also run the package_* CTests (install + consumer builds; slow)
#   REBUILD_BENCHMARK=1   build Google Benchmark here from .device-deps/src first (done by itself
#                         when the build fails with link errors that involve libbenchmark/GLIBC)
#   SUITE_TIME_LIMIT      seconds this script may take in all (default 570: the device tool allows
#                         600 per call). Each step is capped by what is left; steps that no longer
#                         fit are skipped, so the summary always gets printed.
#   BUILD_DIR (build-gpu), JOBS (nproc), OUT (default <BUILD_DIR>/suite-out when not set)
# SPDX-License-Identifier: Apache-2.0
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -n "${OUT:-}" && "${OUT}" != /* ]]; then OUT="${PWD}/${OUT}"; fi   # relative to the caller's folder
cd "$repo_root" || exit 1

suite_start=$SECONDS
SUITE_TIME_LIMIT="${SUITE_TIME_LIMIT:-570}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
[[ "$BUILD_DIR" == /* ]] || BUILD_DIR="${repo_root}/${BUILD_DIR}"
JOBS="${JOBS:-$(nproc)}"
OUT="${OUT:-${BUILD_DIR}/suite-out}"
CUDA_ARCHS="${CUDA_ARCHS:-90;75}"
SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck racecheck}"
SANITIZE_SPEC="${SANITIZE_SPEC:-[sanitize]}"
DEPS="${repo_root}/.device-deps"
RESERVE=15        # seconds kept back for the summary
MIN_STEP=20       # a step with less time than this left is skipped

mkdir -p "$OUT" "$BUILD_DIR"
LOG="$OUT/log.txt"
: >"$LOG"
work="${BUILD_DIR}/suite-work"   # scratch space that does not come back
rm -rf "$work"
mkdir -p "$work"

# nvcc and compute-sanitizer often live in /usr/local/cuda/bin without being on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:${PATH}"
fi
if [[ -z "${CUDACXX:-}" ]] && command -v nvcc >/dev/null 2>&1; then
  CUDACXX="$(command -v nvcc)"
  export CUDACXX
fi
linebuf=()
command -v stdbuf >/dev/null 2>&1 && linebuf=(stdbuf -oL -eL)

# --- bookkeeping -----------------------------------------------------------------------------------

step_names=() step_status=() step_secs=() step_notes=()
record() { step_names+=("$1"); step_status+=("$2"); step_secs+=("$3"); step_notes+=("${4:-}"); }
remaining() { echo $(( SUITE_TIME_LIMIT - (SECONDS - suite_start) )); }
say() { echo "$*" | tee -a "$LOG"; }
banner() { say ""; say "===== [$(date -u +%H:%M:%S) +$((SECONDS - suite_start))s] $* ====="; }
skip_all_reason=""   # set when configure fails: later steps are skipped with this note
details="$work/details.txt"   # short excerpts of failures, printed with the summary
: >"$details"
# add_details <title> [file]: appends stdin (or the file) to the failure excerpts, lines cut short.
add_details() {
  local title="$1" text; shift
  text="$(cut -c1-240 "$@" | head -n 14)"
  [[ -n "${text//[[:space:]]/}" ]] || return 0
  printf '[%s]\n%s\n' "$title" "$text" >>"$details"
}

# step_timeout <cap>: prints the timeout for a step (capped), or nothing when it no longer fits.
step_timeout() {
  local cap="$1" t
  t=$(( $(remaining) - RESERVE ))
  (( t > cap )) && t=$cap
  (( t >= MIN_STEP )) && echo "$t"
}

# run_cmd <timeout> <cmd...>: runs with a time limit, output appended to the log and shown; sets rc.
rc=0
run_cmd() {
  local t="$1"; shift
  say "\$ $*"
  timeout -k 10 "$t" "${linebuf[@]}" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
}

# step <name> <cap-seconds> <cmd...>: one step with the usual pass/fail/timeout bookkeeping.
step() {
  local name="$1" cap="$2"; shift 2
  local t t0
  if [[ -n "$skip_all_reason" ]]; then record "$name" SKIP 0 "$skip_all_reason"; return 1; fi
  t="$(step_timeout "$cap")"
  if [[ -z "$t" ]]; then record "$name" "SKIP(time)" 0 "only $(remaining)s left"; return 1; fi
  banner "$name (limit ${t}s)"
  t0=$SECONDS
  local mark
  mark=$(wc -l <"$LOG")
  run_cmd "$t" "$@"
  local secs=$((SECONDS - t0))
  if (( rc == 0 )); then record "$name" PASS "$secs"
  elif (( rc == 124 || rc == 137 )); then record "$name" TIMEOUT "$secs" "killed after ${t}s"
  else record "$name" FAIL "$secs" "exit code $rc"
  fi
  if (( rc != 0 )) && [[ "$name" != sanitize_* ]]; then   # the sanitizer steps pick their own excerpt
    tail -n +"$((mark + 1))" "$LOG" | grep -v -E '^ *(Start +[0-9]+:|[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed)' \
      | tail -n 10 | add_details "$name: last lines"
  fi
  return "$rc"
}

# --- 0. environment --------------------------------------------------------------------------------

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)   host: $(hostname 2>/dev/null)   repo: ${repo_root}"
  echo "git: $(git -C "$repo_root" rev-parse HEAD 2>/dev/null || echo 'n/a (no .git)')"
  echo "options: ONLY_BUILD=${ONLY_BUILD:-} SKIP_SANITIZER=${SKIP_SANITIZER:-} SKIP_BENCH=${SKIP_BENCH:-}" \
       "SKIP_GPU_TESTS=${SKIP_GPU_TESTS:-} SKIP_HOST_TESTS=${SKIP_HOST_TESTS:-} SKIP_SDPA=${SKIP_SDPA:-}" \
       "SKIP_DEMO=${SKIP_DEMO:-} CUDA_ARCHS=${CUDA_ARCHS} JOBS=${JOBS} SUITE_TIME_LIMIT=${SUITE_TIME_LIMIT}"
  echo "BENCH_ARGS=${BENCH_ARGS:-} GPU_TEST_ARGS=${GPU_TEST_ARGS:-} SDPA_ARGS=${SDPA_ARGS:-} DEMO_ARGS=${DEMO_ARGS:-} CMAKE_ARGS=${CMAKE_ARGS:-}"
  echo
  echo "== nvidia-smi"; timeout 30 nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
  echo
  timeout 30 nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,power.limit,driver_version,compute_cap \
    --format=csv 2>&1 || true
  echo; echo "== nvcc"; timeout 30 nvcc --version 2>&1 || echo "(no nvcc)"
  echo; echo "== cmake / ninja / c++"; cmake --version 2>&1 | head -n 1; ninja --version 2>&1 || echo "(no ninja)"
  c++ --version 2>&1 | head -n 1
  echo; echo "== compute-sanitizer / ncu"
  timeout 30 compute-sanitizer --version 2>&1 | tail -n 1; timeout 30 ncu --version 2>&1 | tail -n 1
  echo; echo "== python / torch"
  timeout 60 python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1 | tail -n 1
  echo; echo "== system"
  # shellcheck source=/dev/null
  (. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-unknown OS}")
  ldd --version 2>&1 | head -n 1; uname -r; echo "cpus: $(nproc)"; free -g 2>/dev/null | head -n 2; df -h . 2>/dev/null | tail -n 1
  echo; echo "== .device-deps"; cat "${DEPS}/MANIFEST.txt" 2>/dev/null || echo "(missing: run scripts/device/prepare-carry.sh and carry .device-deps)"
} >"$OUT/env.txt" 2>&1
banner "environment"
grep -E 'NVIDIA-SMI|H100|H200|release|torch|MANIFEST|missing' "$OUT/env.txt" | head -n 12 | tee -a "$LOG"
gpu_name="$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
record env PASS 0 "${gpu_name:-no GPU found by nvidia-smi}"

# --- 1. configure + build --------------------------------------------------------------------------

generator="Ninja"
command -v ninja >/dev/null 2>&1 || generator="Unix Makefiles"
if [[ -f "${BUILD_DIR}/CMakeCache.txt" ]]; then   # an earlier call's build tree: keep its generator
  cached="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "${BUILD_DIR}/CMakeCache.txt")"
  [[ -n "$cached" ]] && generator="$cached"
fi
keep_going=(-- -k 0)
[[ "$generator" == "Ninja" ]] || keep_going=(-- -k)

extra_cmake=()
if [[ -n "${CMAKE_ARGS:-}" ]]; then read -r -a extra_cmake <<<"${CMAKE_ARGS}"; fi

# Builds static Google Benchmark from the carried source with this machine's compiler (fallback for
# a libbenchmark.a from prepare-carry.sh that does not link here).
rebuild_benchmark() {
  local tgz ver dir t
  tgz="$(find "${DEPS}/src" -maxdepth 1 -name 'benchmark-*.tar.gz' 2>/dev/null | head -n 1)"
  [[ -n "$tgz" ]] || { say "no ${DEPS}/src/benchmark-*.tar.gz to rebuild from"; return 1; }
  ver="$(basename "$tgz" .tar.gz)"; ver="${ver#benchmark-}"
  dir="${BUILD_DIR}/_deps/benchmark"
  t="$(step_timeout 300)"; [[ -n "$t" ]] || return 1
  banner "rebuild Google Benchmark ${ver} from ${tgz}"
  rm -rf "$dir"; mkdir -p "$dir/src"
  tar -xzf "$tgz" -C "$dir/src" || return 1
  run_cmd "$t" cmake -S "$dir/src/benchmark-${ver}" -B "$dir/build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$dir/prefix" -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DBUILD_SHARED_LIBS=OFF -DGIT_VERSION="$ver" -DBENCHMARK_ENABLE_TESTING=OFF -DBENCHMARK_ENABLE_GTEST_TESTS=OFF \
    -DBENCHMARK_ENABLE_LTO=OFF -DBENCHMARK_ENABLE_WERROR=OFF -DBENCHMARK_INSTALL_DOCS=OFF
  (( rc == 0 )) || return 1
  run_cmd "$t" cmake --build "$dir/build" -j "$JOBS"; (( rc == 0 )) || return 1
  run_cmd 60 cmake --install "$dir/build"; (( rc == 0 )) || return 1
  extra_cmake+=("-Dbenchmark_DIR=$dir/prefix/lib/cmake/benchmark")
}

[[ -d "$DEPS" ]] || say "WARNING: ${DEPS} is missing: run scripts/device/prepare-carry.sh and carry .device-deps"
if [[ "${REBUILD_BENCHMARK:-0}" == 1 ]]; then
  rebuild_benchmark || say "Google Benchmark rebuild failed"
fi

configure() {
  step configure 300 cmake -S "$repo_root" -B "$BUILD_DIR" -G "$generator" \
    -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_PREFIX_PATH=${DEPS}" \
    -DKVMOSAIC_ENABLE_CUDA=ON \
    -DKVMOSAIC_BUILD_TESTS=ON \
    -DKVMOSAIC_BUILD_BENCHMARKS=ON \
    -DKVMOSAIC_BUILD_EXAMPLES=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}" \
    "${extra_cmake[@]}"
}

# The build's own output goes to the log only (it is long); its errors are shown on failure.
build() {
  local name="$1" t t0 secs
  t="$(step_timeout 100000)"
  if [[ -z "$t" ]]; then record "$name" "SKIP(time)" 0; return 1; fi
  banner "$name: cmake --build ${BUILD_DIR} -j ${JOBS} (limit ${t}s; output in log.txt)"
  t0=$SECONDS
  touch "$work/build.start"
  timeout -k 10 "$t" cmake --build "$BUILD_DIR" -j "$JOBS" "${keep_going[@]}" >"$work/build.log" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
  cat "$work/build.log" >>"$LOG"
  tail -n 3 "$work/build.log"
  if (( rc == 0 )); then record "$name" PASS "$secs"; build_ok=1; return 0; fi
  build_ok=0
  say "--- build errors (first 40 lines; all of it is in log.txt) ---"
  grep -E 'FAILED:|error|Error [0-9]|undefined reference|multiple definition|ninja: build stopped' "$work/build.log" \
    | cut -c1-400 | head -n 40 | tee -a "$LOG"
  grep -E 'FAILED:|error:|undefined reference|multiple definition' "$work/build.log" | add_details "$name: errors"
  if (( rc == 124 || rc == 137 )); then record "$name" TIMEOUT "$secs" "killed after ${t}s"
  else record "$name" FAIL "$secs" "$(grep -c '^FAILED' "$work/build.log") failed targets, exit code $rc"
  fi
  return 1
}

if configure; then
  if ! build build; then
    if [[ "${REBUILD_BENCHMARK:-0}" != 1 ]] \
       && grep -E 'undefined reference|undefined symbol|can not be used when making|not found' "$work/build.log" \
          | grep -qiE 'benchmark|GLIBC'; then
      say "link errors involve Google Benchmark/glibc: rebuilding it from source with this machine's compiler"
      if rebuild_benchmark && configure; then build build-retry; fi
    fi
  fi
else
  skip_all_reason="configure ${step_status[${#step_status[@]}-1]}"
fi

# After a failed build, an executable may be left over from an earlier call although its sources
# changed: flag it in the step's note when one of the build's FAILED: lines belongs to its target
# (the target is read from build.ninja, since a program's name may differ from its target's).
stale_note() {
  [[ "${build_ok:-0}" != 1 && -e "$1" && -s "$work/build.log" ]] || return 0
  local rel="${1#"$BUILD_DIR"/}" target="" line
  line="$(awk -v r="build ${rel}" '(index($0, r " ") == 1 || index($0, r ":") == 1) && /_LINKER__/ { print; exit }' \
    "$BUILD_DIR/build.ninja" 2>/dev/null)"
  [[ -n "$line" ]] && target="$(sed -E 's/.*_LINKER__([^ ]+)_[A-Za-z]+ .*/\1/' <<<"$line")"
  if grep -E '^FAILED: ' "$work/build.log" | grep -qF -e "FAILED: ${rel}" ${target:+-e "CMakeFiles/${target}.dir/"}; then
    step_notes[${#step_notes[@]}-1]="STALE binary (its build failed) ${step_notes[${#step_notes[@]}-1]}"
  fi
}

bin_gpu_tests="${BUILD_DIR}/test/kvmosaic_gpu_tests"
bin_demo="${BUILD_DIR}/examples/kvmosaic_demo"

# --- 2. GPU tests (Catch2 v2: one reporter per run -> JUnit file, failures summarised) -------------

summarize_junit() {   # prints totals and the failed test cases of a JUnit file
  python3 - "$1" <<'EOF' 2>&1 || grep -E -m 40 '<failure|<error' "$1"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
cases = list(root.iter("testcase"))
bad_cases = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
assertions = sum(int(s.get("tests", 0) or 0) for s in suites)   # Catch2 v2 counts assertions here
print("junit: %d test cases (%d assertions), %d failed" % (len(cases), assertions, len(bad_cases)))
shown = 0
for case in root.iter("testcase"):
    for bad in list(case.findall("failure")) + list(case.findall("error")):
        shown += 1
        if shown > 25:
            continue
        where = (case.get("classname", "") + " / " + case.get("name", "")).strip(" /")
        msg = (bad.get("message") or "").strip()
        text = " | ".join(l.strip() for l in (bad.text or "").strip().splitlines()[:4])
        print("  FAILED %s: %s %s" % (where, msg, text)[:400])
if shown > 25:
    print("  ... and %d more failures" % (shown - 25))
EOF
}

if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_GPU_TESTS:-0}" != 1 ]]; then
  if [[ ! -x "$bin_gpu_tests" ]]; then
    if [[ -n "$skip_all_reason" ]]; then record gpu_tests SKIP 0 "$skip_all_reason"
    else record gpu_tests FAIL 0 "$bin_gpu_tests not built"
    fi
  else
    gpu_args=()
    if [[ -n "${GPU_TEST_ARGS:-}" ]]; then read -r -a gpu_args <<<"${GPU_TEST_ARGS}"; fi
    rm -f "$OUT/gpu_tests.xml"
    step gpu_tests 300 "$bin_gpu_tests" "${gpu_args[@]}" -r junit -o "$OUT/gpu_tests.xml"
    gpu_rc=$rc
    gpu_status="${step_status[${#step_status[@]}-1]}"
    if [[ -s "$OUT/gpu_tests.xml" ]]; then
      summarize_junit "$OUT/gpu_tests.xml" >"$work/junit.txt"
      tee -a "$LOG" <"$work/junit.txt"
      step_notes[${#step_notes[@]}-1]="$(head -n 1 "$work/junit.txt")"
      if grep -qE '^junit: (0 test cases|.*\(0 assertions\))' "$work/junit.txt" && (( gpu_rc == 0 )); then
        step_status[${#step_status[@]}-1]=WARN
      fi
      (( gpu_rc == 0 )) || add_details "gpu_tests: failures" "$work/junit.txt"
    fi
    stale_note "$bin_gpu_tests"
    # A crash or a hang leaves no JUnit file: rerun with the console reporter and --durations so the
    # log shows how far it got (and the message of the crash).
    if [[ "$gpu_status" != SKIP* ]] && { (( gpu_rc == 124 || gpu_rc == 137 || gpu_rc >= 128 )) || [[ ! -s "$OUT/gpu_tests.xml" ]]; }; then
      if t="$(step_timeout 120)"; then
        banner "gpu_tests rerun with the console reporter (limit ${t}s)"
        run_cmd "$t" "$bin_gpu_tests" "${gpu_args[@]}" -r console --durations yes
      fi
    fi
  fi
fi

# --- 3. host tests through CTest (same build tree) -------------------------------------------------

if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_HOST_TESTS:-0}" != 1 ]]; then
  exclude=(-E '^package_')
  [[ "${WITH_PACKAGE_TESTS:-0}" == 1 ]] && exclude=()
  mark=$(wc -l <"$LOG")
  step host_tests 400 ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$JOBS" \
    --timeout 300 -LE gpu "${exclude[@]}"
  note="$(tail -n +"$((mark + 1))" "$LOG" | grep -E 'tests passed|tests failed' | tail -n 1)"
  [[ -n "$note" ]] && step_notes[${#step_notes[@]}-1]="${note} ${step_notes[${#step_notes[@]}-1]}"
fi

# --- 4. compute-sanitizer on the small cases ---------------------------------------------------------

if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_SANITIZER:-0}" != 1 ]]; then
  sanitizer="$(command -v compute-sanitizer || true)"
  for tool in $SANITIZER_TOOLS; do
    if [[ -z "$sanitizer" ]]; then record "sanitize_${tool}" FAIL 0 "compute-sanitizer not found"; continue; fi
    if [[ ! -x "$bin_gpu_tests" ]]; then record "sanitize_${tool}" SKIP 0 "no $bin_gpu_tests"; continue; fi
    mark=$(wc -l <"$LOG")
    step "sanitize_${tool}" 240 "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 30 \
      "$bin_gpu_tests" "$SANITIZE_SPEC"
    case "${step_status[${#step_status[@]}-1]}" in SKIP*) continue ;; esac
    stale_note "$bin_gpu_tests"
    if tail -n +"$((mark + 1))" "$LOG" | grep -q 'No test cases matched'; then
      step_status[${#step_status[@]}-1]=WARN
      step_notes[${#step_notes[@]}-1]="no test case matches ${SANITIZE_SPEC}"
    else
      tail -n +"$((mark + 1))" "$LOG" | grep -E '^========= +(Invalid|Race|Error|Program hit|Uninitialized|Barrier|Saved host backtrace|    at )' \
        | add_details "sanitize_${tool}: first reports"
      note="$(tail -n +"$((mark + 1))" "$LOG" | grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | tail -n 1)"
      [[ -n "$note" ]] && step_notes[${#step_notes[@]}-1]="${note#========= } ${step_notes[${#step_notes[@]}-1]}"
    fi
  done
fi

# --- 5. benchmarks ---------------------------------------------------------------------------------

bench_outputs=()
if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_BENCH:-0}" != 1 && -z "$skip_all_reason" ]]; then
  bench_args=()
  if [[ -n "${BENCH_ARGS:-}" ]]; then read -r -a bench_args <<<"${BENCH_ARGS}"; fi
  mapfile -t bench_bins < <(find "${BUILD_DIR}/benchmark" -maxdepth 1 -type f -perm -u+x 2>/dev/null | sort)
  if (( ${#bench_bins[@]} == 0 )); then
    record bench FAIL 0 "no executables in ${BUILD_DIR}/benchmark"
  fi
  mkdir -p "$work/bench"
  for bin in "${bench_bins[@]}"; do
    name="$(basename "$bin" | sed 's/[^A-Za-z0-9._-]/_/g')"
    name="bench_${name#bench_}"          # bench_decode -> bench_decode.json, foo -> bench_foo.json
    step "$name" 300 "$bin" "--benchmark_out=$work/bench/${name}.json" \
      --benchmark_out_format=json "${bench_args[@]}"
    stale_note "$bin"
    [[ -s "$work/bench/${name}.json" ]] && bench_outputs+=("$work/bench/${name}.json")
  done
  if (( ${#bench_outputs[@]} <= 3 )); then
    for f in "${bench_outputs[@]}"; do cp "$f" "$OUT/"; done
  else   # keep the number of returned files <= 8: one merged file
    python3 - "$OUT/bench_all.json" "${bench_outputs[@]}" <<'EOF' | tee -a "$LOG"
import json, os, sys
merged = {"context": None, "benchmarks": [], "executables": []}
for path in sys.argv[2:]:
    exe = os.path.basename(path)[len("bench_"):-len(".json")]
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:   # e.g. the benchmark crashed while writing it
        with open(path, errors="replace") as f:
            head = f.read(4000)
        merged.setdefault("unreadable", []).append({"executable": exe, "error": str(e), "head": head})
        print("merge: %s is not valid JSON (%s); its first 4000 characters are kept" % (path, e))
        continue
    merged["executables"].append(exe)
    merged["context"] = merged["context"] or data.get("context")
    for b in data.get("benchmarks", []):
        b["executable"] = exe
        merged["benchmarks"].append(b)
with open(sys.argv[1], "w") as f:
    json.dump(merged, f, indent=1)
print("merged %d benchmark files into %s" % (len(sys.argv) - 2, sys.argv[1]))
EOF
  fi
fi

# --- 6. PyTorch SDPA baseline ------------------------------------------------------------------------

if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_BENCH:-0}" != 1 && "${SKIP_SDPA:-0}" != 1 ]]; then
  sdpa_args=()
  if [[ -n "${SDPA_ARGS:-}" ]]; then read -r -a sdpa_args <<<"${SDPA_ARGS}"; fi
  saved_skip="$skip_all_reason"; skip_all_reason=""     # independent of our build
  step sdpa 300 python3 -u benchmark/sdpa_baseline.py --out "$OUT/sdpa.json" "${sdpa_args[@]}"
  skip_all_reason="$saved_skip"
fi

# --- 7. demo ---------------------------------------------------------------------------------------

if [[ "${ONLY_BUILD:-0}" != 1 && "${SKIP_DEMO:-0}" != 1 ]]; then
  if [[ -x "$bin_demo" ]]; then
    demo_args=()
    if [[ -n "${DEMO_ARGS:-}" ]]; then read -r -a demo_args <<<"${DEMO_ARGS}"; fi
    step demo 180 "$bin_demo" --json "$OUT/demo.json" "${demo_args[@]}"
    stale_note "$bin_demo"
  elif [[ -n "$skip_all_reason" ]]; then record demo SKIP 0 "$skip_all_reason"
  else record demo FAIL 0 "$bin_demo not built"
  fi
fi

# --- summary -----------------------------------------------------------------------------------------

# log.txt must stay under 16 MiB to come back: keep its head and tail.
if (( $(stat -c %s "$LOG") > 15 * 1024 * 1024 )); then
  { head -c $((4 * 1024 * 1024)) "$LOG"; printf '\n\n[... log truncated by run-gpu-suite.sh ...]\n\n'
    tail -c $((10 * 1024 * 1024)) "$LOG"; } >"$work/log.trunc" && mv "$work/log.trunc" "$LOG"
fi

digest() {   # short digest of each returned JSON / XML file
  python3 - "$OUT" <<'EOF' 2>&1
import json, os, sys
out = sys.argv[1]
def clip(s, n=1200):
    return s if len(s) <= n else s[:n] + " ...[clipped]"
for fn in sorted(os.listdir(out)):
    path = os.path.join(out, fn)
    if not fn.endswith(".json"):
        continue
    print("--- %s (%d bytes)" % (fn, os.path.getsize(path)))
    try:
        with open(path) as f:
            data = json.load(f)
    except Exception as e:
        print("  unreadable JSON: %s" % e)
        continue
    lines = []
    if isinstance(data, dict) and "benchmarks" in data:
        std = {"name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
               "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit",
               "aggregate_name", "aggregate_unit", "executable", "label"}
        for b in data["benchmarks"]:
            if b.get("error_occurred"):
                lines.append("  %s ERROR %s" % (b.get("name"), b.get("error_message", "")))
                continue
            ctr = " ".join("%s=%.4g" % (k, v) for k, v in b.items()
                           if k not in std and isinstance(v, (int, float)) and not isinstance(v, bool))
            lines.append("  %s %.4g%s %s" % (b.get("name"), b.get("real_time", float("nan")),
                                             b.get("time_unit", ""), ctr))
        lines.insert(0, "  %d entries" % len(data["benchmarks"]))
    elif isinstance(data, dict) and "results" in data and "hbm_read_gbps" in data:
        lines.append("  device=%s torch=%s hbm_read_gbps=%.0f" % (data.get("device"), data.get("torch"),
                                                                 data.get("hbm_read_gbps") or 0))
        for b in data.get("best", []):
            lines.append("  best B=%s S=%s %s %.1f us %.0f GB/s" % (b.get("batch"), b.get("context"),
                         b.get("backend"), b.get("time_us") or 0, b.get("gbps") or 0))
    else:
        items = data if isinstance(data, list) else [data]
        lines = ["  " + json.dumps(item, separators=(",", ":")) for item in items[:12]]
    if isinstance(data, dict) and data.get("unreadable"):
        lines.append("  unreadable inputs: %s" % ", ".join(u["executable"] for u in data["unreadable"]))
    print(clip("\n".join(lines[:22])))
EOF
}

banner "summary"
{
  echo "GPU SUITE SUMMARY ($((SECONDS - suite_start))s of ${SUITE_TIME_LIMIT}s; device: ${gpu_name:-none})"
  printf '%-22s %-10s %6s  %s\n' step status secs note
  failed=0
  for i in "${!step_names[@]}"; do
    printf '%-22s %-10s %6s  %s\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}" "${step_notes[$i]:0:110}"
    case "${step_status[$i]}" in FAIL|TIMEOUT|"SKIP(time)") failed=1 ;; esac
  done
  if [[ -s "$details" ]]; then echo; echo "failure excerpts (more in log.txt):"; head -c 3000 "$details"; fi
  echo
  digest
  echo
  nfiles=$(find "$OUT" -type f | wc -l)
  echo "files in \$OUT ($nfiles): $(cd "$OUT" && find . -type f -printf '%P(%s) ' | sort)"
  (( nfiles <= 8 )) || echo "WARNING: more than 8 files under \$OUT; some will not come back"
  if (( failed )); then echo "RESULT: FAILED"; else echo "RESULT: OK"; fi
} >"$work/summary.txt"
cat "$work/summary.txt" >>"$LOG"
cat "$work/summary.txt"
grep -q '^RESULT: OK' "$work/summary.txt"
