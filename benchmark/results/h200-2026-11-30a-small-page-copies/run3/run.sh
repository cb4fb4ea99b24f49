#!/bin/bash
# s41 run 3: source-level counters of the split kernel of one mean_keys 1/16 step (new2, the
# committed build: each warp copies its own rows of a small-page slot).
# Run from the repository root, with build-carry/s41/bins2.tar.xz carried.
P=$PWD/benchmark/results/h200-2026-11-30a-small-page-copies/parse_source2.py
mkdir -p /tmp/s41r3 && tar xJf build-carry/s41/bins2.tar.xz -C /tmp/s41r3
cd /tmp/s41r3
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 200 $NCU --clock-control none --set full --import-source yes -k regex:"decode_partial_packed" --launch-count 1 --launch-skip 2 -o $R/split \
  ./bench_new2 --benchmark_filter="$M16" --benchmark_min_time=0.01 > $R/ncu_split.txt 2>&1
$NCU -i $R/split.ncu-rep --page source --csv --print-source cuda,sass > $R/split_source.csv 2>/dev/null
$NCU -i $R/split.ncu-rep > $R/split_details.txt 2>&1
python3 $P $R/split_source.csv decode_partial > $R/src_split.txt 2>&1
grep -E "void|Duration|Issue Slots|Registers Per|Achieved Occupancy|Theoretical Occupancy" $R/split_details.txt | head -12
head -40 $R/src_split.txt
gzip $R/split_source.csv; rm -f $R/split.ncu-rep
cd $OUT && tar czf results.tgz results && rm -rf results
