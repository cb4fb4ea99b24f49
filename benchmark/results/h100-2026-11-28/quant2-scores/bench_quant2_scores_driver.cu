// Developer driver (kept with its results): bench_decode.cu's functions, only the rows named below.
#include "bench_decode_rows.cuh"
namespace {
[[maybe_unused]] const bool registered = [] {
  benchmark::RegisterBenchmark("hbm_read", hbm_read)->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("quant2_decode", decode<format::quant2>)
      ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
      ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}})
      ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("quant2_tova_scores_decode", decode<format::quant2, select::tova>)
      ->ArgNames({"batch", "context", "group", "head_dim", "partition", "budget_inverse"})
      ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}, {1}})
      ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
  return true;
}();
}
KVMOSAIC_BENCH_DRIVER_MAIN()
