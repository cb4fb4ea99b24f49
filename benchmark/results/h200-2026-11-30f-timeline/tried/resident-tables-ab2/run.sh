D=$(mktemp -d); tar -C $D -xJf build-carry/s45/h.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name --format=csv,noheader
F='packed_bitmap_g4_mean_keys_decode/.*/budget_inverse:16/page:16/|dense_decode/batch:[18]/context:32768/group:4/head_dim:128/|dense_quest_decode/batch:8/context:131072/.*/budget_inverse:16/page:16/'
show() { python3 -c "import json,sys; [print(b['name'].replace('group:4/head_dim:128/retained:25/','').replace('/iterations:30/manual_time',''), round(b['real_time'],1), round(b.get('select_us',0),1)) for b in json.load(open(sys.argv[1]))['benchmarks']]" $1; }
mkdir -p $OUT/ab
for round in 1 2; do for b in bench_main bench_new4; do
  $D/$b --benchmark_filter="$F" --benchmark_out=$OUT/ab/$b.$round.json --benchmark_out_format=json > /dev/null 2>&1
  echo "== $b round $round"; show $OUT/ab/$b.$round.json
done; done
timeout 90 $D/t_packed4 "GPU packed_bitmap with select::mean_keys*" 2>&1 | tail -3
timeout 40 $D/t_packed4 "GPU packed_bitmap: pages of 16 and 32 tokens*" 2>&1 | tail -3
cd $OUT && tar -cJf ab.tar.xz ab && rm -rf ab
