#!/bin/bash
# Batch 32 at 128K beside batch 8 (new rows of bench_decode, main plus those rows): packed_bitmap
# at 25% retained, g = 4 and g = 1, select::all and mean_keys over pages of 16, our dense in the
# same run, two rounds; then PyTorch's SDPA at the same shapes. Run from the repository root with
# build-carry/s48/ carried.
D=$(mktemp -d); tar -C $D -xJf build-carry/s48/bins.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
F='batch:(8|32)/context:131072/group:4/head_dim:128/(sparsity:0|retained:25/iter|retained:25/budget_inverse:(16|8)/page:16/)'
F="^(dense_decode|packed_bitmap_decode|packed_bitmap_g4_decode|packed_bitmap_g4_mean_keys_decode|packed_bitmap_mean_keys_decode)/$F"
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
for round in 1 2; do
  $D/bench_b32 --benchmark_filter="$F" --benchmark_out=$OUT/bench.$round.json --benchmark_out_format=json > $OUT/bench.$round.txt 2>&1
  echo "== round $round"; show $OUT/bench.$round.json
done
timeout 200 python3 benchmark/sdpa_baseline.py --shapes 8x131072,32x131072 --backends cudnn,flash --out $OUT/sdpa.json > $OUT/sdpa.txt 2>&1; tail -8 $OUT/sdpa.txt
