#!/bin/bash
# H200: the final code's packed_bitmap GPU tests (every case) and packed eviction tests.
cd "$(dirname "$0")"
tar xJf bins5.tar.xz
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 300 ./t_packed > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt
tail -n 3 $R/gpu_packed_bitmap.txt
timeout 120 ./t_pev > $R/gpu_packed_eviction.txt 2>&1; echo "rc $?" >> $R/gpu_packed_eviction.txt
tail -n 3 $R/gpu_packed_eviction.txt
cd $OUT && tar czf results.tgz results && rm -rf results
