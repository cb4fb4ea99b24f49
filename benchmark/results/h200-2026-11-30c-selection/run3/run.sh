#!/bin/bash
# s43 run 3: the block-key scoring kernel launched as a programmatic dependent of the query
# rotation (`new`: it stages its keys while the rotation runs) against `main` (a6b0ef3), three
# rounds alternating; packed_bitmap's [select] GPU cases on new; the page-granular window case
# on main's selection code (`t_bug2`: a6b0ef3's include/, this session's test).
# Run from the repository root, with build-carry/s43/bins3.tar.xz and bins1.tar.xz carried.
mkdir -p /tmp/s43r3 && tar xJf build-carry/s43/bins3.tar.xz -C /tmp/s43r3 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r3 bench_main libbenchmark.so.1debian libgomp.so.1
cd /tmp/s43r3
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 60 ./t_bug2 "[exact_tokens][select]" > $R/gpu_window_main.txt 2>&1; echo "rc $?" >> $R/gpu_window_main.txt;
 timeout 280 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt) &
TP1=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_new bench_main; do
  timeout 120 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
wait $TP1
for f in gpu_window_main gpu_packed_select; do echo "== $f"; grep -E "FAILED|passed|failed|No tests" $R/$f.txt | head -5; tail -n 2 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
