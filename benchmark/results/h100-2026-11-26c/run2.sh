#!/usr/bin/env bash
set -u
R=$OUT/r2; mkdir -p $R
cd build-carry
xz -dk gpu_select.xz && chmod +x gpu_select
nvidia-smi --query-gpu=name --format=csv >> $R/env.txt
timeout 280 ./gpu_select "[select]" -r junit -o $R/gpu_select.xml > $R/gpu_select.txt 2>&1; echo "tests rc $?" >> $R/env.txt
tail -3 $R/gpu_select.txt
