#!/usr/bin/env bash
# Session 18 device run: the packed_bitmap GPU tests with the sm_90 tensor-core kernel (and
# bitmap_tiles' GPU tests), then
# bench_decode (packed_bitmap with select::all and select::mean_keys against our dense in the same
# run), then PyTorch's SDPA on the same shapes. Binaries built on the development machine for
# sm_90, carried in build-carry/.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
timeout 300 ./gpu_packed "[packed_bitmap]" > $R/gpu_packed.txt 2>&1; echo "tests rc $?" >> $R/env.txt
tail -3 $R/gpu_packed.txt
# bitmap_tiles' row-source helpers moved to collective/row_sources.cuh: its GPU tests too.
timeout 200 ./gpu_bitmap > $R/gpu_bitmap.txt 2>&1; echo "bitmap tests rc $?" >> $R/env.txt
tail -3 $R/gpu_bitmap.txt
echo "== bench"; date
F='^(hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|dense_mean_keys_decode/.*/block:16/|packed_bitmap_decode|packed_bitmap_mean_keys_decode)'
KVMOSAIC_BENCH_KV=synthetic timeout 250 ./bench_decode --benchmark_filter="$F" --benchmark_out=$R/bench.json --benchmark_out_format=json > $R/bench.txt 2>&1; echo "bench rc $?" >> $R/env.txt
grep -E "packed|dense_decode" $R/bench.txt | awk '{print $1, $2}'
echo "== torch"; date
cd ..
timeout 60 python3 benchmark/sdpa_baseline.py --shapes 1x32768,1x131072,8x32768,8x131072 --out $R/sdpa.json > $R/sdpa.txt 2>&1; echo "sdpa rc $?" >> $R/env.txt
date
