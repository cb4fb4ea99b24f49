#!/bin/bash
# s41 run 4: `new3` (new2 + the segment's V basis prefetched to L2 when a split enters it, and a
# listed split entering its first segment before its first slot lands) against `new2` (committed);
# the GPU tests of packed_bitmap on new3 first (the [select] cases and the select::all case of
# pages of 64), then the benchmarks, two rounds, then ncu of the split kernel.
# Run from the repository root, with build-carry/s41/bins3.tar.xz carried.
mkdir -p /tmp/s41r4 && tar xJf build-carry/s41/bins3.tar.xz -C /tmp/s41r4
cd /tmp/s41r4
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 200 ./t_pk_new3 "[packed_bitmap][select],GPU packed_bitmap: the host's segments*" > $R/gpu_packed.txt 2>&1; echo "rc $?" >> $R/gpu_packed.txt
tail -n 3 $R/gpu_packed.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/|packed_bitmap_page16_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2; do
for b in bench_new3 bench_new2; do
  timeout 90 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_new3 bench_new2; do
  timeout 60 $NCU --clock-control none -k regex:"decode_partial_packed|merge_splits" --launch-count 4 --metrics gpu__time_duration.sum,smsp__inst_executed.sum ./$b --benchmark_filter="$M" --benchmark_min_time=0.01 > $R/ncu_split_$b.txt 2>&1
  grep -E "^  [a-z].*\(|gpu__time|inst_executed" $R/ncu_split_$b.txt | awk -v b=$b '{print b, $1, $2, $NF}' | cut -c1-90 | head -12
done
cd $OUT && tar czf results.tgz results && rm -rf results
