#!/bin/bash
# H200: the packed_bitmap mean_keys steps in pages of 16 (slots of four pages) at 3 pipeline
# stages (the engine's choice under a selector) and at 2 (KVMOSAIC_BENCH_PACKED_STAGES),
# alternating 3, 2, 2, 3.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
F='packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:(16|8)/page:16/'
for st in 3 2 2 3; do
  n=1; [ -f $R/stages${st}_1.txt ] && n=2
  KVMOSAIC_BENCH_PACKED_STAGES=$st timeout 100 ./bench_new --benchmark_filter="$F" > $R/stages${st}_$n.txt 2>&1
  grep -h "batch:8" $R/stages${st}_$n.txt | awk -v s=$st '{print s, $1, $2}' | sed -E 's/\/group:4\/head_dim:128\/retained:25//; s/\/iterations:30\/manual_time//'
  pack
done
rm -rf $R
