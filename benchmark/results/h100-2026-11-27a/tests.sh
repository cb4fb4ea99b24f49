#!/usr/bin/env bash
# Session 19, device run 5: the GPU tests of the selections (quest, mean_keys, sentence_chunks:
# device pages and rows against the host's), eviction (live masks), exact tokens and packed_bitmap
# with the final selection kernels. Binaries built on the development machine for sm_90.
set -u
R=$OUT/r; mkdir -p $R
cd build-carry
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv >> $R/env.txt
for t in gpu_select gpu_eviction gpu_exact gpu_packed; do
  [ -x ./$t ] || continue
  date; timeout 200 ./$t > $R/$t.txt 2>&1; echo "$t rc $?" >> $R/env.txt; echo $t; tail -2 $R/$t.txt
done
