#!/bin/bash
# s43 run 8: run6's build (`new`: select_pages_kernel lets the split kernel in at its start),
# run7's (`new2`: select_spans_kernel too) and 242242b (`head`), three rounds alternating, the
# page-granular mean_keys rows where run6 and run7 disagreed.
# Run from the repository root, with build-carry/s43/bins8.tar.xz carried.
mkdir -p /tmp/s43r8 && tar xJf build-carry/s43/bins8.tar.xz -C /tmp/s43r8
cd /tmp/s43r8
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new bench_new2 bench_head; do
  timeout 100 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
cd $OUT && tar czf results.tgz results && rm -rf results
