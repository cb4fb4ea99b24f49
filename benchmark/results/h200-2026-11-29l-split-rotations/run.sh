#!/bin/bash
# H200: (f) the final code (split kernel's rotations 32 loads deep, the sm_90 split kernel reading
# the step's rotated queries under mean_keys) against main, and (d) = f with the pages-of-64 split
# kernel bounded for four CTAs an SM (no spills) instead of five; rounds alternate binaries.
# GPU tests of packed_bitmap's selection cases on (f)'s code.
cd "$(dirname "$0")"
tar xJf bins3.tar.xz; tar xJf bins.tar.xz bench_main
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 200 ./t_packed "[select]" > $R/gpu_packed_bitmap_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap_select.txt
tail -n 3 $R/gpu_packed_bitmap_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap(_g4)?_decode/batch:(1|8)/context:131072/'
for round in 1 2; do
for b in bench_f bench_d bench_main; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  grep -h "context" $R/${b}_$round.txt | awk -v b=$b '{print b, $1, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/retained:25\///; s/context:131072/128K/'
done
done
cd $OUT && tar czf results.tgz results && rm -rf results
