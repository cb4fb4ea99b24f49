#!/bin/bash
# H200: the top-k's radix from the keys' highest differing bit (topk), and the small-page split
# kernel bounded for four CTAs an SM (m4 = topk + that) against main (base).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
nvidia-smi -L > $R/device.txt
(timeout 200 ./select > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt) &
(timeout 200 ./packed_bitmap "*select::mean_keys*,*pages of 16 and 32*" > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt) &
wait
tail -n 3 $R/gpu_select.txt $R/gpu_packed_bitmap.txt
pack
F='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in base m4; do
  timeout 60 ncu --clock-control none -k 'regex:score_pages|select_pages|decode_partial|merge' --launch-count 4 --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active ./bench_$b --benchmark_filter="$F" > $R/ncu_$b.txt 2>&1
  grep -E "^  void|duration|registers|warps_active" $R/ncu_$b.txt | head -24
done
pack
H='batch:8/context:131072/group:4/head_dim:128'
G="dense_decode/$H/sparsity:0/|packed_bitmap(_g4)?_mean_keys_decode/$H/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/$H/retained:25/budget_inverse:8/page:16/|dense_quest_decode/$H/sparsity:0/budget_inverse:16/page:16/|packed_bitmap_g4_page16_decode/$H/"
for b in base topk m4 m4 topk base; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  timeout 100 ./bench_$b --benchmark_filter="$G" > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//'
  grep -h "batch:8/context" $R/${b}_$n.txt | grep -oE "select_us=[0-9.]+|stages=[0-9]+" | tr '\n' ' '; echo
  pack
done
rm -rf $R
