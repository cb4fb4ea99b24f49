#!/bin/bash
# The packed_bitmap GPU tests of the final code, 8ff51b4 (the host sums in one loop of up to four rows,
# segment_fit_rows shared by both backends; the same as run5 otherwise). Run from the
# repository root with build-carry/s42/bins6.tar.xz carried.
B=/tmp/x; mkdir -p $B && tar xJf build-carry/s42/bins6.tar.xz -C $B
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
run() {  # name, test spec
  ( s=$(date +%s); timeout 300 $B/t_pb "$2" --durations yes > $R/$1.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/$1.txt ) &
}
run gpu_packed "[packed_bitmap]~[select]"
run gpu_packed_select "[packed_bitmap][select]"
wait
for f in gpu_packed gpu_packed_select; do echo "$f: $(tail -1 $R/$f.txt) $(grep -E 'All tests passed|test cases:' $R/$f.txt | tail -1)"; done
cd $OUT && tar czf results.tgz results && rm -rf results
