#!/bin/bash
# Straight after run3 on the same machine (which left suite.part.a and the new build's binaries
# in /tmp/keep): the GPU suite's tests but packed_bitmap's on main's code (2b0f11f: the merge
# kernel that every format shares changed in session 41), every shape, in four parts side by
# side (the test binary built here with cmake for sm_90, `kvmosaic_gpu_tests` linked without the
# two packed test units, split in three to fit the carry); beside them, the new build's
# packed_bitmap tests in two parts. Run from the repository root with build-carry/s42/
# suite.part.b and suite.part.c carried.
B=/tmp/x; mkdir -p $B && cat /tmp/keep/suite.part.a build-carry/s42/suite.part.b build-carry/s42/suite.part.c | tar xJ -C $B
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
run() {  # name, binary, test spec
  ( s=$(date +%s); timeout ${LIMIT:-500} $2 "$3" --durations yes > $R/$1.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/$1.txt ) &
}
run select $B/t_rest "[select]"
run quant2 $B/t_rest "[quant2]"
run bitmap $B/t_rest "[bitmap_tiles]"
run rest $B/t_rest "~[select]~[quant2]~[bitmap_tiles]"
run packed /tmp/keep/bins/t_pb "[packed_bitmap]~[select]"
run packed_select /tmp/keep/bins/t_pb "[packed_bitmap][select]"
wait
for f in select quant2 bitmap rest packed packed_select; do echo "$f: $(tail -1 $R/$f.txt) $(grep -E 'All tests passed|test cases:' $R/$f.txt | tail -1)"; done
cd $OUT && tar czf results.tgz results && rm -rf results
