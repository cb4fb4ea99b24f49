#!/bin/bash
# H200: packed_bitmap's row sources with 32-bit shared addresses (s) against the exp2 softmax
# step alone (e), alternating; then the packed GPU tests on s.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/'
for b in e s s e; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
done
timeout 200 ./packed_bitmap > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
tail -n 3 $R/gpu_packed_bitmap.txt
cd $OUT && tar czf results.tgz results && rm -rf results
