// SPDX-License-Identifier: Apache-2.0
//
// Host-backend decode attention (`cache::attend` on backend::host), one query token per sequence,
// batch 1, per format and storage dtype, on synthetic K/V (`synthetic::generate_kv`).
//
// Shapes: SmolLM2 (3 KV heads, group 3, head_dim 64) at 2K and 8K tokens, and the demo's
// (8 KV heads, group 4, head_dim 128) at 32K; pages of 64. Formats: dense, bitmap_tiles at
// s = 0.5 and 0.7, quant2 at Pi = 32 and 64, nearest and stochastic rounding, without and with 4
// sink tokens, and packed_bitmap at 25% retained (g = 1, the bottom 25% truncated).
//
// `host_prefill/<shape>/bf16/<format>` times a whole prefill instead (a fresh cache, every page
// encoded): for packed_bitmap the segment's covariances, eigendecompositions and (strategy
// search) candidate passes included, against dense's prefill and one dense attend step
// (MosaicKV's Table 2 compares its encoding with the model's prefill).
//
// Each benchmark times one `attend` per iteration (wall time: the host backend may run threads).
// Counters:
//   ratio_to_dense  this step's time over dense's at the same shape, context and dtype, measured
//                   earlier in the same process (the dense benchmark of each group runs first; a
//                   filter that leaves it out times it first, outside the reported numbers)
//   us_per_step     microseconds per attend (one layer, one decode step)
//   ns_per_token    nanoseconds per (token, KV head)
//
// The host machine is often shared: run with --benchmark_repetitions and read the medians
// (benchmark/README.md, "Host backend").

#include <benchmark/benchmark.h>

#include <kvmosaic/kvmosaic.hpp>
#include <kvmosaic/support/synthetic.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace kvmosaic;

struct shape_case {
  const char* name;
  int kv_heads, group, head_dim, context;
};

constexpr shape_case shapes[] = {
    {"smollm2_2k", 3, 3, 64, 2048},
    {"smollm2_8k", 3, 3, 64, 8192},
    {"demo_32k", 8, 4, 128, 32768},
};

/// The synthetic K/V and query of one shape, generated once per process.
struct workload {
  synthetic::kv_data kv;
  std::vector<float> q;
};

const workload& workload_of(const shape_case& s) {
  static std::map<std::string, std::unique_ptr<workload>> cache;
  std::unique_ptr<workload>& w = cache[s.name];
  if (!w) {
    synthetic::kv_config g;
    g.num_kv_heads = s.kv_heads;
    g.group_size = s.group;
    g.head_dim = s.head_dim;
    w = std::make_unique<workload>();
    w->kv = synthetic::generate_kv(g, 0, s.context);
    w->q = synthetic::generate_query(g, 0, s.context);
  }
  return *w;
}

/// One prefilled cache, type-erased: the benchmark only attends.
struct any_cache {
  virtual ~any_cache() = default;
  virtual void attend(const float* q, float* out) = 0;
  virtual double bytes_per_token() const = 0;
};

template <class Format>
struct typed_cache final : any_cache {
  typed_cache(const cache_config& config, const Format& format, const workload& w) : c(config, format) {
    seq = c.add_sequence();
    const auto& kv = w.kv;
    c.prefill(seq, tensor_view<const float, 3>(kv.k.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim),
              tensor_view<const float, 3>(kv.v.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim));
  }
  void attend(const float* q, float* out) override {
    const cache_config& k = c.config();
    c.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q, 1, k.num_q_heads(), k.head_dim),
             tensor_view<float, 3>(out, 1, k.num_q_heads(), k.head_dim));
  }
  double bytes_per_token() const override { return c.sequence_memory(seq).bytes_per_token(); }
  cache<Format> c;
  sequence_id seq;
};

cache_config config_of(const shape_case& s, dtype storage) {
  cache_config c;
  c.num_kv_heads = s.kv_heads;
  c.group_size = s.group;
  c.head_dim = s.head_dim;
  c.page_size = 64;
  c.storage = storage;
  c.max_sequences = 1;
  c.max_pages = (s.context + c.page_size - 1) / c.page_size + 1;
  return c;
}

/// Keeps the one cache in use: repetitions of a benchmark reuse it, the next benchmark replaces it.
template <class Format>
any_cache& cache_for(const std::string& key, const shape_case& s, dtype storage, const Format& f) {
  static std::string current;
  static std::unique_ptr<any_cache> held;
  if (current != key || !held) {
    held.reset();
    held = std::make_unique<typed_cache<Format>>(config_of(s, storage), f, workload_of(s));
    current = key;
  }
  return *held;
}

/// Seconds per attend of `c`, timed over at least `min_seconds`.
double time_steps(any_cache& c, const float* q, float* out, double min_seconds) {
  using clock = std::chrono::steady_clock;
  c.attend(q, out);  // warm
  int n = 0;
  const auto start = clock::now();
  double elapsed = 0;
  do {
    c.attend(q, out);
    ++n;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  } while (elapsed < min_seconds);
  return elapsed / n;
}

