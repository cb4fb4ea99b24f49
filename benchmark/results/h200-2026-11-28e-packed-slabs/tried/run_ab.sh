#!/bin/bash
# Session 29, second call: dead slabs skipped in locate (a), and (b) a plus gathers whose
# addresses come from byte prefix counts (no cursor chain); baseline bench_new (9df1874).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/ab; mkdir -p $R
timeout 200 ./packed_bitmap_b --durations yes > $R/gpu_packed_bitmap_b.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap_b.txt
timeout 120 ./packed_eviction_b --durations yes > $R/gpu_packed_eviction_b.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction_b.txt
tail -n 3 $R/gpu_packed_bitmap_b.txt $R/gpu_packed_eviction_b.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap_decode|packed_bitmap_mean_keys_decode/batch:(1|8)/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16'
for i in 1 2; do
  for b in new a b; do ./bench_$b --benchmark_filter="$F" > $R/${b}_$i.txt 2>&1; done
done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
M=""
for s in short_scoreboard long_scoreboard wait not_selected selected math_pipe_throttle; do M="$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
timeout 100 $NCU --kernel-name regex:decode_partial_packed_mma --launch-skip 3 --launch-count 1 --metrics ${M#,},smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active ./bench_b --benchmark_filter='packed_bitmap_decode/batch:8/context:131072' > $R/stall_b.txt 2>&1
cd $R && for f in new_1 a_1 b_1 new_2 a_2 b_2; do echo "== $f"; grep manual_time $f.txt | awk '{print $1, $2, $3}' | sed 's/group:4.head_dim:128.retained:25.//;s/iterations:30.manual_time//'; done
grep "stalled\|inst_executed\|pct" stall_b.txt
