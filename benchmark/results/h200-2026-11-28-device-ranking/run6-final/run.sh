#!/bin/bash
# Benchmarks: this build (bench_decode), the previous main with this session's benchmark file
# (bench_decode_before: the evicting-step rows) and with its own (bench_decode_orig: the score
# rows as they were), alternated twice in one call.
cd "$(dirname "$0")" && tar xzf bench.tgz && cd ..
export LD_LIBRARY_PATH=$PWD/build-gpuB:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $R/device.txt
ROWS='hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|append_step|evict_step'
SCORES='hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|dense_tova_scores|dense_h2o_scores'
for i in 1 2; do
  build-gpuB/bench_decode --benchmark_filter="$ROWS|dense_tova_scores|dense_h2o_scores" --benchmark_out=$R/after_$i.json --benchmark_out_format=json > $R/after_$i.txt 2>&1
  build-gpuB/bench_decode_before --benchmark_filter="$ROWS" --benchmark_out=$R/before_$i.json --benchmark_out_format=json > $R/before_$i.txt 2>&1
  build-gpuB/bench_decode_orig --benchmark_filter="$SCORES" --benchmark_out=$R/orig_$i.json --benchmark_out_format=json > $R/orig_$i.txt 2>&1
done
cd $OUT && tar czf results.tgz r && rm -rf r
