# The block-key query rotation reading each sequence's slot from the pull's page-locked staging
# and issuing its basis copies while the pull runs (bench_new) against main (bench_main),
# alternating, three rounds; the packed GPU tests on the new build first.
set -e
D=$(mktemp -d); tar -C $D -xJf build-carry/s47/a.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
($D/t_pk 2>&1 | tail -5) | tee $OUT/tests.txt
F='packed_bitmap_g4_mean_keys_decode/.*/page:16/|packed_bitmap_g4_decode/batch:8/context:131072/|dense_decode/batch:[18]/context:(32768|131072)/group:4/head_dim:128/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_main bench_new; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
