#!/bin/bash
# s43 run 7: both page top-k kernels let the split kernel be scheduled at their start (`new2`)
# against 242242b (`head`, bins6's bench_head), three rounds alternating: page-granular steps
# (select_pages_kernel) and blocks of 16 in pages of 64 (select_spans_kernel), packed_bitmap and
# dense; then new2's GPU cases: packed_bitmap's [select], test_cuda_select's [select] (10 cases
# need shapes the one-shape binary lacks), every exact-tokens case.
# Run from the repository root, with build-carry/s43/bins7.tar.xz carried (bench_head: 242242b).
mkdir -p /tmp/s43r7 && tar xJf build-carry/s43/bins7.tar.xz -C /tmp/s43r7
cd /tmp/s43r7
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 250 ./t_packed_bitmap "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt;
 timeout 200 ./t_exact_tokens "[exact_tokens]" > $R/gpu_exact_tokens.txt 2>&1; echo "rc $?" >> $R/gpu_exact_tokens.txt) &
TP1=$!
(timeout 250 ./t_select "[select]" > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt) &
TP2=$!
F='packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:(16/block:0|0/block:16)/|dense_quest(_blocks)?_decode/batch:(1|8)/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:0/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new2 bench_head; do
  timeout 150 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
wait $TP1 $TP2
for f in gpu_packed_select gpu_select gpu_exact_tokens; do echo "== $f"; grep -E "FAILED|passed|failed|No tests" $R/$f.txt | head -12; tail -n 2 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
