#!/bin/bash
# s43 run 9: the page top-k launched as the block-key scoring's programmatic dependent where the
# scoring's grid is resident at once (`new3`) against eb05f8a (`cur`), three rounds alternating,
# nothing beside them; then packed_bitmap's [select] GPU cases on new3.
# Run from the repository root, with build-carry/s43/bins9.tar.xz carried.
mkdir -p /tmp/s43r9 && tar xJf build-carry/s43/bins9.tar.xz -C /tmp/s43r9
cd /tmp/s43r9
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='packed_bitmap(_g4)?_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new3 bench_cur; do
  timeout 100 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
timeout 200 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt
tail -n 3 $R/gpu_packed_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
