#!/bin/bash
# run2: the committed form, tables pulled beside the rotation only from 64 KB of them and the
# selection's inputs on (bench_sp2; t_sp2, whose small-page mean_keys section sets the size to 0
# so that its steps pull beside the rotation too) against main plus the batch-32 rows
# (bench_b32): packed_bitmap's mean_keys GPU cases, then the benchmarks, builds alternating,
# three rounds. Run from the repository root with build-carry/s48/ carried.
D=$(mktemp -d); tar -C $D -xJf build-carry/s48/bins.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
(timeout 240 $D/t_sp2 "*mean_keys*,*pages of 16 and 32*" 2>&1 | tail -4) | tee $OUT/tests.txt
F='^(dense_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0|packed_bitmap_(g4_)?mean_keys_decode/batch:(1/context:32768|8/context:32768|1/context:131072|8/context:131072|32/context:131072)/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/)'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_b32 bench_sp2; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
