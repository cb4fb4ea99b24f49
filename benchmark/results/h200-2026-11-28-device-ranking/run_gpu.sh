#!/bin/bash
# Session 26 GPU run: the token-score GPU tests, the benchmark rows of this build and of the
# previous main alternated in one run, and Nsight Compute on the ranking kernels.
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/build-carry:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $R/device.txt
for t in build-carry/test_*; do
  [ -x "$t" ] || continue
  timeout 300 $t > $R/$(basename $t).txt 2>&1; echo "$(basename $t) rc=$?" >> $R/tests.txt
  tail -2 $R/$(basename $t).txt >> $R/tests.txt
done
ROWS='hbm_read|dense_decode/batch:(1|8)/context:(32768|131072)/|append_step|evict_step'
for i in 1 2; do
  ./build-carry/bench_decode --benchmark_filter="$ROWS|dense_tova_scores|dense_h2o_scores" --benchmark_out=$R/after_$i.json --benchmark_out_format=json > $R/after_$i.txt 2>&1
  ./build-carry/bench_decode_before --benchmark_filter="$ROWS" --benchmark_out=$R/before_$i.json --benchmark_out_format=json > $R/before_$i.txt 2>&1
done
for b in 1 8; do
ncu --kernel-name regex:"rank_|token_scores" --launch-skip 40 --launch-count 20 --section SpeedOfLight \
  ./build-carry/bench_decode --benchmark_filter="dense_tova_evict_step/batch:$b/context:131072" > $R/ncu_b$b.txt 2>&1
done
cd $OUT && tar czf results.tgz r && rm -rf r
