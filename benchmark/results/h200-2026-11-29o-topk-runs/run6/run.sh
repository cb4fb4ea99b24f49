#!/bin/bash
# s40 run 6: every packed_bitmap GPU case on the committed code, the mean_keys case now also at
# head_dim 256, group 8 (the block-key scoring kernel's eight-head width).
cd "$(dirname "$0")"
mkdir -p /tmp/s40r6 && tar xJf bins6.tar.xz -C /tmp/s40r6
cd /tmp/s40r6
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
( time timeout 400 ./t_packed_F --durations yes ) > $R/gpu_packed_all.txt 2>&1; echo "rc $?" >> $R/gpu_packed_all.txt; tail -n 8 $R/gpu_packed_all.txt
cd $OUT && tar czf results.tgz results && rm -rf results
