#!/bin/bash
# s43 run 5: the block-key scoring launched as a programmatic dependent of the query rotation
# only where its grid fits on the device at once (`new`), against `main` (a6b0ef3), three rounds
# alternating; packed_bitmap's [select] GPU cases on new; test_cuda_select's [select] and
# test_cuda_exact_tokens' cases on 4ca4761 (`_head`: the page top-k's candidates fix).
# Run from the repository root, with build-carry/s43/bins5.tar.xz and bins1.tar.xz carried.
mkdir -p /tmp/s43r5 && tar xJf build-carry/s43/bins5.tar.xz -C /tmp/s43r5 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r5 bench_main libbenchmark.so.1debian libgomp.so.1
cd /tmp/s43r5
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 280 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt;
 timeout 200 ./t_et_head "[exact_tokens]" > $R/gpu_exact_tokens_head.txt 2>&1; echo "rc $?" >> $R/gpu_exact_tokens_head.txt) &
TP1=$!
(timeout 280 ./t_sel_head "[select]" > $R/gpu_select_head.txt 2>&1; echo "rc $?" >> $R/gpu_select_head.txt) &
TP2=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new bench_main; do
  timeout 150 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
wait $TP1 $TP2
for f in gpu_packed_select gpu_exact_tokens_head gpu_select_head; do echo "== $f"; grep -E "FAILED|passed|failed|No tests" $R/$f.txt | head -12; tail -n 2 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
