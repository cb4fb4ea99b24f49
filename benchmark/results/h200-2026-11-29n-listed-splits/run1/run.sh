#!/bin/bash
# s39 run 1: new (list2: every small-page split listed, window removed; block-query kernel a thread
# per (channel, head) from a staged basis; scoring kernel at 8 CTAs an SM) vs main.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r1 && tar xJf bins1.tar.xz -C /tmp/s39r1
cd /tmp/s39r1
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 200 ./t_packed_new > $R/gpu_packed_all.txt 2>&1; echo "rc $?" >> $R/gpu_packed_all.txt; tail -n 3 $R/gpu_packed_all.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_page16_decode/batch:8/context:131072/|packed_bitmap_g4_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1), 'splits', b.get('splits'))"; }
for round in 1 2; do
for b in bench_new bench_main; do
  timeout 90 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in bench_new bench_main; do
  timeout 60 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --launch-skip 40 --launch-count 6 ./$b --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_step_$b.txt 2>&1
  grep -E "^  [a-z].*\(|gpu__time" $R/ncu_step_$b.txt | paste - - | awk '{print $2, $NF}' | head -8
done
timeout 120 ncu --set full --import-source yes -k regex:decode_partial_packed_mma --launch-skip 8 --launch-count 1 -o $R/split_full ./bench_new --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_split_full.txt 2>&1
ncu -i $R/split_full.ncu-rep --page source --csv --print-source cuda,sass > $R/split_source.csv 2>/dev/null
ncu -i $R/split_full.ncu-rep > $R/split_details.txt 2>&1
cd $OUT && tar czf results.tgz results && rm -rf results
