#!/bin/bash
# s39 run 6: Nsight Compute's full set on the committed build's selection kernels (one mean_keys
# 1/16 step at batch 8, 128K): why the query rotation takes 9 us, and where scoring and top-k wait.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r6 && tar xJf bins5.tar.xz -C /tmp/s39r6 bench_final libbenchmark.so.1debian
cd /tmp/s39r6
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 150 $NCU --set full -k regex:"packed_block_queries|score_block|select_pages" --launch-count 3 -o $R/selection \
  ./bench_final --benchmark_filter="$M16" --benchmark_min_time=0.01 > $R/ncu_selection.txt 2>&1
$NCU -i $R/selection.ncu-rep > $R/selection_details.txt 2>&1
rm -f $R/selection.ncu-rep
grep -E "void|Duration|Achieved Occupancy|Issued Warp|No Eligible" $R/selection_details.txt | head -20
cd $OUT && tar czf results.tgz results && rm -rf results
