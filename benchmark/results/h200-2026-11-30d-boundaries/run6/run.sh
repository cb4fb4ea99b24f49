#!/bin/bash
# s44 run 6: the committed build (`final`: e5's scoring and rotation kernels, the rotation after
# the metadata pull, main's launches otherwise) against main (0ebaf67), three rounds alternating,
# nothing beside them; then every packed_bitmap GPU case on `final`.
# Run from the repository root, with build-carry/s44/bins1.tar.xz and bins6.tar.xz carried.
mkdir -p /tmp/s44r6 && for t in 1 6; do tar xJf build-carry/s44/bins$t.tar.xz -C /tmp/s44r6; done
cd /tmp/s44r6
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/group:4/head_dim:128/|packed_bitmap(_g4)?_mean_keys_decode/batch:(1|8)/context:(32768|131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:8/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128','').replace('/retained:25',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_final bench_main; do
  timeout 150 ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
timeout 280 ./t_pbf "[packed_bitmap]" > $R/gpu_packed.txt 2>&1; echo "rc $?" >> $R/gpu_packed.txt
tail -n 3 $R/gpu_packed.txt
cd $OUT && tar czf results.tgz results && rm -rf results
