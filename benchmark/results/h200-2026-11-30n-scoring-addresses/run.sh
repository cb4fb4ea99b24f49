#!/bin/bash
# The block-key scoring kernel with its copies of the queries a compile-time count (a channel's
# query address one shift and add) and each pair's channel one byte permute (bench_sc) against
# main plus the batch-32 rows (bench_b32): builds alternating, three rounds; then Nsight Compute's
# time and instruction count of the scoring kernel in each, and the new kernel's SASS. Run from
# the repository root with build-carry/s48/ carried.
D=$(mktemp -d); tar -C $D -xJf build-carry/s48/bins.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
F='^(dense_decode/batch:(8|32)/context:131072/group:4/head_dim:128/sparsity:0|packed_bitmap_(g4_)?mean_keys_decode/batch:(1/context:32768|8/context:131072|32/context:131072)/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/)'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_b32 bench_sc; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_b32 bench_sc; do
  for shape in 8 32; do
    timeout 100 $NCU --clock-control none -k regex:score_block_keys --launch-count 2 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread \
      $D/$b --benchmark_filter="packed_bitmap_g4_mean_keys_decode/batch:$shape/context:131072/.*budget_inverse:16/page:16/" > $OUT/ab/ncu_${b}_$shape.txt 2>&1
    echo "== ncu $b batch $shape"; grep -E "duration|inst_executed|registers" $OUT/ab/ncu_${b}_$shape.txt | tail -3
  done
done
cuobjdump -sass -fun '_ZN8kvmosaic4cuda6kernel23score_block_keys_kernelINS_8bfloat16ELi128ELi4ELi8EEEvNS1_13select_paramsE' $D/score2.o > $OUT/ab/score_new.sass 2>&1
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
