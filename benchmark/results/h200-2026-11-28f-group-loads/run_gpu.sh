#!/bin/bash
# packed_bitmap whole-group loads (g = 2, 4), H200: GPU tests, then bench A/B against main before.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/device.txt
if [ "${TESTS:-1}" = 1 ]; then
timeout 240 ./packed_bitmap --durations yes > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
timeout 120 ./packed_eviction --durations yes > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt
tail -3 $R/gpu_packed_bitmap.txt $R/gpu_packed_eviction.txt
fi
F=${BENCH_FILTER:-'hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|packed_bitmap_decode|packed_bitmap_g[24]_decode|packed_bitmap_mean_keys_decode|packed_bitmap_g4_mean_keys_decode'}
for i in ${ROUNDS:-1}; do
  ./bench_new --benchmark_filter="$F" --benchmark_out=$R/new_$i.json --benchmark_out_format=json > $R/new_$i.txt 2>&1
  ./bench_old --benchmark_filter="$F" --benchmark_out=$R/old_$i.json --benchmark_out_format=json > $R/old_$i.txt 2>&1
done
grep -h "batch:8/context:131072" $R/new_*.txt $R/old_*.txt | awk '{print $1, $2, $3}'
cd $OUT && tar czf results.tgz results && rm -rf results
