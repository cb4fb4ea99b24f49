#!/usr/bin/env bash
# Session 19, first device run: per-kernel durations (ncu, gpu__time_duration) of one
# packed_bitmap + mean_keys 1/16 step at batch 8 and 1, 128K (scoring, top-k, split kernel, merge).
set -u
R=$OUT/r; mkdir -p $R  # results: run1/
cd build-carry
for b in 8 1; do
  F="packed_bitmap_mean_keys_decode/batch:$b/context:131072/.*budget_inverse:16/"
  KVMOSAIC_BENCH_KV=synthetic timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum \
    --kernel-name regex:"score_pages|select_spans|decode_partial|merge" --launch-count 12 \
    ./bench_decode --benchmark_filter="$F" --benchmark_min_time=0.01 > $R/ncu_b$b.txt 2>&1
  echo "rc $?" >> $R/ncu_b$b.txt
  grep -E "^  [a-z_].*\(|gpu__time_duration" $R/ncu_b$b.txt | paste - - | awk '{print $1, $(NF)}' | head -20
done
