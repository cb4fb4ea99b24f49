#!/bin/bash
# s41 run 6: `new4` (6f5e48a + the merge kernel loading its first 16 splits' partials with the lse,
# and the packed kernels' rotation back reading a channel's heads as one 16-byte load) against
# `new2` (6f5e48a), two rounds alternating on the mean_keys rows; ncu of the split and merge
# kernels of one 1/16 step on both; meanwhile on the CPU cores, the GPU tests of new4 (the same
# four processes as run 5).
# Run from the repository root, with build-carry/s41/bins6.tar.xz carried.
mkdir -p /tmp/s41r6 && tar xJf build-carry/s41/bins6.tar.xz -C /tmp/s41r6
cd /tmp/s41r6
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
run() { timeout 300 ./t_final4 "$2" > $R/$1.txt 2>&1; echo "rc $?" >> $R/$1.txt; }
run gpu_packed_select "[packed_bitmap][select]" &
run gpu_packed_other "[packed_bitmap]~[select]~[token_scores]~[snapkv]" &
run gpu_packed_eviction "[token_scores],[snapkv]" &
run gpu_select "[select]~[packed_bitmap]" &
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_new4 bench_new2; do
  timeout 60 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_new4 bench_new2; do
  timeout 40 $NCU --clock-control none -k regex:"decode_partial_packed|merge_splits" --launch-count 4 --metrics gpu__time_duration.sum,smsp__inst_executed.sum ./$b --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_$b.txt 2>&1
  grep -E "^  [a-z].*\(|gpu__time|inst_executed" $R/ncu_$b.txt | awk -v b=$b '{print b, $1, $2, $NF}' | cut -c1-90 | head -12
done
wait
for f in gpu_packed_select gpu_packed_other gpu_packed_eviction gpu_select; do echo "== $f"; tail -n 4 $R/$f.txt; done
grep -c "allowed: a$" $R/gpu_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