std::map<std::string, std::vector<double>>& dense_times() {
  static std::map<std::string, std::vector<double>> times;
  return times;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Format>
void run(benchmark::State& state, const shape_case& s, dtype storage, const std::string& format_name, const Format& f,
         bool is_dense) {
  const std::string group = std::string(s.name) + "/" + to_string(storage);
  const workload& w = workload_of(s);
  any_cache& c = cache_for(group + "/" + format_name, s, storage, f);
  std::vector<float> out(w.q.size());
  c.attend(w.q.data(), out.data());  // warm

  using clock = std::chrono::steady_clock;
  double total = 0;
  for (auto _ : state) {
    const auto start = clock::now();
    c.attend(w.q.data(), out.data());
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    state.SetIterationTime(seconds);
    total += seconds;
    benchmark::DoNotOptimize(out.data());
  }
  const double per_step = total / static_cast<double>(state.iterations());
  if (is_dense) dense_times()[group].push_back(per_step);
  std::vector<double>& dense = dense_times()[group];
  if (dense.empty()) {  // the dense benchmark was filtered out: time it here, unreported
    typed_cache<format::dense> d(config_of(s, storage), format::dense{}, w);
    dense.push_back(time_steps(d, w.q.data(), out.data(), 0.5));
  }
  state.counters["ratio_to_dense"] = per_step / median(dense);
  state.counters["us_per_step"] = per_step * 1e6;
  state.counters["ns_per_token"] = per_step * 1e9 / (static_cast<double>(s.context) * s.kv_heads);
  state.counters["bytes_per_token"] = c.bytes_per_token();
  state.counters["context"] = s.context;
}

template <class Format>
void add(const shape_case& s, dtype storage, const std::string& format_name, const Format& f, bool is_dense = false) {
  const std::string name = std::string("host_attend/") + s.name + "/" + to_string(storage) + "/" + format_name;
  benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) { run(st, s, storage, format_name, f, is_dense); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(s.context >= 32768 ? 2.0 : 0.5);
}

format::quant2 quant2_of(int partition, format::rounding mode, int sinks) {
  format::quant2 f;
  f.partition = partition;
  f.mode = mode;
  f.sink_tokens = sinks;
  return f;
}

/// Seconds of one prefill of shape `s` into a fresh cache of `Format` (construction included).
template <class Format>
double prefill_seconds(const shape_case& s, const Format& f) {
  const auto start = std::chrono::steady_clock::now();
  typed_cache<Format> c(config_of(s, dtype::bf16), f, workload_of(s));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <class Format>
void add_prefill(const shape_case& s, const std::string& format_name, const Format& f) {
  const std::string name = std::string("host_prefill/") + s.name + "/bf16/" + format_name;
  benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& state) {
    const double dense = prefill_seconds(s, format::dense{});
    std::vector<float> out(workload_of(s).q.size());
    typed_cache<format::dense> step(config_of(s, dtype::bf16), format::dense{}, workload_of(s));
    const double dense_step = time_steps(step, workload_of(s).q.data(), out.data(), 0.5);
    double total = 0;
    for (auto _ : state) {
      const double seconds = prefill_seconds(s, f);
      state.SetIterationTime(seconds);
      total += seconds;
    }
    const double per = total / static_cast<double>(state.iterations());
    const double pages = static_cast<double>(s.context / 64);
    state.counters["us_per_page"] = per * 1e6 / pages;  // a page of every KV head, K and V
    state.counters["ratio_to_dense_prefill"] = per / dense;
    state.counters["ratio_to_dense_step"] = per / dense_step;
    state.counters["context"] = s.context;
  })->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(2);
}

format::packed_bitmap packed_of(format::strategy mode) {
  format::packed_bitmap f;  // 25% retained, g = 1, the bottom 25% truncated: the paper's setting
  f.mode = mode;
  return f;
}

int register_all() {
  for (const shape_case& s : shapes)
    for (const dtype storage : {dtype::bf16, dtype::f16}) {
      add(s, storage, "dense", format::dense{}, true);
      for (const float sparsity : {0.5f, 0.7f}) {
        format::bitmap_tiles f;
        f.s_k = f.s_v = sparsity;
        f.sink_tokens = 0;  // MUSTAFAR's setting, as the rows' names say
        add(s, storage, sparsity == 0.5f ? "bitmap_tiles_s0.5" : "bitmap_tiles_s0.7", f);
      }
      for (const int sinks : {0, 4})
        for (const int partition : {32, 64})
          for (const format::rounding mode : {format::rounding::nearest, format::rounding::stochastic}) {
            const std::string name = "quant2_pi" + std::to_string(partition) +
                                     (mode == format::rounding::nearest ? "_nearest" : "_stochastic") +
                                     (sinks > 0 ? "_sinks4" : "");
            add(s, storage, name, quant2_of(partition, mode, sinks));
          }
      add(s, storage, "packed_bitmap_r0.25", packed_of(format::strategy::fixed));
    }
  for (const shape_case& s : shapes) {
    add_prefill(s, "dense", format::dense{});
    add_prefill(s, "quant2_pi64_nearest", quant2_of(64, format::rounding::nearest, 0));
    add_prefill(s, "packed_bitmap_r0.25", packed_of(format::strategy::fixed));
    add_prefill(s, "packed_bitmap_search", packed_of(format::strategy::search));
  }
  return 0;
}

[[maybe_unused]] const int registered = register_all();

}  // namespace
