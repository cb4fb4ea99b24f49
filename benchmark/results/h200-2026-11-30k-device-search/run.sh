# packed_bitmap's strategy search with its sums on the device (bench_new) against main's, which
# copies the segment's rows back and runs the candidate passes on the host (bench_main): the
# prefill per page and the decode step, searched and fixed; the packed GPU tests on the new build.
set -e
D=$(mktemp -d); tar -C $D -xJf build-carry/s47/b.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
($D/t_pk 2>&1 | tail -5) | tee $OUT/tests.txt
F='packed_bitmap_search_decode/|packed_bitmap_decode/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), 'step', round(b['real_time'],1), 'prefill/page', round(b.get('prefill_us_per_page',0),1), 'splits', b.get('splits')) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for b in bench_new bench_main; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b"; show $OUT/ab/$b.json
done
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
