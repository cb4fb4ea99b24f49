#!/bin/bash
# s41 run 5: the GPU tests of the committed code (6f5e48a: each warp fills its own rows of a
# small-page slot) in one binary of test_cuda_packed_bitmap.cu, test_cuda_packed_eviction.cu and
# test_cuda_select.cu (engines of one shape, bf16/128/4), four processes in parallel:
# packed_bitmap's [select] cases, its other cases, its token-score and SnapKV cases (both split
# kernels with logits), and test_cuda_select's cases (those of other shapes stop at their first).
# Run from the repository root, with build-carry/s41/bins5.tar.xz carried.
mkdir -p /tmp/s41r5 && tar xJf build-carry/s41/bins5.tar.xz -C /tmp/s41r5
cd /tmp/s41r5
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
run() { timeout 420 ./t_final "$2" > $R/$1.txt 2>&1; echo "rc $?" >> $R/$1.txt; }
run gpu_packed_select "[packed_bitmap][select]" &
run gpu_packed_other "[packed_bitmap]~[select]~[token_scores]~[snapkv]" &
run gpu_packed_eviction "[token_scores],[snapkv]" &
run gpu_select "[select]~[packed_bitmap]" &
wait
for f in gpu_packed_select gpu_packed_other gpu_packed_eviction gpu_select; do echo "== $f"; tail -n 4 $R/$f.txt; done
grep -c "allowed: a$" $R/gpu_select.txt
cd $OUT && tar czf results.tgz results && rm -rf results
