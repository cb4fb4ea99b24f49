#!/bin/bash
# s39 run 2: A (run 1's new + the scoring kernel's entry ids loaded with the span count, 6 CTAs an
# SM), B (A at 8 CTAs an SM for groups of up to 4), main; A with 3 and 4 stages; per-kernel ncu.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r2 && tar xJf bins2.tar.xz -C /tmp/s39r2
cd /tmp/s39r2
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 150 ./t_packed_A "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_page16_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('packed_bitmap_g4_',''), round(b['time_us'],1), 'sel', round(b.get('select_us',0),1), 'st', b.get('stages'))"; }
for round in 1 2; do
for b in bench_A bench_B bench_main; do
  timeout 60 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
for st in 3 4; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st timeout 60 ./bench_A --benchmark_filter="$F" --benchmark_out=$R/bench_A_st${st}_$round.json --benchmark_out_format=json > $R/bench_A_st${st}_$round.txt 2>&1
  show $R/bench_A_st${st}_$round.json A_st$st
done
done
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_A bench_B bench_main; do
timeout 100 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size ./$b --benchmark_filter="$M16" > $R/ncu_step_$b.txt 2>&1
grep -E "void|duration" $R/ncu_step_$b.txt | sed -E 's/\(select_params.*//; s/\(split_params.*//; s/\(packed_block.*//; s/\(decode_params.*//' | paste - - | awk -v b=$b '{print b, $2, $NF}'
done
KVMOSAIC_BENCH_PACKED_STAGES=3 timeout 100 $NCU --clock-control none -k regex:"decode_partial_packed" --launch-count 1 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__occupancy_limit_shared_mem ./bench_A --benchmark_filter="$M16" > $R/ncu_split_A_st3.txt 2>&1
grep -E "duration|occupancy" $R/ncu_split_A_st3.txt
cd $OUT && tar czf results.tgz results && rm -rf results
