#!/bin/bash
# s38 run 2: new (block-query grid by the layout's segments, PDL for block-key scoring and page
# top-k, top-k page ids prefetched) vs base (main); packed stages 3/4 under mean_keys; GPU tests.
cd "$(dirname "$0")"
tar xJf bins2.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 150 ./t_packed_bitmap "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
timeout 150 ./t_select > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt; tail -n 3 $R/gpu_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|dense_quest_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:16/|dense_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:0/block:0/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1))"; }
for round in 1 2; do
for b in bench_new bench_base; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
for st in 3 4; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st ./bench_new --benchmark_filter="$M" --benchmark_out=$R/bench_new_stages$st.json --benchmark_out_format=json > $R/bench_new_stages$st.txt 2>&1
  show $R/bench_new_stages$st.json stages$st
done
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 200 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size \
  ./bench_new --benchmark_filter="$M16" > $R/ncu_step.txt 2>&1
grep -E "void|duration|grid_size" $R/ncu_step.txt | sed -E 's/\(select_params.*//; s/\(split_params.*//'
nsys=$(which nsys || ls /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
cd $OUT && tar czf results.tgz results && rm -rf results
