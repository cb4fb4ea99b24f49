#!/bin/bash
# The prefill with MosaicKV's strategy search (packed_bitmap_search_decode: each segment and KV
# head picks its rate and g on the host from the segment's rows, with the device's sums) against
# the fixed strategy, the build of 4d8f808 plus the search row, with OpenMP; our dense in the
# same run; two rounds. Run from the repository root with build-carry/s42/bins7.tar.xz carried.
B=/tmp/x; mkdir -p $B && tar xJf build-carry/s42/bins7.tar.xz -C $B
export LD_LIBRARY_PATH=$B:${LD_LIBRARY_PATH:-}
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
F='dense_decode/batch:8/context:131072/|packed_bitmap(_search)?_decode/batch:(8/context:131072|1/context:32768)/'
for n in 1 2; do
  timeout 200 $B/bench_omp_f --benchmark_filter="$F" --benchmark_out=$R/bench_$n.json --benchmark_out_format=json > $R/bench_$n.txt 2>&1
  python3 - $R/bench_$n.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['benchmarks']:
    print(r['name'].split('/iterations')[0].replace('/group:4/head_dim:128', ''), 'step %.1f us' % r['time_us'], 'prefill %.2f us/page' % r.get('prefill_us_per_page', -1))
PY
done
cd $OUT && tar czf results.tgz results && rm -rf results
