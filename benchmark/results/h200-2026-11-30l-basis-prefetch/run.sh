#!/bin/bash
# The split kernel's last segment's B_v asked into L2 two slots before its close (bench_new,
# t_pb) against main 0e5c3e9 (bench_base): packed_bitmap's GPU tests on the new build, then the
# benchmarks, builds alternating, three rounds. Run from the repository root with
# build-carry/s48/ carried.
D=$(mktemp -d); tar -C $D -xJf build-carry/s48/bins.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
(timeout 300 $D/t_pb 2>&1 | tail -4) | tee $OUT/tests.txt
F='packed_bitmap_g4_mean_keys_decode/batch:[18]/context:(32768|131072)/.*/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/|packed_bitmap_mean_keys_decode/batch:8/context:131072/.*budget_inverse:16/page:16/|dense_decode/batch:[18]/context:(32768|131072)/group:4/head_dim:128/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_base bench_new; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
