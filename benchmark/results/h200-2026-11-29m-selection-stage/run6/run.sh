#!/bin/bash
# s38 run 6: list (a split of small pages lists its page ids and segments in shared memory, so
# its refills read no global memory) vs v5 (main's code); GPU tests of packed_bitmap's [select].
cd "$(dirname "$0")"
tar xJf bins6.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 150 ./t_packed_list "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_list bench_v5; do
  timeout 60 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
cd $OUT && tar czf results.tgz results && rm -rf results
