#!/bin/bash
# The encode kernel staging the basis in shared memory (a thread per rotated channel, the 16
# tokens' chains in registers): (1) the packed_bitmap and packed-eviction GPU tests (the
# compaction re-encodes), side by side; (2) bench_decode's prefill, both builds with OpenMP:
# omp_c (run3's committed build) and omp_d (this one), alternating, two rounds; (3) Nsight
# Compute's durations of the prefill's kernels (omp_d, select::all, batch 8, 128K). Run from the
# repository root with build-carry/s42/bins5.tar.xz carried.
B=/tmp/x; mkdir -p $B && tar xJf build-carry/s42/bins5.tar.xz -C $B
export LD_LIBRARY_PATH=$B:${LD_LIBRARY_PATH:-}
R=$OUT/results; mkdir -p $R
nvidia-smi -L > $R/device.txt
run() {  # name, binary, test spec
  ( s=$(date +%s); timeout 280 $2 "$3" --durations yes > $R/$1.txt 2>&1; echo "rc=$? $(( $(date +%s) - s ))s" >> $R/$1.txt ) &
}
run gpu_packed $B/t_pb "[packed_bitmap]~[select]"
run gpu_packed_select $B/t_pb "[packed_bitmap][select]"
run gpu_packed_eviction $B/t_pe ""
wait
for f in gpu_packed gpu_packed_select gpu_packed_eviction; do echo "$f: $(tail -1 $R/$f.txt) $(grep -E 'All tests passed|test cases:' $R/$f.txt | tail -1)"; done
F='packed_bitmap_decode/batch:(8/context:131072|1/context:32768)/|packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/group:4/head_dim:128/retained:25/budget_inverse:16/page:16/'
for b in omp_c omp_d omp_c omp_d; do
  n=1; [ -f $R/${b}_1.json ] && n=2
  timeout 100 $B/bench_$b --benchmark_filter="$F" --benchmark_out=$R/${b}_$n.json --benchmark_out_format=json > $R/${b}_$n.txt 2>&1
  python3 - $R/${b}_$n.json $b <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))['benchmarks']:
    print(sys.argv[2], r['name'].split('/iterations')[0].replace('/group:4/head_dim:128', ''), 'step %.1f us' % r['time_us'], 'prefill %.2f us/page' % r.get('prefill_us_per_page', -1))
PY
done
timeout 120 /usr/local/cuda/bin/ncu --clock-control none -k regex:"packed_tile|packed_add|encode_packed" --launch-count 12 \
  --metrics gpu__time_duration.sum $B/bench_omp_d --benchmark_filter='packed_bitmap_decode/batch:8/context:131072/' > $R/ncu_prefill.txt 2>&1
echo "ncu rc=$?"
grep -E "^  void|gpu__time_duration" $R/ncu_prefill.txt | paste - - | sed -E 's/\(packed.*//' | awk '{print $2, $(NF-1), $NF}' | sort | uniq -c
cd $OUT && tar czf results.tgz results && rm -rf results
