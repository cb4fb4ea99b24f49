#!/bin/bash
# packed_bitmap: the split plan weighs a split's rotations (H200): GPU tests, then bench_decode
# with the format's split cost and with none (KVMOSAIC_BENCH_SPLIT_COST=0: the plan before).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/device.txt
timeout 200 ./packed_bitmap --durations yes > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
timeout 60 ./packed_eviction --durations yes > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt
tail -n 3 $R/gpu_packed_bitmap.txt $R/gpu_packed_eviction.txt
F='hbm_read|dense_decode/batch:8/context:(32768|131072)/|packed_bitmap(_g4)?_decode/batch:8|packed_bitmap(_g4)?_mean_keys_decode/batch:8'
./bench_new --benchmark_filter="$F" --benchmark_out=$R/cost_format.json --benchmark_out_format=json > $R/cost_format.txt 2>&1
KVMOSAIC_BENCH_SPLIT_COST=0 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/cost_0.json --benchmark_out_format=json > $R/cost_0.txt 2>&1
grep -h "batch:8/context:131072" $R/cost_*.txt | awk '{print $1, $2, $3}'
cd $OUT && tar czf results.tgz results && rm -rf results
