#!/bin/bash
# s43 run 6: the page top-k lets the split kernel (a programmatic dependent) be scheduled at its
# start (`new`) against the committed 242242b (`head`), three rounds alternating: mean_keys and
# quest steps (page-granular top-k), select::all as a control.
# Run from the repository root, with build-carry/s43/bins6.tar.xz and bins1.tar.xz carried.
mkdir -p /tmp/s43r6 && tar xJf build-carry/s43/bins6.tar.xz -C /tmp/s43r6 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r6 libbenchmark.so.1debian libgomp.so.1
cd /tmp/s43r6
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new bench_head; do
  timeout 150 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
cd $OUT && tar czf results.tgz results && rm -rf results
