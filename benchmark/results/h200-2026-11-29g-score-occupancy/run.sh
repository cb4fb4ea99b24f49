#!/bin/bash
# H200: the span-scoring kernel's register budget (spans a warp: 24 at 96, 16 at 80, against 32
# at 112 on main, head) in the selected steps; the top-k kernel's stall profile by SASS line; the
# small-page split kernel at three stages (override) on head.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
nvidia-smi -L > $R/device.txt
F='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
Q='dense_quest_decode/batch:8/context:131072/group:4/head_dim:128/sparsity:0/budget_inverse:16/page:16/'
for b in head s96 s80; do
  timeout 60 ncu --clock-control none -k 'regex:score_pages|select_pages' --launch-count 2 --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed ./bench_$b --benchmark_filter="$F" > $R/ncu_$b.txt 2>&1
  timeout 60 ncu --clock-control none -k 'regex:score_pages' --launch-count 1 --metrics gpu__time_duration.sum,launch__registers_per_thread ./bench_$b --benchmark_filter="$Q" > $R/ncu_quest_$b.txt 2>&1
  grep -E "^  void|duration|registers|warps_active|throughput" $R/ncu_$b.txt $R/ncu_quest_$b.txt | sed 's/^.*results.//' | cut -c1-160
done
timeout 90 ncu --clock-control none -k 'regex:select_pages' --launch-count 1 --section WarpStateStats --section SourceCounters -o $R/topk ./bench_head --benchmark_filter="$F" > $R/ncu_topk_run.txt 2>&1
ncu --import $R/topk.ncu-rep --page source --csv --print-source sass > $R/ncu_topk_source.csv 2>&1; gzip $R/ncu_topk_source.csv
ncu --import $R/topk.ncu-rep --page details > $R/ncu_topk_details.txt 2>&1; rm -f $R/topk.ncu-rep
pack
H='batch:8/context:131072/group:4/head_dim:128'
G="dense_decode/$H/sparsity:0/|packed_bitmap(_g4)?_mean_keys_decode/$H/retained:25/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/$H/retained:25/budget_inverse:8/page:16/|dense_quest_decode/$H/sparsity:0/budget_inverse:16/page:16/|dense_mean_keys_decode/$H/sparsity:0/budget_inverse:16/page:0/block:0/|dense_quest_blocks_decode/$H/sparsity:0/budget_inverse:16/"
for b in head s96 s80 s80 s96 head; do
  n=1; [ -f $R/${b}_1.txt ] && n=2
  timeout 100 ./bench_$b --benchmark_filter="$G" > $R/${b}_$n.txt 2>&1
  grep -h "batch:8/context" $R/${b}_$n.txt | awk -v b=$b '{print b, $1, $2}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/batch:8\/context:131072\///'
  grep -h "batch:8/context" $R/${b}_$n.txt | grep -oE "select_us=[0-9.]+" | tr '\n' ' '; echo
  pack
done
S="packed_bitmap(_g4)?_mean_keys_decode/$H/retained:25/budget_inverse:(16|8)/page:16/"
for st in 3 2; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st timeout 60 ./bench_head --benchmark_filter="$S" > $R/stages$st.txt 2>&1
  grep -h "batch:8/context" $R/stages$st.txt | awk -v b=stages$st '{print b, $1, $2}' | sed -E 's/\/group:4\/head_dim:128//; s/\/iterations:30\/manual_time//; s/batch:8\/context:131072\///'
done
pack
rm -rf $R
