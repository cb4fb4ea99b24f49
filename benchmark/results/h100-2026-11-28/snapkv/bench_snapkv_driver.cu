// Developer driver (kept with its results): bench_decode.cu's functions, only the rows named below.
#include "bench_decode_rows.cuh"
namespace {
[[maybe_unused]] const bool registered = [] {
  benchmark::RegisterBenchmark("hbm_read", hbm_read)->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("dense_decode", decode<format::dense>)
      ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
      ->ArgsProduct({{1}, {32768, 131072}, {4}, {128}, {0}})
      ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("dense_snapkv_window_votes", window_votes)
      ->ArgNames({"context", "window"})
      ->ArgsProduct({{32768, 131072}, {32}})
      ->UseManualTime()->Iterations(10)->Unit(benchmark::kMicrosecond);
  return true;
}();
}
KVMOSAIC_BENCH_DRIVER_MAIN()
