#!/bin/bash
# s43 run 2: a page-granular mean_keys step over block keys scored and chosen in one kernel on a
# cluster of 8 CTAs (`new`, `select_block_keys_kernel`) against the two kernels (`new` with
# KVMOSAIC_BENCH_FUSED_SELECTION=0) and `main` (a6b0ef3), two rounds alternating; ncu of the
# selection kernels; the GPU cases: packed_bitmap's [select] (the new fused case), test_cuda_select's
# [select] (the page top-k as a shared function), and the window case on main's code (`t_bug`).
# Run from the repository root, with build-carry/s43/bins2.tar.xz and bins1.tar.xz carried.
mkdir -p /tmp/s43r2 && tar xJf build-carry/s43/bins2.tar.xz -C /tmp/s43r2 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r2 bench_main t_bug libbenchmark.so.1debian libgomp.so.1
cd /tmp/s43r2
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 280 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt;
 timeout 60 ./t_bug "[exact_tokens][select]" > $R/gpu_window_main.txt 2>&1; echo "rc $?" >> $R/gpu_window_main.txt) &
TP1=$!
(timeout 280 ./t_sel "[select]" > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt) &
TP2=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1), 'fused', b.get('fused_selection',-1))"; }
for round in 1 2; do
  timeout 120 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/bench_new_$round.json --benchmark_out_format=json > $R/bench_new_$round.txt 2>&1
  show $R/bench_new_$round.json new
  KVMOSAIC_BENCH_FUSED_SELECTION=0 timeout 120 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/bench_two_$round.json --benchmark_out_format=json > $R/bench_two_$round.txt 2>&1
  show $R/bench_two_$round.json two
  timeout 120 ./bench_main --benchmark_filter="$F" --benchmark_out=$R/bench_main_$round.json --benchmark_out_format=json > $R/bench_main_$round.txt 2>&1
  show $R/bench_main_$round.json main
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for v in 1 0; do
  KVMOSAIC_BENCH_FUSED_SELECTION=$v timeout 90 $NCU --clock-control none -k regex:"select_block_keys|score_block_keys|select_pages_kernel|packed_block_queries|decode_partial_packed|merge" --launch-count 8 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread ./bench_new --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_fused$v.txt 2>&1
  grep -E "^  [a-z_]+.*\(|gpu__time|inst_executed|registers" $R/ncu_fused$v.txt | awk -v v=$v '{print "fused" v, $0}' | cut -c1-150 | head -40
done
wait $TP1 $TP2
for f in gpu_packed_select gpu_select gpu_window_main; do echo "== $f"; grep -E "FAILED|failed|passed|No tests" $R/$f.txt | head -8; tail -n 3 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
