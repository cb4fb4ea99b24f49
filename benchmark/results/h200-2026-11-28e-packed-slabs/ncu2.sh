#!/bin/bash
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/ncu; mkdir -p $R
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
M=""
for s in short_scoreboard long_scoreboard mio_throttle wait barrier math_pipe_throttle not_selected selected dispatch_stall lg_throttle tex_throttle no_instruction branch_resolving membar sleeping drain imc_miss misc; do
  M="$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
M=${M#,}
for b in new old; do
  timeout 200 $NCU --kernel-name regex:decode_partial_packed_mma --launch-skip 3 --launch-count 1 --metrics $M,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__cycles_active.avg ./bench_$b --benchmark_filter='packed_bitmap_decode/batch:8/context:131072' > $R/stall_$b.txt 2>&1
done
grep -h "stalled\|inst_executed\|wavefronts\|cycles_active" $R/stall_new.txt $R/stall_old.txt
