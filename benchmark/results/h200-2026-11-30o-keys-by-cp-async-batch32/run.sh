#!/bin/bash
# The block-key scoring's keys by cp.async (2026-11-30d's tried-keys-by-cp-async.diff, applied
# to main: bench_cp) against main plus the batch-32 rows (bench_b32) at batch 8 and 32, 128K:
# builds alternating, three rounds, then Nsight Compute's time and instruction count of the
# scoring kernel at batch 32. Run from the repository root with build-carry/s48/ carried.
D=$(mktemp -d); tar -C $D -xJf build-carry/s48/bins.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
F='^packed_bitmap_(g4_)?mean_keys_decode/batch:(8|32)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_b32 bench_cp; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_b32 bench_cp; do
  timeout 100 $NCU --clock-control none -k regex:score_block_keys --launch-count 2 --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
    $D/$b --benchmark_filter="packed_bitmap_g4_mean_keys_decode/batch:32/context:131072/.*budget_inverse:16/page:16/" > $OUT/ab/ncu_${b}_32.txt 2>&1
  echo "== ncu $b batch 32"; grep -E "duration|inst_executed" $OUT/ab/ncu_${b}_32.txt | tail -2
done
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
