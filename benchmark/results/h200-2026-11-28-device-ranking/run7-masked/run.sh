#!/bin/bash
# What reading around evicted rows costs: select::all's step with and without 40 evicted rows per
# sequence, beside TOVA's evicting step, alternated twice in one call.
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/build-gpuB:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
for i in 1 2; do
  build-gpuB/bench_decode --benchmark_filter='append_step|dense_tova_evict_step' --benchmark_out=$R/masked_$i.json --benchmark_out_format=json > $R/masked_$i.txt 2>&1
done
cd $OUT && tar czf results.tgz r && rm -rf r
