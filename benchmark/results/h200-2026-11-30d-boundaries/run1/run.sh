#!/bin/bash
# s44 run 1: the selection's boundaries as programmatic dependents at every grid (`e1`: the
# query rotation after the metadata pull, the scoring after the rotation, the top-k after the
# scoring; each lets its dependent in early only where the scoring's grid is resident at once)
# against main (0ebaf67), two rounds alternating, nothing beside them; then packed_bitmap's
# [select] GPU cases on e1, the scoring kernel's SASS and Nsight Compute's sections for it.
# Run from the repository root, with build-carry/s44/bins1.tar.xz carried.
mkdir -p /tmp/s44r1 && tar xJf build-carry/s44/bins1.tar.xz -C /tmp/s44r1
cd /tmp/s44r1
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/group:4/head_dim:128/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:8/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_e1 bench_main; do
  timeout 120 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
timeout 200 ./t_pb "[packed_bitmap][select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt
tail -n 3 $R/gpu_packed_select.txt
cuobjdump -sass bench_main | awk '/Function :/{p = /score_block_keys_kernel/} p' > $R/score_block_keys.sass
grep -c "^        /\*[0-9a-f]*\*/" $R/score_block_keys.sass
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 120 $NCU --clock-control none -k regex:"score_block_keys" --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SourceCounters --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis ./bench_main --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_score.txt 2>&1
grep -E "Duration|Executed Ipc|Issue Slots Busy|Achieved Occupancy|Warp Cycles Per Issued" $R/ncu_score.txt | head
cd $OUT && tar czf results.tgz results && rm -rf results
