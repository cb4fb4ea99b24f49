#!/usr/bin/env bash
# Session 20: packed_bitmap's sm_90 split kernel with its page ids and segments loaded one refill
# ahead, and its rotations (q B_k when a segment opens, o' B_v^T when it closes) loading each basis
# element once for every head; stages 2 and 3 (KVMOSAIC_BENCH_PACKED_STAGES). GPU test of
# packed_bitmap (both kernels), then an A/B of bench_decode against main's binary
# (bench_decode_base, built at d540a84) in the same run, the kernel's SASS opcode counts and
# Nsight Compute on its split kernel. Binaries built on the development machine for sm_90,
# carried in build-carry/ with Debian's libbenchmark.so. README.md has the runs before this one.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
export LD_LIBRARY_PATH=$PWD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # the benchmarks' libbenchmark.so (Debian's)
trap 'cd $OUT && tar czf r.tar.gz r && rm -rf r' EXIT  # at most 8 files come back
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
for t in ${TESTS-gpu_packed gpu_select}; do
  [ -x ./$t ] || continue
  timeout 280 ./$t > $R/$t.txt 2>&1; echo "$t rc $?" >> $R/env.txt; tail -2 $R/$t.txt
done
[ -n "${SKIP_BENCH-}" ] && exit 0
echo "== A/B"; date
C='context:131072'
F="^(hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|packed_bitmap_decode/batch:(1|8)/context:(32768|131072)/|packed_bitmap_mean_keys_decode/batch:(1|8)/context:(32768|131072)/|dense_mean_keys_decode/batch:8/$C/.*block:16/)"
P="^(packed_bitmap_decode/batch:(1|8)/$C|packed_bitmap_mean_keys_decode/batch:(1|8)/$C/)"
run() {  # name binary filter [env]
  env $4 KVMOSAIC_BENCH_KV=synthetic timeout 250 ./$2 --benchmark_filter="$3" --benchmark_out=$R/$1.json --benchmark_out_format=json > $R/$1.txt 2>&1
  echo "$1 rc $?" >> $R/env.txt
}
run base bench_decode_base "$F" ""
run new bench_decode "$F" ""
run new_s3 bench_decode "$P" KVMOSAIC_BENCH_PACKED_STAGES=3
python3 - "$R" <<'PY'
import json, sys, os
r = sys.argv[1]
def rows(n):
    p = f"{r}/{n}.json"
    if not os.path.exists(p): return {}
    d = json.load(open(p))
    return {b["name"].split('/iterations')[0]: (b.get("time_us", b["real_time"]), b.get("select_us"), b.get("stages")) for b in d["benchmarks"]}
runs = ["base", "new", "new_s3"]
t = {n: rows(n) for n in runs}
print(f"{'row':100s} " + " ".join(f"{n:>9s}" for n in runs))
for k in t["base"]:
    print(f"{k:100s} " + " ".join(f"{t[n][k][0]:9.1f}" if k in t[n] else f"{'':9s}" for n in runs))
PY
echo "== sass"; date
# The sm_90 packed kernel's SASS (bf16, head_dim 128, group 4) and its opcode counts.
cuobjdump -sass bench_decode 2>/dev/null | awk '/Function : .*decode_partial_packed_mma_kernel.*Li128ELi4E/{p=1} p{print} p&&/^[[:space:]]*\.\.\.\.\.\.\.\./{p=0}' > $R/packed_mma.sass
grep -oE '^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_.]+' $R/packed_mma.sass | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn > $R/packed_mma_opcodes.txt
head -30 $R/packed_mma_opcodes.txt; wc -l $R/packed_mma.sass
echo "== ncu"; date
# The packed split kernel of one select::all step and one mean_keys 1/16 step (batch 8, 128K):
# duration, instructions, and where its warps stall.
M=gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio
for row in "packed_bitmap_decode/batch:8/$C/" "packed_bitmap_mean_keys_decode/batch:8/$C/.*budget_inverse:16/"; do
  n=$(echo $row | cut -c1-20)
  KVMOSAIC_BENCH_KV=synthetic timeout 100 ncu --clock-control none --metrics $M --kernel-name regex:"decode_partial_packed" --launch-count 1 \
    ./bench_decode --benchmark_filter="$row" --benchmark_min_time=0.01 > $R/ncu_$n.txt 2>&1
  echo "$row"; grep -E "^  void|gpu__|smsp__|sm__|launch__|dram__" $R/ncu_$n.txt | sed 's/(.*//' | head -30
done
date
