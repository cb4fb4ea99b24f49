set -e
D=$(mktemp -d); tar -C $D -xJf build-carry/s45/b.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
F='packed_bitmap_g4_mean_keys_decode/.*/page:16/|packed_bitmap_g4_decode/|packed_bitmap_decode/batch:8/context:131072/|dense_decode/batch:8/context:131072/group:4/head_dim:128/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1), int(b.get('splits',0))) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
for round in 1 2 3; do
for b in bench_main bench_new bench_new2; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/$b.$round.json
done; done
G='packed_bitmap_g4_mean_keys_decode/batch:1/.*/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:8/context:32768/.*/budget_inverse:16/page:16/'
for t in 8 16 32; do
  KVMOSAIC_BENCH_TARGET_SPLITS=$t $D/bench_new2 --benchmark_filter="$G" --benchmark_out=$OUT/splits$t.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== bench_new2 target splits $t"; show $OUT/splits$t.json
done
mkdir -p $OUT/tl3
KVMOSAIC_TIMELINE=$OUT/tl3/t $D/bench_tl3 --benchmark_filter='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/.*/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:1/context:32768/.*/budget_inverse:16/page:16/' > /dev/null 2>&1
cd $OUT && tar -cJf tl3.tar.xz tl3 && rm -rf tl3
