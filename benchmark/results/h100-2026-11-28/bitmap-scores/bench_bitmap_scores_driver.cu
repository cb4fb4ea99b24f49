// Developer driver (kept with its results): bench_decode.cu's functions, only the rows named below.
#include <benchmark/benchmark.h>
#include <initializer_list>
#include <vector>
struct kv_dummy_bench {
  template <class... A> kv_dummy_bench* Name(A&&...) { return this; }
  kv_dummy_bench* ArgNames(std::initializer_list<const char*>) { return this; }
  kv_dummy_bench* ArgsProduct(std::vector<std::vector<long>>) { return this; }
  kv_dummy_bench* Args(std::vector<long>) { return this; }
  template <class... A> kv_dummy_bench* UseManualTime(A&&...) { return this; }
  template <class... A> kv_dummy_bench* Iterations(A&&...) { return this; }
  template <class... A> kv_dummy_bench* Unit(A&&...) { return this; }
  static kv_dummy_bench* get() { static kv_dummy_bench d; return &d; }
};
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#undef BENCHMARK
#define BENCHMARK(...) [[maybe_unused]] static kv_dummy_bench* KV_CAT(kv_dummy_, __LINE__) = kv_dummy_bench::get()
#undef BENCHMARK_MAIN
#define BENCHMARK_MAIN()
#include "bench_decode.cu"
namespace {
[[maybe_unused]] const bool registered = [] {
  benchmark::RegisterBenchmark("hbm_read", hbm_read)->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("bitmap_tiles_decode", decode<format::bitmap_tiles>)
      ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
      ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {70}})
      ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("bitmap_tiles_tova_scores_decode", decode<format::bitmap_tiles, select::tova>)
      ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse"})
      ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {70}, {1}})
      ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
  return true;
}();
}
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
