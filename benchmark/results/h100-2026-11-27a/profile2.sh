#!/usr/bin/env bash
# Per-kernel durations (ncu) of the selection kernels, previous binary against this one.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
for bin in bench_decode_base bench_decode; do
for row in "dense_mean_keys_decode/batch:8/context:131072/.*budget_inverse:16/page:0/block:16/" "dense_quest_decode/batch:1/context:131072/.*budget_inverse:16/page:0/"; do
  echo "== $bin $row"
  KVMOSAIC_BENCH_KV=synthetic timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread \
    --kernel-name regex:"score_pages|select_spans|select_pages" --launch-count 4 \
    ./$bin --benchmark_filter="$row" --benchmark_min_time=0.01 > $R/p.txt 2>&1
  grep -E "^  void|gpu__time|inst_exec|registers" $R/p.txt | sed 's/(select_params.*//' | head -12
done; done
