#!/bin/bash
# H200: the block-key scoring kernel's pairs in whole runs of 16 (bench_s) against 277ce3a
# (bench_h), alternating, ncu of the scoring kernel for both; packed_bitmap's GPU selection
# cases on bench_s's code.
cd "$(dirname "$0")"
tar xJf bins6.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 150 ./t_packed "[select]" > $R/gpu_packed_bitmap_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap_select.txt
tail -n 3 $R/gpu_packed_bitmap_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
for round in 1 2; do
for b in bench_s bench_h; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  grep -h "context" $R/${b}_$round.txt | awk -v b=$b '{print b, $1, $2}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/retained:25\///; s/context:131072/128K/'
done
done
F1='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in bench_s bench_h; do
timeout 60 ncu --clock-control none -k regex:'score_block_keys' --launch-count 1 --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum ./$b --benchmark_filter="$F1" > $R/ncu_score_$b.txt 2>&1
echo $b; grep -E "duration|inst_executed|warps_active" $R/ncu_score_$b.txt | cut -c1-100
done
cd $OUT && tar czf results.tgz results && rm -rf results
