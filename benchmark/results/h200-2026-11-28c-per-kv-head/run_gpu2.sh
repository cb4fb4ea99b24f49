#!/bin/bash
# GPU token-score tests (per-KV-head twins included) and the CUDA demo (its per-KV-head H2O rows).
cd "$(dirname "$0")" && tar xzf bins2.tgz && cd ..
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $R/device.txt
timeout 150 build-carry/t_scores --durations yes > $R/gpu-tests.txt 2>&1; echo "rc=$?" >> $R/gpu-tests.txt
timeout 400 build-carry/kvmosaic_demo --json $R/demo.json > $R/demo.txt 2>&1; echo "rc=$?" >> $R/demo.txt
cd $OUT && tar czf results.tgz r && rm -rf r
