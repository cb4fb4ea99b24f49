#!/bin/bash
# H200: packed_bitmap's sm_90 kernel with a SmallPages instantiation (slots of several pages of
# 16 or 32 tokens; pages of 64 keep main's code) against main (base): the packed GPU tests, the
# page-16 rows on new, then the page-64 rows alternating base/new.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
nvidia-smi -L > $R/device.txt
(timeout 170 ./packed_bitmap > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt) &
(timeout 170 ./packed_eviction > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt) &
wait
tail -n 3 $R/gpu_packed_bitmap.txt $R/gpu_packed_eviction.txt
pack
G='dense_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/|packed_bitmap(_g4)?_page16_decode/batch:8/context:131072|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/.*page:16/'
timeout 110 ./bench_new --benchmark_filter="$G" > $R/page16.txt 2>&1
grep -h "context" $R/page16.txt | awk '{print $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
pack
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g4)?_decode/batch:8/context:131072|packed_bitmap(_g4)?_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:0/'
for b in base new new base; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  timeout 65 ./bench_$b --benchmark_filter="$F" > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2, $3}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
  pack
done
rm -rf $R
