#!/bin/bash
# s44 run 5: where batch 8, 128K loses the selection kernels' savings. One build of e5 with a
# switch for this run only (KVM_EXP; not committed): 0 as committed (every boundary a
# programmatic dependent), 1 the page top-k launched plainly where the scoring's grid is not
# resident at once, 2 the scoring too, 3 the query rotation too (main's launches with e5's
# kernels); and main (0ebaf67). Three rounds alternating, nothing beside them.
# Run from the repository root, with build-carry/s44/bins1.tar.xz and bins5.tar.xz carried.
mkdir -p /tmp/s44r5 && for t in 1 5; do tar xJf build-carry/s44/bins$t.tar.xz -C /tmp/s44r5; done
cd /tmp/s44r5
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for m in 0 1 2 3 main; do
  if [ $m = main ]; then b=bench_main; n=main; else b=bench_x; n=x$m; fi
  KVM_EXP=$m timeout 100 ./$b --benchmark_filter="$F" --benchmark_out=$R/${n}_$round.json --benchmark_out_format=json > $R/${n}_$round.txt 2>&1
  show $R/${n}_$round.json $n
done
done
cd $OUT && tar czf results.tgz results && rm -rf results
