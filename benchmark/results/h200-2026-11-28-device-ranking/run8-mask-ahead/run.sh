#!/bin/bash
# The dense sm_90 kernel loading each stage's row mask a stage ahead: same-run A/B of the steps
# that read masks (evicted rows) and of those that do not, then the GPU tests whose steps read
# row masks (token scores with evictions, eviction, exact tokens' sinks, token-granular selections).
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/build-gpuB:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
(cd build-gpuB && tar xzf bench.tgz)
ROWS='hbm_read|dense_decode/batch:(1|8)/context:131072/|append_step|evict_step'
build-gpuB/bench_decode_before --benchmark_filter="$ROWS" --benchmark_out=$R/before_1.json --benchmark_out_format=json > $R/before_1.txt 2>&1
build-gpuB/bench_decode --benchmark_filter="$ROWS" --benchmark_out=$R/after_1.json --benchmark_out_format=json > $R/after_1.txt 2>&1
cd build-gpuA && tar xzf tests.tgz && cd ..
for spec in scores:40 eviction:50 exact_tokens:50 select:95; do
  t=${spec%%:*}
  timeout ${spec##*:} build-gpuA/test_$t > $R/test_$t.txt 2>&1; echo "test_$t rc=$?" >> $R/tests.txt
  tail -2 $R/test_$t.txt >> $R/tests.txt
  (cd $OUT && tar czf results.tgz r)
done
cd $OUT && tar czf results.tgz r && rm -rf r
