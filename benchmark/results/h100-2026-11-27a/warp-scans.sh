#!/usr/bin/env bash
# Session 19, device run 9: the top-k kernels with cub's warp-scans block scan (tried, not kept:
# raking is what main has): the select GPU tests, then the A/B of the selected rows against
# bench_decode_base (main at 9b3a9a3).
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
timeout 150 ./gpu_select > $R/gpu_select.txt 2>&1; echo "gpu_select rc $?" >> $R/env.txt; tail -2 $R/gpu_select.txt
C='context:131072'
F="^(dense_decode/batch:(1|8)/$C/|packed_bitmap_mean_keys_decode/batch:(1|8)/$C/.*budget_inverse:16/|dense_mean_keys_decode/batch:(1|8)/$C/.*budget_inverse:16/page:0/block:16/|dense_quest_decode/batch:8/$C/.*budget_inverse:16/page:0/|dense_quest_blocks_decode/batch:8/$C/.*budget_inverse:16/|dense_chunks_decode/batch:(1|8)/$C/.*budget_inverse:16/)"
for b in bench_decode_base bench_decode; do
  KVMOSAIC_BENCH_KV=synthetic timeout 80 ./$b --benchmark_filter="$F" --benchmark_out=$R/$b.json --benchmark_out_format=json > $R/$b.txt 2>&1
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
