#!/bin/bash
# Session 28: packed_bitmap token scores and compaction on the device (H200).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/device.txt
./packed_eviction --durations yes > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt
[ -x ./eviction_test ] && { ./eviction_test > $R/gpu_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_eviction.txt; }
F='hbm_read|packed_bitmap_decode|packed_bitmap_tova_scores_decode'
for i in 1 2; do
  ./bench_new --benchmark_filter="$F" --benchmark_out=$R/new_$i.json --benchmark_out_format=json > $R/new_$i.txt 2>&1
  ./bench_old --benchmark_filter="$F" --benchmark_out=$R/old_$i.json --benchmark_out_format=json > $R/old_$i.txt 2>&1
done
cd $OUT && tar czf results.tgz results
