#!/bin/bash
# s44 run 7: `f2` (run 6's committed build with the scoring's pair step as in main: one byte load
# a channel, the value by its conversion; the shorter pair step spilled 12 bytes at 8 heads) against
# `final` (run 6's) and main (0ebaf67), three rounds alternating, nothing beside them; then every
# packed_bitmap GPU case on f2.
# Run from the repository root, with build-carry/s44/bins1.tar.xz, bins6.tar.xz, bins7.tar.xz carried.
mkdir -p /tmp/s44r7 && for t in 1 6 7; do tar xJf build-carry/s44/bins$t.tar.xz -C /tmp/s44r7; done
cd /tmp/s44r7
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_f2 bench_final bench_main; do
  timeout 100 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
timeout 280 ./t_pbf2 "[packed_bitmap]" > $R/gpu_packed.txt 2>&1; echo "rc $?" >> $R/gpu_packed.txt
tail -n 3 $R/gpu_packed.txt
cd $OUT && tar czf results.tgz results && rm -rf results
