#!/usr/bin/env bash
# Session 17 device run: the packed_bitmap GPU tests, then bench_decode (packed_bitmap with
# select::all and select::mean_keys against our dense in the same run), then PyTorch's SDPA on the
# same shapes. Binaries built on the development machine for sm_90, carried in build-carry/.
set -u
# The first call ran the tests with "-r junit" under a 200 s timeout and was cut off (the junit
# reporter is slow with 20M assertions); gpu_packed.txt is the rerun in a second call, as below.
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
timeout 400 ./packed_gpu_test "[packed_bitmap]" -d yes > $R/gpu_packed.txt 2>&1; echo "tests rc $?" >> $R/env.txt
echo "== bench"; date
F='^(hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|dense_mean_keys_decode/.*/block:16/|packed_bitmap_decode|packed_bitmap_mean_keys_decode)'
KVMOSAIC_BENCH_KV=synthetic timeout 330 ./bench_decode --benchmark_filter="$F" --benchmark_out=$R/bench.json --benchmark_out_format=json > $R/bench.txt 2>&1; echo "bench rc $?" >> $R/env.txt
echo "== torch"; date
cd ..
timeout 60 python3 benchmark/sdpa_baseline.py --shapes 1x32768,1x131072,8x32768,8x131072 --out $R/sdpa.json > $R/sdpa.txt 2>&1; echo "sdpa rc $?" >> $R/env.txt
date
