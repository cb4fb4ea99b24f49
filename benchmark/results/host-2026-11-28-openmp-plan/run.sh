#!/bin/bash
# Host prefill with the KV heads' segment plans on OpenMP threads (2-core development machine).
cd "$(dirname "$0")/../../.."
g++ -std=c++17 -O3 -fopenmp -DNDEBUG -Iinclude -isystem /usr/include/eigen3 -o /tmp/bh benchmark/bench_host.cpp \
  -lbenchmark_main -lbenchmark -lpthread
for t in 1 2; do
  OMP_NUM_THREADS=$t /tmp/bh --benchmark_filter='host_prefill/demo_32k/bf16/(dense|packed)' \
    --benchmark_out=benchmark/results/host-2026-11-28-openmp-plan/bh_omp$t.json --benchmark_out_format=json
done
