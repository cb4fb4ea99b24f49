#!/bin/bash
# H200: span scoring with each lane's spans and query heads permuted by its lane index, so the
# reduce-scatter selects nothing (perm) against main at f2e6eb4 (base); GPU tests of the final
# tree (select: the device's scores and pages equal the host's; packed_bitmap, every case).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
nvidia-smi -L > $R/device.txt
(timeout 240 ./select > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt) &
(timeout 240 ./packed_bitmap > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt) &
wait
tail -n 3 $R/gpu_select.txt $R/gpu_packed_bitmap.txt
pack
F='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
Q='dense_quest_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:16/'
for b in base perm; do
  timeout 60 ncu --clock-control none -k 'regex:score_pages|select_pages|decode_partial|merge' --launch-count 4 --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum ./bench_$b --benchmark_filter="$F" > $R/ncu_$b.txt 2>&1
  timeout 60 ncu --clock-control none -k 'regex:score_pages' --launch-count 1 --metrics gpu__time_duration.sum,launch__registers_per_thread,smsp__inst_executed.sum ./bench_$b --benchmark_filter="$Q" > $R/ncu_quest_$b.txt 2>&1
  grep -E "^  void|duration|inst_executed" $R/ncu_$b.txt $R/ncu_quest_$b.txt | sed 's/^.*results.//' | cut -c1-150
done
pack
H='batch:8/context:131072/group:4/head_dim:128'
G="dense_decode/$H/sparsity:0/|packed_bitmap(_g4)?_mean_keys_decode/$H/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/$H/retained:25/budget_inverse:8/page:16/|dense_quest_decode/$H/sparsity:0/budget_inverse:16/page:16/|dense_quest_blocks_decode/$H/sparsity:0/budget_inverse:16/"
for b in base perm perm base; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  timeout 100 ./bench_$b --benchmark_filter="$G" > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/batch:8\/context:131072\///'
  grep -h "batch:8/context" $R/${b}_$n.txt | grep -oE "select_us=[0-9.]+" | tr '\n' ' '; echo
  pack
done
rm -rf $R
