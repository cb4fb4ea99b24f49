#!/bin/bash
# packed_bitmap g = 4, select::all, batch 8, 128K (H200): Nsight Compute of the lean-rows
# kernel (stall reasons by SASS line), then bench A/B: lean rows / + two q.k MMA chains.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD:$LD_LIBRARY_PATH
R=$OUT/results; mkdir -p $R
G4='packed_bitmap_g4_decode/batch:8/context:131072'
timeout 240 ncu --kernel-name regex:decode_partial_packed_mma --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section SourceCounters \
  --section InstructionStats -o $R/g4 ./bench_new --benchmark_filter="$G4" > $R/ncu_run.txt 2>&1
ncu --import $R/g4.ncu-rep --page details > $R/ncu_details.txt 2>&1
ncu --import $R/g4.ncu-rep --page source --csv --print-source sass > $R/ncu_source.csv 2>&1
F='dense_decode/batch:8/context:131072/|packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072'
for round in 1; do
  for b in new acc2; do
    ./bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$round.json --benchmark_out_format=json > $R/${b}_$round.txt 2>&1
  done
done
for st in 3 4; do
  KVMOSAIC_BENCH_PACKED_STAGES=$st ./bench_acc2 --benchmark_filter="packed_bitmap(_g2|_g4)?_decode/batch:8/context:131072" > $R/stages$st.txt 2>&1
done
grep -h "batch:8/context:131072" $R/stages*.txt | awk '{print $1, $2, $3}'
grep -h "batch:8/context:131072" $R/*_1.txt $R/*_2.txt | awk '{print $1, $2, $3}'
cd $OUT && tar czf results.tgz results && rm -rf results
