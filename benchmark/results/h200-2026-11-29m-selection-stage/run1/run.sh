#!/bin/bash
# s38 run 1: rot (block-query kernel in two load rounds, -lineinfo) vs base (main); ncu source counters.
cd "$(dirname "$0")"
tar xJf bins1.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
for round in 1 2; do
for b in bench_rot bench_base; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  grep -h "context" $R/${b}_$round.txt | awk -v b=$b '{print b, $1, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/retained:25\///; s/context:131072/128K/'
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 240 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,smsp__sass_inst_executed_op_shared_atom.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_atom.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum \
  ./bench_rot --benchmark_filter="$M" > $R/ncu_step.txt 2>&1
timeout 240 $NCU --clock-control none -k regex:"score_block|select_pages|decode_partial_packed" --launch-count 3 --section SourceCounters --section WarpStateStats --import-source yes -o $R/prof \
  ./bench_rot --benchmark_filter="$M" > $R/ncu_prof.txt 2>&1
$NCU -i $R/prof.ncu-rep --page source --csv --print-source cuda,sass > $R/src_cuda_sass.csv 2> $R/src_err.txt || \
  $NCU -i $R/prof.ncu-rep --page source --csv --print-source sass > $R/src_sass.csv 2>> $R/src_err.txt
$NCU -i $R/prof.ncu-rep --page details > $R/prof_details.txt 2>&1
ls -la $R; tail -3 $R/src_err.txt
grep -E "Profiling|time_duration|shared_atom|wavefronts" $R/ncu_step.txt | head -40
cd $OUT && tar czf results.tgz results && rm -rf results
