#!/bin/bash
# Session 47: the strategy search in chunks of 64 rows, rows rotated by fused_rotate (the device's
# order; new) against 6f94263's Eigen product and one running sum (main), on the 2-core
# development machine (no GPU), two rounds alternating. Run from the repository root
# (results.txt: its output).
set -e
MAIN=/tmp/search_chunks_main
rm -rf $MAIN && mkdir -p $MAIN && git archive 6f94263 include | tar x -C $MAIN
for which in main new; do
  inc=$([ $which = main ] && echo $MAIN/include || echo include)
  g++ -std=c++17 -O3 -DNDEBUG -I"$inc" -Ibenchmark -isystem /usr/include/eigen3 benchmark/bench_host.cpp \
      -lbenchmark_main -lbenchmark -lpthread -o /tmp/bench_host_$which
done
for round in 1 2; do
  for which in main new; do
    /tmp/bench_host_$which --benchmark_filter='host_prefill/.*/packed_bitmap_(search|r0.25)' 2>/dev/null | grep host_prefill |
      awk -v b=$which '{print b, $1, $2, $3}'
  done
done
