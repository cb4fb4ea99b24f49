#!/usr/bin/env bash
# Session 18, second device run: packed_bitmap's sm_90 kernel reading V two chunks per gather
# (`gathers_value_pairs`). The packed_bitmap GPU tests, then bench_decode (packed_bitmap with
# select::all and select::mean_keys against our dense and dense + mean_keys in the same run), an
# A/B of the batch 8, 128K rows against the binary of h100-2026-11-26e (bench_decode_e: one V
# chunk per gather), then PyTorch's SDPA. Binaries built on the development machine for sm_90,
# carried in build-carry/.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
echo "== tests"; date
timeout 200 ./gpu_packed "[packed_bitmap]" > $R/gpu_packed.txt 2>&1; echo "tests rc $?" >> $R/env.txt
tail -3 $R/gpu_packed.txt
echo "== bench"; date
F='^(hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|dense_mean_keys_decode/.*/block:16/|packed_bitmap_decode|packed_bitmap_mean_keys_decode)'
KVMOSAIC_BENCH_KV=synthetic timeout 200 ./bench_decode --benchmark_filter="$F" --benchmark_out=$R/bench.json --benchmark_out_format=json > $R/bench.txt 2>&1; echo "bench rc $?" >> $R/env.txt
grep -E "packed|dense_decode" $R/bench.txt | awk '{print $1, $2}'
echo "== A/B at batch 8, 128K"; date
F='^(dense_decode/batch:8/context:131072/|packed_bitmap_decode/batch:8/context:131072|packed_bitmap_mean_keys_decode/batch:8/context:131072/.*budget_inverse:16)'
for b in bench_decode_e bench_decode; do
  KVMOSAIC_BENCH_KV=synthetic timeout 100 ./$b --benchmark_filter="$F" --benchmark_out=$R/ab_$b.json --benchmark_out_format=json > $R/ab_$b.txt 2>&1
  echo "$b"; grep -E "packed|dense_decode" $R/ab_$b.txt | awk '{print $1, $2}'
done
echo "== torch"; date
cd ..
timeout 60 python3 benchmark/sdpa_baseline.py --shapes 1x32768,1x131072,8x32768,8x131072 --out $R/sdpa.json > $R/sdpa.txt 2>&1; echo "sdpa rc $?" >> $R/env.txt
date
