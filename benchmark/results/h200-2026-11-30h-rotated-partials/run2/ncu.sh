# The split and merge kernels' durations (Nsight Compute, one benchmark each) in main and bench_dr2.
D=$(mktemp -d); tar -C $D -xJf build-carry/s46/dr2.tar.xz
export LD_LIBRARY_PATH=$D:$LD_LIBRARY_PATH
for b in bench_main bench_dr2; do
for f in 'packed_bitmap_g4_mean_keys_decode/batch:1/context:131072/budget_inverse:16/page:16/' 'packed_bitmap_g4_decode/batch:8/context:131072/'; do
  echo "== $b $f"
  ncu --kernel-name regex:"merge|decode_partial" --launch-skip 40 --launch-count 4 --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,launch__block_size \
    $D/$b --benchmark_filter="$f" --benchmark_min_time=0 2>&1 | grep -E "merge|decode_partial|gpu__time|grid_size|registers|block_size" | sed -e 's/(kvmosaic[^)]*)//' | cut -c1-160
done; done
