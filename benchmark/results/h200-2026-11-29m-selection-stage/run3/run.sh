#!/bin/bash
# s38 run 3: v3 (block-query kernel: 32 rows a round, grid by the layout's segments, first round
# before the query staging; scoring kernel: chunks of spans per CTA, keys by cp.async two chunks
# ahead, PDL; top-k: PDL, page ids prefetched) vs base (main). GPU tests (one-shape builds).
cd "$(dirname "$0")"
tar xJf bins3.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 170 ./t_packed_bitmap "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
timeout 120 ./t_select > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt; tail -n 3 $R/gpu_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|dense_quest_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:16/|dense_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:0/block:0/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_v3 bench_base; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 150 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
  ./bench_v3 --benchmark_filter="$M16" > $R/ncu_step.txt 2>&1
grep -E "void|duration|grid_size|dram" $R/ncu_step.txt | sed -E 's/\(select_params.*//; s/\(split_params.*//'
timeout 150 $NCU --clock-control none -k regex:"packed_block_queries|score_block" --launch-count 2 --section SourceCounters --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --import-source yes -o $R/prof \
  ./bench_v3 --benchmark_filter="$M16" > $R/ncu_prof.txt 2>&1
$NCU -i $R/prof.ncu-rep --page source --csv --print-source cuda,sass > $R/src_cuda_sass.csv 2> $R/src_err.txt
$NCU -i $R/prof.ncu-rep --page details > $R/prof_details.txt 2>&1
rm -f $R/prof.ncu-rep
cd $OUT && tar czf results.tgz results && rm -rf results
