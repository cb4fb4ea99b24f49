#!/bin/bash
# H200, the session's final build (9ecc1b2): the dense and bitmap_tiles GPU tests with the backend
# of every shape (side by side), then bench_decode's packed_bitmap rows and our dense at batch 1
# and 8, 32K and 128K.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
for t in dense bitmap; do
  ( s=$(date +%s); timeout ${LIMIT:-240} ./$t --durations yes > $R/gpu_$t.txt 2>&1; rc=$?
    echo "$t rc=$rc $(( $(date +%s) - s ))s" > $R/rc_$t.txt ) &
done
wait
for t in dense bitmap; do echo "$(cat $R/rc_$t.txt) $(grep -E 'All tests passed|test cases:' $R/gpu_$t.txt | tail -1)"; done
F='dense_decode/batch:(1|8)/context:(32768|131072)/|packed_bitmap'
timeout ${BENCH_LIMIT:-280} ./bench --benchmark_filter="$F" --benchmark_out=$R/bench.json --benchmark_out_format=json > $R/bench.txt 2>&1
echo "bench rc=$?"
grep -h "context" $R/bench.txt | awk '{print $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
cd $OUT && tar czf results.tgz results && rm -rf results
