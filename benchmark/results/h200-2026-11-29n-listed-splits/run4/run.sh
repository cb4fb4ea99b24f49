#!/bin/bash
# s39 run 4: the GPU test of the split cap (set_target_splits(1), a 600-page sequence of small
# pages under select::all), then packed_bitmap's [select] cases, on the committed code.
cd "$(dirname "$0")"
mkdir -p /tmp/s39r4 && tar xJf bins4.tar.xz -C /tmp/s39r4
cd /tmp/s39r4
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
# (a first command named the test case with its comma, which Catch splits: it ran nothing)
timeout 200 ./t_packed_cap "[select]" > $R/gpu_packed_select.txt 2>&1; echo "rc $?" >> $R/gpu_packed_select.txt; tail -n 3 $R/gpu_packed_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
