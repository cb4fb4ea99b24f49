#!/bin/bash
# s38 run 4: v3 (all), v4 (no PDL, top-k as main: block-query grid + pipelined scoring), v5
# (block-query grid and first round only) and base (main), three rounds alternating.
cd "$(dirname "$0")"
tar xJf bins4.tar.xz
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/|packed_bitmap_g4_mean_keys_decode/batch:1/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
show() { python3 -c "
import json,sys
for b in json.load(open('$1'))['benchmarks']: print('$2', b['name'].split('/iter')[0].replace('/group:4/head_dim:128',''), round(b['time_us'],1), 'select_us', round(b.get('select_us',0),1))"; }
for round in 1 2 3; do
for b in bench_v3 bench_v4 bench_v5 bench_base; do
  ./$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  show $R/${b}_$round.json $b
done
done
M16='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for b in bench_v4 bench_v5; do
timeout 100 $NCU --clock-control none -k regex:"packed_block_queries|score_block|select_pages|decode_partial_packed|merge_splits" --launch-count 5 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size ./$b --benchmark_filter="$M16" > $R/ncu_step_$b.txt 2>&1
grep -E "void|duration" $R/ncu_step_$b.txt | sed -E 's/\(select_params.*//; s/\(split_params.*//; s/\(packed_block.*//; s/\(decode_params.*//' | paste - - | awk -v b=$b '{print b, $0}'
done
cd $OUT && tar czf results.tgz results && rm -rf results
