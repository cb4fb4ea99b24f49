#!/bin/bash
# s38 run 5: GPU tests of packed_bitmap (every case) on the committed code.
cd "$(dirname "$0")"
tar xJf bins5.tar.xz
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
timeout 400 ./t_packed_final > $R/gpu_packed_bitmap.txt 2>&1; echo "rc $?" >> $R/gpu_packed_bitmap.txt; tail -n 4 $R/gpu_packed_bitmap.txt
cd $OUT && tar czf results.tgz results && rm -rf results
