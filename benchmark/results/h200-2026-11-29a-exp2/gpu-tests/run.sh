#!/bin/bash
# H200: the GPU tests of every format whose kernels fold with warp_attend_mma (its softmax step
# changed), built here for sm_90, one binary each (the token-score, selection, eviction and
# exact-token units included), run side by side on the one GPU (they check results, not time).
cd "$(dirname "$0")"
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
T="packed_bitmap packed_eviction dense bitmap token_scores select eviction exact_tokens"
for t in $T; do
  ( s=$(date +%s); timeout ${LIMIT:-420} ./$t --durations yes > $R/gpu_$t.txt 2>&1; rc=$?
    echo "$t rc=$rc $(( $(date +%s) - s ))s" > $R/rc_$t.txt ) &
done
wait
for t in $T; do echo "$(cat $R/rc_$t.txt) $(grep -E 'All tests passed|test cases:' $R/gpu_$t.txt | tail -1)"; done
cd $OUT && tar czf results.tgz results && rm -rf results
