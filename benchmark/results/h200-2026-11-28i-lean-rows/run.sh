#!/bin/bash
# packed_bitmap: lean row sources (one masked popcount per slab, V as 16-bit pairs), H200:
# the packed GPU tests, then bench_decode before/after alternating on the packed rows.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/device.txt
timeout 200 ./packed_bitmap --durations yes > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
tail -n 3 $R/gpu_packed_bitmap.txt
F=${F:-'hbm_read|dense_decode/batch:8/context:131072/|packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072'}
for round in 1 2; do
  for b in before new; do
    ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  done
done
grep -h "batch:8/context:131072" $R/*_1.txt $R/*_2.txt | awk '{print $1, $2, $3}'
cd $OUT && tar czf results.tgz results && rm -rf results
