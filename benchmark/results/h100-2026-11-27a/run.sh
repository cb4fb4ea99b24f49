#!/usr/bin/env bash
# Session 19, device runs 2 and 4 (run 3: profile2.sh): the selection kernels reworked (scoring:
# 16 spans per warp with their loads in flight, one reduce-scatter for 32 (span, head) sums;
# top-k: 1024 threads, row marks in shared memory) and packed_bitmap's sm_90 kernel copying only
# the 16-row blocks a selection reads. GPU tests of the selections, eviction, exact tokens and
# packed_bitmap, then an A/B of bench_decode against the previous binary (bench_decode_base,
# built at 9b3a9a3) in the same run, then per-kernel durations (ncu) of a packed mean_keys step.
# Run 2 had warp-aggregated histogram atomics (__match_any_sync) instead of 1024 threads: twice
# slower top-k (results of that run not kept). Binaries built on the development machine for
# sm_90, carried in build-carry/.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
for t in gpu_select gpu_eviction gpu_exact gpu_packed; do
  [ -x ./$t ] || continue
  timeout 150 ./$t > $R/$t.txt 2>&1; echo "$t rc $?" >> $R/env.txt; tail -2 $R/$t.txt
done
echo "== A/B"; date
C='context:131072'
F="^(hbm_read|dense_decode/batch:(1|8)/$C/|packed_bitmap_decode/batch:(1|8)/$C|packed_bitmap_mean_keys_decode/batch:(1|8)/$C/|dense_mean_keys_decode/batch:(1|8)/$C/.*block:16/|dense_quest_decode/batch:(1|8)/$C/.*page:0|dense_quest_blocks_decode/batch:(1|8)/$C/|dense_chunks_decode/batch:(1|8)/$C/)"
for b in bench_decode_base bench_decode; do
  KVMOSAIC_BENCH_KV=synthetic timeout 230 ./$b --benchmark_filter="$F" --benchmark_out=$R/$b.json --benchmark_out_format=json > $R/$b.txt 2>&1
  echo "$b rc $?" >> $R/env.txt
done
python3 - "$R" <<'PY'
import json, sys
r = sys.argv[1]
def rows(n):
    d = json.load(open(f"{r}/{n}.json"))
    return {b["name"]: (b.get("time_us", b["real_time"]), b.get("select_us")) for b in d["benchmarks"]}
a, b = rows("bench_decode_base"), rows("bench_decode")
for k in a:
    if k in b:
        sa, sb = a[k][1], b[k][1]
        sel = f"  select {sa:.1f} -> {sb:.1f}" if sa else ""
        print(f"{k.split('/iterations')[0]:110s} {a[k][0]:9.1f} -> {b[k][0]:9.1f}{sel}")
PY
echo "== ncu"; date
for bin in bench_decode_base bench_decode; do
  KVMOSAIC_BENCH_KV=synthetic timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread \
    --kernel-name regex:"score_pages|select_spans|decode_partial|merge" --launch-count 4 \
    ./$bin --benchmark_filter="packed_bitmap_mean_keys_decode/batch:8/$C/.*budget_inverse:16/" --benchmark_min_time=0.01 > $R/ncu_$bin.txt 2>&1
  echo "$bin"; grep -E "^  void|gpu__time|inst_exec|registers" $R/ncu_$bin.txt | sed 's/(select_params.*//; s/(.*//' | head -16
done
date
