#!/bin/bash
# H200: the span-scoring kernel with one located span per lane (k) against the build before it
# (e), alternating, on the selected rows at batch 8, 128K; then the GPU tests whose selections
# run on the device (select and packed_bitmap side by side, exact tokens if present).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
T="select packed_bitmap"; [ -x ./exact_tokens ] && T="$T exact_tokens"
for t in $T; do
  ( s=$(date +%s); timeout ${LIMIT:-200} ./$t --durations yes > $R/gpu_$t.txt 2>&1; rc=$?
    echo "$t rc=$rc $(( $(date +%s) - s ))s" > $R/rc_$t.txt ) &
done
wait
for t in $T; do echo "$(cat $R/rc_$t.txt) $(grep -E 'All tests passed|test cases:' $R/gpu_$t.txt | tail -1)"; done
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/|dense_mean_keys_decode/batch:8/context:131072|dense_quest_blocks_decode/batch:8/context:131072'
for b in e k k e; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{s=""; for(i=4;i<=NF;i++) if ($i ~ /^select_us=/) s=$i; print b, $1, $2, $3, s}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
done
cd $OUT && tar czf results.tgz results && rm -rf results
