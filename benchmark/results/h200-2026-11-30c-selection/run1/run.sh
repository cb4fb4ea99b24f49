#!/bin/bash
# s43 run 1: the rotation back at a segment's close in four parts of the rotated channels (`new`)
# against `main` (a6b0ef3), two rounds alternating; the page-granular selection's candidates
# (GPU case on main's code, `t_bug`, and on the fix, `t_et`); packed_bitmap's GPU cases on new.
# Run from the repository root, with build-carry/s43/bins1.tar.xz carried.
mkdir -p /tmp/s43r1 && tar xJf build-carry/s43/bins1.tar.xz -C /tmp/s43r1
cd /tmp/s43r1
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 300 ./t_pb "[packed_bitmap]~[select]" > $R/gpu_packed_rest.txt 2>&1; echo "rc $?" >> $R/gpu_packed_rest.txt) &
TP1=$!
(timeout 200 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt;
 timeout 60 ./t_bug "GPU page-granular selection leaves the recent window's pages out, as the host does" > $R/gpu_window_main.txt 2>&1; echo "rc $?" >> $R/gpu_window_main.txt;
 timeout 200 ./t_et "[exact_tokens]" > $R/gpu_exact_tokens.txt 2>&1; echo "rc $?" >> $R/gpu_exact_tokens.txt) &
TP2=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap(_g4)?_decode/batch:(1|8)/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_new bench_main; do
  timeout 120 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_new bench_main; do
  timeout 60 $NCU --clock-control none -k regex:"decode_partial_packed" --launch-count 3 --metrics gpu__time_duration.sum,smsp__inst_executed.sum ./$b --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_split_$b.txt 2>&1
  grep -E "gpu__time|inst_executed" $R/ncu_split_$b.txt | awk -v b=$b '{print b, $1, $(NF-1), $NF}' | head -6
done
wait $TP1 $TP2
for f in gpu_packed_rest gpu_packed_select gpu_window_main gpu_exact_tokens; do echo "== $f"; tail -n 4 $R/$f.txt; done
cd $OUT && tar czf results.tgz results && rm -rf results
