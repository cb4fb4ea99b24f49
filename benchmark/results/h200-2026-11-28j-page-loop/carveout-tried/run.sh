#!/bin/bash
# H200: packed_bitmap eviction GPU tests on the final kernel, then the decode kernels with the
# shared-memory carveout preferred at its maximum (cv) against the final build (p5), and
# packed_bitmap at three page pairs in flight with the carveout.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
timeout 90 ./packed_eviction --durations yes > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt
tail -n 3 $R/gpu_packed_eviction.txt
F='dense_decode/batch:8/context:131072/|bitmap_tiles_decode/batch:8/context:131072/.*sparsity:70|packed_bitmap(_g4)?_decode/batch:8/context:(32768|131072)'
for b in p5 cv; do
  ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}.json --benchmark_out_format=json > $R/${b}.txt 2>&1
  grep -h "batch:8/context" $R/${b}.txt | awk -v b=$b '{print b, $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
done
KVMOSAIC_BENCH_PACKED_STAGES=3 ./bench_cv --benchmark_filter='packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072' > $R/cv_stages3.txt 2>&1
grep -h "batch:8/context" $R/cv_stages3.txt | awk '{print "cv3", $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
cd $OUT && tar czf results.tgz results && rm -rf results
