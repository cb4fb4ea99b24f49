#!/bin/bash
# s39 run 5: fused (the block-key scoring kernel takes a page-granular step's top-k in the last
# CTA of each (sequence, KV head)) against the committed build; GPU tests of the selection.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r5 && tar xJf bins5.tar.xz -C /tmp/s39r5
cd /tmp/s39r5
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 120 ./t_packed_fused "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
timeout 150 ./t_select_fused > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt; tail -n 3 $R/gpu_select.txt
grep -c "allowed: a shape" $R/gpu_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('packed_bitmap_g4_',''), round(b['time_us'],1), 'sel', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_fused bench_final; do
  timeout 60 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 100 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size ./bench_fused --benchmark_filter="$M16" > $R/ncu_step_bench_fused.txt 2>&1
grep -E "void|duration" $R/ncu_step_bench_fused.txt | sed -E 's/\(select_params.*//; s/\(split_params.*//; s/\(packed_block.*//; s/\(decode_params.*//' | paste - - | awk '{print $2, $NF}'
cd $OUT && tar czf results.tgz results && rm -rf results
