#!/bin/bash
# s41 run 2: each warp copies its own rows of a small-page slot and waits on its own barrier (`new2`) against `main`;
# new2 at 3 and 4 stages; ncu of one 1/16 step on both; packed_bitmap's [select] GPU cases on new2.
# Run from the repository root, with build-carry/s41/bins2.tar.xz carried.
mkdir -p /tmp/s41r2 && tar xJf build-carry/s41/bins2.tar.xz -C /tmp/s41r2
cd /tmp/s41r2
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
(timeout 280 ./t_pk_new2 "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt) &
TP=$!
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/|packed_bitmap_page16_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_new2 bench_main; do
  timeout 90 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
for st in 3 4; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st timeout 60 ./bench_new2 --benchmark_filter="$M" --benchmark_out=$R/bench_new2_stages$st.json --benchmark_out_format=json > $R/bench_new2_stages$st.txt 2>&1
  show $R/bench_new2_stages$st.json new2_stages$st
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_new2 bench_main; do
  timeout 60 $NCU --clock-control none -k regex:"decode_partial_packed" --launch-count 3 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes_read.sum ./$b --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_split_$b.txt 2>&1
  grep -E "gpu__time|inst_executed|dram__bytes" $R/ncu_split_$b.txt | awk -v b=$b '{print b, $1, $(NF-1), $NF}' | head -9
done
wait $TP
tail -n 4 $R/gpu_packed_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
