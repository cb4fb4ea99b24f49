#!/bin/bash
# packed_bitmap sm_90 kernel, H200: the packed GPU tests on the page-loop change, then
# bench_decode A/B/C alternating: lean rows (new) / + page loop without divisions (p5) /
# the same bounded for six CTAs per SM (p6).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/device.txt
timeout 200 ./packed_bitmap --durations yes > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
tail -n 3 $R/gpu_packed_bitmap.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072'
for b in new p5 p6 p6 p5 new; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context:131072" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
done
cd $OUT && tar czf results.tgz results && rm -rf results
