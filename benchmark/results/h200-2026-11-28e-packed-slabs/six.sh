#!/bin/bash
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/six; mkdir -p $R
F='packed_bitmap_decode|packed_bitmap_mean_keys_decode/batch:8/context:131072'
for i in 1 2; do
  ./bench_new --benchmark_filter="$F" > $R/new_$i.txt 2>&1
  ./bench_six --benchmark_filter="$F" > $R/six_$i.txt 2>&1
done
grep -h "manual_time" $R/*.txt | awk '{print $1, $2, $3}' | sed 's/group:4.head_dim:128.retained:25.//'
