#!/bin/bash
# s43 run 4: the page top-k on a cluster of 8 CTAs of 256 threads per (sequence, KV head) (`new`,
# the default where clusters launch) against one CTA of 1024 (`new` with KVMOSAIC_BENCH_TOP_K_CTAS=1)
# and `main` (4ca4761's selection: bins1's bench_main is a6b0ef3, whose top-k differs only in its
# candidates), three rounds alternating; ncu of the top-k; test_cuda_select's [select] (the tie
# case on one CTA and on a cluster) and packed_bitmap's [select] GPU cases on new.
# Run from the repository root, with build-carry/s43/bins4.tar.xz and bins1.tar.xz carried.
mkdir -p /tmp/s43r4 && tar xJf build-carry/s43/bins4.tar.xz -C /tmp/s43r4 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r4 bench_main libbenchmark.so.1debian libgomp.so.1
cd /tmp/s43r4
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 280 ./t_sel "[select]" > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt;
 timeout 280 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt) &
TP1=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1), 'ctas', b.get('top_k_ctas',-1))"; }
for round in 1 2 3; do
  timeout 120 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/bench_new_$round.json --benchmark_out_format=json > $R/bench_new_$round.txt 2>&1
  show $R/bench_new_$round.json new
  KVMOSAIC_BENCH_TOP_K_CTAS=1 timeout 120 ./bench_new --benchmark_filter="$F" --benchmark_out=$R/bench_one_$round.json --benchmark_out_format=json > $R/bench_one_$round.txt 2>&1
  show $R/bench_one_$round.json one
  timeout 120 ./bench_main --benchmark_filter="$F" --benchmark_out=$R/bench_main_$round.json --benchmark_out_format=json > $R/bench_main_$round.txt 2>&1
  show $R/bench_main_$round.json main
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for v in 8 1; do
  KVMOSAIC_BENCH_TOP_K_CTAS=$v timeout 90 $NCU --clock-control none -k regex:"select_pages_kernel|score_block_keys" --launch-count 4 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread ./bench_new --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_topk$v.txt 2>&1
  grep -E "^  [a-z_]+.*\(|gpu__time|inst_executed|registers" $R/ncu_topk$v.txt | awk -v v=$v '{print "ctas" v, $0}' | cut -c1-140 | head -16
done
wait $TP1
for f in gpu_select gpu_packed_select; do echo "== $f"; grep -E "FAILED|passed|failed|No tests" $R/$f.txt | head -12; tail -n 2 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
