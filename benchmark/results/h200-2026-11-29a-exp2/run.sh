#!/bin/bash
# H200: packed_bitmap with (e) the exp2 softmax step and (er) also the page loop per run of one
# segment, against main (p5), alternating; then the packed GPU tests on er.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_decode/batch:8/context:131072|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/'
for b in p5 er e er p5 e; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
done
cd $OUT && tar czf results.tgz results && rm -rf results
