#!/bin/bash
# The prefill with the segment sums on the device, both builds with OpenMP: omp_b is run2's
# (K's per-channel sums a thread per channel straight from memory), omp_c the committed one (K's
# rows staged in shared memory, 32 at a time), alternating, two rounds; then Nsight Compute's
# durations of the prefill's sums and encode kernels (omp_c, select::all, batch 8, 128K). Also
# keeps build-carry/s42/suite.part.a in /tmp/keep for the next call (suite/run.sh). Run from the
# repository root with build-carry/s42/bins4.tar.xz and suite.part.a carried.
mkdir -p /tmp/keep/bins && cp build-carry/s42/suite.part.a /tmp/keep/ && tar xJf build-carry/s42/bins4.tar.xz -C /tmp/keep/bins
B=/tmp/keep/bins
export LD_LIBRARY_PATH=$B:${LD_LIBRARY_PATH:-}
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='packed_bitmap_decode/batch:(8/context:131072|1/context:32768)/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in omp_b omp_c omp_b omp_c; do
  n=1; [ -f $R/${b}_1.json ] && n=2
  timeout 100 $B/bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  python3 - $R/${b}_$n.json $b <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['benchmarks']:
    print(sys.argv[2], r['name'].split('/iterations')[0].replace('/group:4/head_dim:128', ''), 'step %.1f us' % r['time_us'], 'prefill %.2f us/page' % r.get('prefill_us_per_page', -1))
PY
done
timeout 150 /usr/local/cuda/bin/ncu --clock-control none -k regex:"packed_tile|packed_add|encode_packed|packed_block_key" --launch-count 40 \
  --metrics gpu__time_duration.sum $B/bench_omp_c --benchmark_filter='packed_bitmap_decode/batch:8/context:131072/' > $R/ncu_prefill.txt 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z_]+.*\(|gpu__time_duration" $R/ncu_prefill.txt | paste - - | awk '{print $1, $(NF)}' | sort | uniq -c | head -20
cd $OUT && tar czf results.tgz results && rm -rf results
