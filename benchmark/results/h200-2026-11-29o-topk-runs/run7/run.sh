#!/bin/bash
# s40 run 7: test_cuda_select.cu's [select] cases on the final code (the span top-k's block scan
# in its own shared memory).
cd "$(dirname "$0")"
mkdir -p /tmp/s40r7 && tar xJf bins7.tar.xz -C /tmp/s40r7
cd /tmp/s40r7
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
( time timeout 170 ./t_sel_G "[select]" ) > $R/gpu_select.txt 2>&1; echo "rc $?" >> $R/gpu_select.txt; tail -n 9 $R/gpu_select.txt; grep -c "allowed: a$" $R/gpu_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
