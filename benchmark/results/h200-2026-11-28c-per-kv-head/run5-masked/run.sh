#!/bin/bash
# The masked step (select::all after 40 evictions per sequence, hole_fill, no compaction) and the
# plain step: this build against main before it, alternated twice.
cd "$(dirname "$0")" && tar xzf bins.tgz && cd ..
export LD_LIBRARY_PATH=$PWD/build-carry:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
ROWS='hbm_read|dense_decode_append_step|dense_masked_append_step'
for i in 1 2; do
  timeout 120 build-carry/bench_after --benchmark_filter="$ROWS" --benchmark_out=$R/after_$i.json --benchmark_out_format=json > $R/after_$i.txt 2>&1
  timeout 120 build-carry/bench_before --benchmark_filter="$ROWS" --benchmark_out=$R/before_$i.json --benchmark_out_format=json > $R/before_$i.txt 2>&1
done
cd $OUT && tar czf results.tgz r && rm -rf r
