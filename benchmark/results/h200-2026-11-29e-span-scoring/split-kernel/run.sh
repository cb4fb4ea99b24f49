#!/bin/bash
# H200: where the packed_bitmap split kernel's time goes in the mean_keys 1/16 step (g = 4,
# pages of 16, batch 8, 128K): Nsight Compute stall samples by SASS line, then the step against
# the split plan's split cost and the kernel's pipeline stages.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
pack() { (cd $OUT && tar czf results.tgz results); }
F='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
timeout 150 ncu --clock-control none --kernel-name regex:decode_partial_packed_mma --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section SourceCounters \
  --section InstructionStats --section MemoryWorkloadAnalysis_Tables -o $R/mk16 ./bench_new --benchmark_filter="$F" > $R/ncu_run.txt 2>&1
ncu --import $R/mk16.ncu-rep --page details > $R/ncu_details.txt 2>&1
ncu --import $R/mk16.ncu-rep --page source --csv --print-source sass > $R/ncu_source.csv 2>&1
rm -f $R/mk16.ncu-rep
pack
for cost in 46 20 100 200; do
  KVMOSAIC_BENCH_SPLIT_COST=$cost timeout 40 ./bench_new --benchmark_filter="$F" > $R/cost$cost.txt 2>&1
  grep -h "batch:8" $R/cost$cost.txt | grep -oE "^\S+ +[0-9.]+ us|splits=[0-9]+" | tr '\n' ' '; echo " cost $cost"
done
for st in 2 4; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st timeout 40 ./bench_new --benchmark_filter="$F" > $R/stages$st.txt 2>&1
  grep -h "batch:8" $R/stages$st.txt | grep -oE "^\S+ +[0-9.]+ us|stages=[0-9]+" | tr '\n' ' '; echo
done
pack
rm -rf $R
