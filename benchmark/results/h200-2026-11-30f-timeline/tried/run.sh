set -e
D=$(mktemp -d); tar -C $D -xJf build-carry/s45/g.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
($D/t_gpu 2>&1 | tail -4) | tee $OUT/tests.txt
F='packed_bitmap_g4_mean_keys_decode/.*/page:16/|packed_bitmap_g4_decode/|packed_bitmap_decode/batch:8/context:131072/|dense_decode/batch:[18]/context:(32768|131072)/group:4/head_dim:128/|dense_quest_decode/batch:8/context:131072/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2 3; do
for b in bench_main bench_new3; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
mkdir -p $OUT/tl
KVMOSAIC_TIMELINE=$OUT/tl/t $D/bench_timeline_new --benchmark_filter='packed_bitmap_g4_mean_keys_decode/batch:8/context:131072/.*/budget_inverse:16/page:16/|packed_bitmap_g4_mean_keys_decode/batch:1/context:32768/.*/budget_inverse:16/page:16/|dense_decode/batch:8/context:131072/group:4/head_dim:128/' > /dev/null 2>&1
cd $OUT/tl && rm -f *.0.csv *.2.csv && cd $OUT && tar -cJf tl.tar.xz tl ab && rm -rf tl ab
