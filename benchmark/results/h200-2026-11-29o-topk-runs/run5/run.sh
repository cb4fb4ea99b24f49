#!/bin/bash
# s40 run 5: `new3` (the page top-k on a cluster of two CTAs per (sequence, KV head)) against
# `new2` (run 4's committed build) and `main`; the selection GPU tests on new3's code.
cd "$(dirname "$0")"
mkdir -p /tmp/s40r5 && tar xJf bins5.tar.xz -C /tmp/s40r5
cd /tmp/s40r5
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 240 ./t_sel_E "[select]" > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt; tail -n 4 $R/gpu_select.txt; grep -c "allowed: a$" $R/gpu_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('packed_bitmap_g4_',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_new3 bench_new2 bench_main; do
  timeout 90 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 60 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 --metrics gpu__time_duration.sum,smsp__inst_executed.sum ./bench_new3 --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_step_bench_new3.txt 2>&1
grep -E "^  [a-z].*\(|gpu__time|inst_executed" $R/ncu_step_bench_new3.txt | awk '{print $1, $2, $NF}' | head -15
cd $OUT && tar czf results.tgz results && rm -rf results
