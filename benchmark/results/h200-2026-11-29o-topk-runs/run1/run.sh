#!/bin/bash
# s40 run 1: source-level counters of the selection kernels (main's build), one mean_keys 1/16 step.
cd "$(dirname "$0")"
mkdir -p /tmp/s40r1 && tar xJf bins1.tar.xz -C /tmp/s40r1
cp parse_source2.py /tmp/s40r1/
cd /tmp/s40r1
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 200 $NCU --clock-control none --set full --import-source yes -k regex:"packed_block_queries|score_block|select_pages|merge_splits" --launch-count 4 -o $R/sel \
  ./bench_main --benchmark_filter="$M16" --benchmark_min_time=0.01 > $R/ncu_sel.txt 2>&1
$NCU -i $R/sel.ncu-rep --page source --csv --print-source cuda,sass > $R/sel_source.csv 2>/dev/null
$NCU -i $R/sel.ncu-rep > $R/sel_details.txt 2>&1
for k in select_pages score_block packed_block_queries merge_splits; do python3 parse_source2.py $R/sel_source.csv $k > $R/src_$k.txt 2>&1; done
grep -E "void|Duration" $R/sel_details.txt | head -12
gzip $R/sel_source.csv; rm -f $R/sel.ncu-rep
cd $OUT && tar czf results.tgz results && rm -rf results
