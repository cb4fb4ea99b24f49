#!/bin/bash
cd "$(dirname "$0")" && tar xzf bins.tgz && cd ..
export LD_LIBRARY_PATH=$PWD/build-carry:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
for row in dense_tova_per_head_evict_step dense_tova_evict_step; do
  timeout 200 ncu -k regex:"rank_|token_score|split|decode|merge" -c 60 --metrics gpu__time_duration.sum --csv \
    build-carry/bench_after --benchmark_filter="^$row/batch:8/context:131072" --benchmark_min_time=0 > $R/$row.csv 2> $R/$row.err
done
cd $OUT && tar czf results.tgz r && rm -rf r
