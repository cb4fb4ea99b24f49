#!/bin/bash
# GPU tests (token scores, per-KV-head twins, memcheck of the per-head case) and the per-head
# benchmark rows: this build (bench_after) and main before it (bench_before), alternated twice.
cd "$(dirname "$0")" && tar xzf bins.tgz && cd ..
export LD_LIBRARY_PATH=$PWD/build-carry:$LD_LIBRARY_PATH
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $R/device.txt
timeout 150 build-carry/t_scores --durations yes > $R/gpu-tests.txt 2>&1; echo "rc=$?" >> $R/gpu-tests.txt
timeout 90 compute-sanitizer --tool memcheck build-carry/t_scores "[per_kv_head],[ranking]" > $R/memcheck.txt 2>&1; echo "rc=$?" >> $R/memcheck.txt
ROWS='hbm_read|dense_decode/batch:(1|8)/context:131072/|dense_decode_append_step|evict_step'
for i in 1 2; do
  [ $i -eq 2 ] && [ $SECONDS -gt 330 ] && break
  timeout 150 build-carry/bench_after --benchmark_filter="$ROWS" --benchmark_out=$R/after_$i.json --benchmark_out_format=json > $R/after_$i.txt 2>&1
  timeout 80 build-carry/bench_before --benchmark_filter="$ROWS" --benchmark_out=$R/before_$i.json --benchmark_out_format=json > $R/before_$i.txt 2>&1
done
cd $OUT && tar czf results.tgz r && rm -rf r
