#!/bin/bash
# The segment sums on the device (packed_bitmap's plan): (1) the packed_bitmap and packed-eviction
# GPU tests of the new build, side by side; (2) bench_decode at batch 8, 128K: our dense, packed
# select::all (g = 1) and mean_keys 1/16 (g = 4, pages of 16), main's build (2b0f11f: the plan's
# covariances on the host) and the new one alternating, two rounds: prefill_us_per_page and the
# step. Run from the repository root with build-carry/s42/bins1.tar.xz carried.
B=/tmp/x; mkdir -p $B && tar xJf build-carry/s42/bins1.tar.xz -C $B
export LD_LIBRARY_PATH=$B:${LD_LIBRARY_PATH:-}
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
( s=$(date +%s); timeout 280 $B/t_pb "[packed_bitmap]~[select]" --durations yes > $R/gpu_packed.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/gpu_packed.txt ) &
( s=$(date +%s); timeout 280 $B/t_pb "[packed_bitmap][select]" --durations yes > $R/gpu_packed_select.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/gpu_packed_select.txt ) &
( s=$(date +%s); timeout 280 $B/t_pe --durations yes > $R/gpu_packed_eviction.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/gpu_packed_eviction.txt ) &
wait
for f in gpu_packed gpu_packed_select gpu_packed_eviction; do echo "$f: $(tail -1 $R/$f.txt) $(grep -E 'All tests passed|test cases:' $R/$f.txt | tail -1)"; done
F='dense_decode/batch:8/context:131072/|packed_bitmap_decode/batch:8/context:131072/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in main new main new; do
  n=1; [ -f $R/${b}_1.json ] && n=2
  timeout 200 $B/bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  python3 - $R/${b}_$n.json $b <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['benchmarks']:
    print(sys.argv[2], r['name'].split('/iterations')[0].replace('/group:4/head_dim:128', ''), 'step %.1f us' % r['time_us'], 'prefill %.2f us/page' % r.get('prefill_us_per_page', -1))
PY
done
cd $OUT && tar czf results.tgz results && rm -rf results
