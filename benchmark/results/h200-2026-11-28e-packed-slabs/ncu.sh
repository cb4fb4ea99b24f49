#!/bin/bash
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/ncu; mkdir -p $R
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats --section Occupancy"
for b in new old; do
  timeout 200 $NCU --kernel-name regex:decode_partial_packed_mma --launch-skip 3 --launch-count 1 $S ./bench_$b --benchmark_filter='packed_bitmap_decode/batch:8/context:131072' > $R/$b.txt 2>&1
done
grep -h -i "bank\|Issue Slots Busy\|Executed Ipc Active\|Duration\|Warp Cycles Per Issued\|Shared Memory\|Registers Per\|Achieved Occupancy\|Executed Instructions  \|L1/TEX Hit\|Memory Throughput\|No Eligible" $R/new.txt $R/old.txt | head -60
