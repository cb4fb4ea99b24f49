#!/bin/bash
# s44 run 4: `e5` (e3, with the scoring kernel loading each span's entry id together with the
# span count and copying only live spans' keys, and the query rotation loading the queries before
# it waits for the metadata pull) against `e3` (run 2's) and main (0ebaf67), three rounds
# alternating, nothing beside them; then packed_bitmap's [select] GPU cases on e5 and the step's
# kernels by Nsight Compute.
# Run from the repository root, with build-carry/s44/bins1.tar.xz, bins2.tar.xz, bins4.tar.xz carried.
mkdir -p /tmp/s44r4 && for t in 1 2 4; do tar xJf build-carry/s44/bins$t.tar.xz -C /tmp/s44r4; done
cd /tmp/s44r4
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/group:4/head_dim:128/|packed_bitmap(_g4)?_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:8/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_e5 bench_e3 bench_main; do
  timeout 150 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
timeout 200 ./t_pb5 "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt
tail -n 3 $R/gpu_packed_select.txt
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 60 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 --metrics gpu__time_duration.sum,smsp__inst_executed.sum ./bench_e5 --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_step_e5.txt 2>&1
grep -E "^  [a-z].*\(|gpu__time|inst_executed" $R/ncu_step_e5.txt | awk '{print $1, $2, $NF}' | head -15
cd $OUT && tar czf results.tgz results && rm -rf results
