// SPDX-License-Identifier: Apache-2.0
// What the demo's host and CUDA parts share: options, the synthetic workload with its fp64
// reference, and one report row per cache configuration.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace demo {

using namespace kvmosaic;  // within the demo namespace only

struct options {
  int kv_heads = 8;
  int q_heads = 32;
  int head_dim = 128;
  int context = 32768;
  int batch = 1;
  int page_size = 64;
  int steps = 5;
  dtype storage = dtype::bf16;
  std::uint64_t seed = synthetic::kv_config{}.seed;
  std::string json;
};

[[noreturn]] inline void usage(const char* why) {
  std::fprintf(stderr,
               "kvmosaic_demo: %s\n"
               "usage: kvmosaic_demo [--kv-heads N] [--q-heads N] [--head-dim 64|128|256] [--context TOKENS]\n"
               "                     [--batch N] [--page-size N] [--dtype bf16|f16] [--steps N] [--seed N]\n"
               "                     [--json FILE]\n",
               why);
  std::exit(2);
}

inline options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") usage("decode attention over compressed KV caches, one row per cache");
    if (i + 1 >= argc) usage(("missing value after " + arg).c_str());
    const std::string value = argv[++i];
    const auto number = [&](long min) {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || v < min) usage((arg + " needs an integer >= " + std::to_string(min)).c_str());
      return static_cast<int>(v);
    };
    if (arg == "--kv-heads") o.kv_heads = number(1);
    else if (arg == "--q-heads") o.q_heads = number(1);
    else if (arg == "--head-dim") o.head_dim = number(1);
    else if (arg == "--context") o.context = number(1);
    else if (arg == "--batch") o.batch = number(1);
    else if (arg == "--page-size") o.page_size = number(1);
    else if (arg == "--steps") o.steps = number(1);
    else if (arg == "--seed") o.seed = std::strtoull(value.c_str(), nullptr, 0);
    else if (arg == "--json") o.json = value;
    else if (arg == "--dtype") {
      if (value == "bf16") o.storage = dtype::bf16;
      else if (value == "f16") o.storage = dtype::f16;
      else usage("--dtype must be bf16 or f16");
    } else {
      usage(("unknown option " + arg).c_str());
    }
  }
  if (o.q_heads % o.kv_heads != 0) usage("--q-heads must be a multiple of --kv-heads");
  return o;
}

/// Prints progress of a long step on one line of stderr.
inline void progress(const std::string& what, double fraction) {
  std::fprintf(stderr, "\r  %-44s %5.1f%%", what.c_str(), 100.0 * fraction);
  if (fraction >= 1.0) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

/// The synthetic workload every configuration runs: per sequence, its K/V, the decode query and
/// the fp64 exact attention output.
struct workload {
  cache_config config;
  synthetic::kv_config generator;
  std::vector<synthetic::kv_data> kv;
  std::vector<synthetic::token_stream> tokens;  // the token ids (sentence boundaries), per sequence
  std::vector<float> q;                 // [batch][Hq][D]
  std::vector<std::vector<double>> exact;  // per sequence [Hq][D]
};

inline workload make_workload(const options& o) {
  workload w;
  w.config.num_kv_heads = o.kv_heads;
  w.config.group_size = o.q_heads / o.kv_heads;
  w.config.head_dim = o.head_dim;
  w.config.page_size = o.page_size;
  w.config.storage = o.storage;
  w.config.max_sequences = o.batch;
  w.config.max_pages = o.batch * ((o.context + o.page_size - 1) / o.page_size) + 1;
  w.config.validate();  // clear message for an unsupported shape before any work
  w.generator.num_kv_heads = o.kv_heads;
  w.generator.group_size = w.config.group_size;
  w.generator.head_dim = o.head_dim;
  w.generator.seed = o.seed;
  const double scale = 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  for (int b = 0; b < o.batch; ++b) {
    progress("generating synthetic K/V", static_cast<double>(b) / o.batch);
    w.kv.push_back(synthetic::generate_kv(w.generator, static_cast<std::uint64_t>(b), o.context));
    w.tokens.push_back(synthetic::generate_tokens(w.generator, static_cast<std::uint64_t>(b), o.context));
    const std::vector<float> q = synthetic::generate_query(w.generator, static_cast<std::uint64_t>(b), o.context);
    w.q.insert(w.q.end(), q.begin(), q.end());
  }
  progress("generating synthetic K/V", 1.0);
  for (int b = 0; b < o.batch; ++b) {
    progress("fp64 exact attention (the reference)", static_cast<double>(b) / o.batch);
    const auto& kv = w.kv[static_cast<std::size_t>(b)];
    const std::size_t per_seq = static_cast<std::size_t>(o.q_heads) * o.head_dim;
    const tensor_view<const float, 2> q(w.q.data() + b * per_seq, o.q_heads, o.head_dim);
    w.exact.push_back(host::exact_attention(q, tensor_view<const float, 3>(kv.k.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim),
                                            tensor_view<const float, 3>(kv.v.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim),
                                            scale));
  }
  progress("fp64 exact attention (the reference)", 1.0);
  return w;
}

/// One row of the report.
struct row {
  std::string cache, format, selector, backend;
  double bytes_per_token = 0, compression_ratio = 0, rel_l2_error = 0, cosine = 0, decode_us = 0;
  std::int64_t pages_used = 0;   ///< pool pages held after prefill (the pool's gauge)
  std::int64_t pages_freed = 0;  ///< pages the context's sealed tokens fill, less those held: what eviction gave back
};

/// Runs one cache configuration: prefill every sequence, time `steps` decode steps (median), and
/// compare the output with the exact reference. `rows_of(b)` gives the K and V arrays of sequence
/// b (host or device pointers, as the backend takes them), `q` and `out` the step's arrays,
/// `read_out()` the output on the host, and `timed(step)` runs a step and returns microseconds.
template <class Cache, class RowsOf, class Timed, class ReadOut>
row run(Cache& cache, const workload& w, int steps, RowsOf&& rows_of, Timed&& timed, ReadOut&& read_out) {
  const std::string name = cache.describe();
  const int batch = static_cast<int>(w.kv.size());
  using selector_type = typename Cache::selector_type;
  // A selector that evicts by each step's token scores (TOVA, H2O) evicts on a write after a step
  // scored the prompt: the prefill leaves the last token out, one untimed step scores the rest,
  // and the last token's append evicts down to the budget.
  constexpr bool scores_first = kvmosaic::detail::token_scores_of<selector_type>::value != kvmosaic::score_use::none;
  std::vector<kvmosaic::sequence_id> seqs;
  for (int b = 0; b < batch; ++b) {
    progress("prefill " + name, static_cast<double>(b) / batch);
    const auto& kv = w.kv[static_cast<std::size_t>(b)];
    const auto kv_rows = rows_of(b);
    const int n = scores_first ? kv.num_tokens - 1 : kv.num_tokens;
    seqs.push_back(cache.add_sequence());
    cache.prefill(seqs.back(), kvmosaic::tensor_view<const float, 3>(kv_rows.first, n, kv.num_kv_heads, kv.head_dim),
                  kvmosaic::tensor_view<const float, 3>(kv_rows.second, n, kv.num_kv_heads, kv.head_dim),
                  kvmosaic::span<const std::int32_t>(w.tokens[static_cast<std::size_t>(b)].ids.data(), n));
  }
  progress("prefill " + name, 1.0);
  if constexpr (scores_first) {
    timed([&](const float* q, float* out) {
      const kvmosaic::cache_config& c = cache.config();
      cache.attend(kvmosaic::span<const kvmosaic::sequence_id>(seqs.data(), batch),
                   kvmosaic::tensor_view<const float, 3>(q, batch, c.num_q_heads(), c.head_dim),
                   kvmosaic::tensor_view<float, 3>(out, batch, c.num_q_heads(), c.head_dim));
    });
    for (int b = 0; b < batch; ++b) {
      const auto& kv = w.kv[static_cast<std::size_t>(b)];
      const auto kv_rows = rows_of(b);
      const std::size_t last = static_cast<std::size_t>(kv.num_tokens - 1) * kv.num_kv_heads * kv.head_dim;
      cache.append(kvmosaic::span<const kvmosaic::sequence_id>(&seqs[static_cast<std::size_t>(b)], 1),
                   kvmosaic::tensor_view<const float, 3>(kv_rows.first + last, 1, kv.num_kv_heads, kv.head_dim),
                   kvmosaic::tensor_view<const float, 3>(kv_rows.second + last, 1, kv.num_kv_heads, kv.head_dim));
    }
  }
  // SnapKV: one snapshot after the prompt, voted by the queries of its last `window` positions
  // (host memory on every backend), the generator's as for the step's query.
  if constexpr (std::is_same<selector_type, kvmosaic::select::snapkv>::value) {
    const kvmosaic::cache_config& c = cache.config();
    const int window = cache.selector().window;
    for (int b = 0; b < batch; ++b) {
      const int n = w.kv[static_cast<std::size_t>(b)].num_tokens;
      std::vector<float> q;
      for (int t = n - window; t < n; ++t) {
        const std::vector<float> one = kvmosaic::synthetic::generate_query(w.generator, static_cast<std::uint64_t>(b), t + 1);
        q.insert(q.end(), one.begin(), one.end());
      }
      cache.snapshot(seqs[static_cast<std::size_t>(b)],
                     kvmosaic::tensor_view<const float, 3>(q.data(), window, c.num_q_heads(), c.head_dim));
    }
  }

  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    progress("decode " + name, static_cast<double>(s) / steps);
    times.push_back(timed([&](const float* q, float* out) {
      const kvmosaic::cache_config& c = cache.config();
      cache.attend(kvmosaic::span<const kvmosaic::sequence_id>(seqs.data(), batch),
                   kvmosaic::tensor_view<const float, 3>(q, batch, c.num_q_heads(), c.head_dim),
                   kvmosaic::tensor_view<float, 3>(out, batch, c.num_q_heads(), c.head_dim));
    }));
  }
  progress("decode " + name, 1.0);
  std::sort(times.begin(), times.end());

  // Fidelity over the whole batch's output.
  const std::vector<float> out = read_out();
  std::vector<double> exact;
  for (const auto& e : w.exact) exact.insert(exact.end(), e.begin(), e.end());
  const kvmosaic::host::fidelity f = kvmosaic::host::compare(out.data(), exact.data(), exact.size());

  // Bytes against the dense bytes of the whole logical context (what a cache that evicts nothing
  // would hold as 16-bit rows): for caches that keep everything, the tokens stored.
  kvmosaic::memory_stats m;
  const kvmosaic::cache_config& c = cache.config();
  const std::int64_t dense_row_bytes = 2LL * c.num_kv_heads * c.head_dim * static_cast<std::int64_t>(size_of(c.storage));
  std::int64_t full_pages = 0;
  for (const kvmosaic::sequence_id s : seqs) {
    const kvmosaic::memory_stats one = cache.sequence_memory(s);
    m.tokens += cache.length(s);
    m.stored_bytes += one.stored_bytes;
    m.dense_bytes += cache.length(s) * dense_row_bytes;
    full_pages += cache.length(s) / c.page_size;
  }
  row r;
  r.pages_used = cache.memory().pages_used;
  if constexpr (kvmosaic::detail::is_per_kv_head<selector_type>::value)  // head pages, counted as all-heads pages
    r.pages_used = (r.pages_used + c.num_kv_heads - 1) / c.num_kv_heads;
  r.pages_freed = full_pages - r.pages_used;
  r.cache = name;
  r.format = kvmosaic::format_traits<typename Cache::format_type>::describe(cache.format());
  r.selector = kvmosaic::selector_traits<typename Cache::selector_type>::describe(cache.selector());
  r.backend = Cache::backend_type::name;
  r.bytes_per_token = m.bytes_per_token();
  r.compression_ratio = m.compression_ratio();
  r.rel_l2_error = f.rel_l2_error;
  r.cosine = f.cosine;
  r.decode_us = times[times.size() / 2];
  return r;
}

/// The host backend's rows: the CPU runs the step, a steady clock times it.
template <class Cache>
row run_host(Cache& cache, const workload& w, int steps) {
  std::vector<float> out(w.q.size());
  return run(
      cache, w, steps,
      [&](int b) {
        const auto& kv = w.kv[static_cast<std::size_t>(b)];
        return std::make_pair(kv.k.data(), kv.v.data());
      },
      [&](auto&& step) {
        const auto start = std::chrono::steady_clock::now();
        step(w.q.data(), out.data());
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      },
      [&] { return out; });
}

inline void print_table(const std::vector<row>& rows, const options& o) {
  std::printf("\nkvmosaic %s: %d KV heads, %d query heads, head_dim %d, context %d, batch %d, page %d, %s\n",
              version_string(), o.kv_heads, o.q_heads, o.head_dim, o.context, o.batch, o.page_size, to_string(o.storage));
  int width = static_cast<int>(std::strlen("configuration"));  // the longest configuration name
  for (const row& r : rows) width = std::max(width, static_cast<int>(r.cache.size()));
  std::printf("%-*s %12s %12s %13s %12s %14s %11s %11s  %s\n", width, "configuration", "bytes/token", "compression",
              "rel L2 error", "cosine", "decode (us)", "pages used", "pages freed", "backend");
  for (const row& r : rows) {
    std::printf("%-*s %12.1f %12.4f %13.3e %12.9f %14.1f %11lld %11lld  %s\n", width, r.cache.c_str(), r.bytes_per_token,
                r.compression_ratio, r.rel_l2_error, r.cosine, r.decode_us, static_cast<long long>(r.pages_used),
                static_cast<long long>(r.pages_freed), r.backend.c_str());
  }
}

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

inline void write_json(const std::vector<row>& rows, const std::string& path) {
  std::ofstream f(path);
  if (!f) {
    std::fprintf(stderr, "kvmosaic_demo: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  f.precision(10);
  f << "[\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const row& r = rows[i];
    f << "  {\"cache\": " << json_string(r.cache) << ", \"format\": " << json_string(r.format)
      << ", \"selector\": " << json_string(r.selector) << ", \"backend\": " << json_string(r.backend)
      << ", \"bytes_per_token\": " << r.bytes_per_token << ", \"compression_ratio\": " << r.compression_ratio
      << ", \"rel_l2_error\": " << r.rel_l2_error << ", \"cosine\": " << r.cosine << ", \"decode_us\": " << r.decode_us
      << ", \"pages_used\": " << r.pages_used << ", \"pages_freed\": " << r.pages_freed << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  f << "]\n";
}


/// MUSTAFAR's bitmap_tiles as the paper runs it: K and V pruned to `sparsity`, no exact tokens.
inline kvmosaic::format::bitmap_tiles mustafar(float sparsity) {
  kvmosaic::format::bitmap_tiles f;
  f.s_k = f.s_v = sparsity;
  f.sink_tokens = 0;
  return f;
}

/// HACK's quant2 configurations the demo reports: Pi = 32, 64, 128 (those dividing head_dim), each
/// with stochastic and nearest rounding, and Pi = 64 with 4 sink tokens kept 16-bit; pages hold
/// at least one partition of tokens.
inline std::vector<std::pair<kvmosaic::cache_config, kvmosaic::format::quant2>> quant2_variants(
    const kvmosaic::cache_config& base, std::uint64_t seed) {
  using namespace kvmosaic;
  std::vector<std::pair<cache_config, format::quant2>> variants;
  for (const int partition : {32, 64, 128}) {
    if (base.head_dim % partition != 0) continue;  // K groups channels by Pi
    for (const auto mode : {format::rounding::stochastic, format::rounding::nearest}) {
      cache_config config = base;
      config.page_size = std::max(config.page_size, partition);
      variants.emplace_back(config, format::quant2{partition, mode, seed, format::key_axis::tokens, /*sink_tokens=*/0});
    }
  }
  if (base.head_dim % 64 == 0) {  // the generator's attention sinks kept 16-bit
    cache_config config = base;
    config.page_size = std::max(config.page_size, 64);
    variants.emplace_back(config, format::quant2{64, format::rounding::stochastic, seed, format::key_axis::tokens, 4});
  }
  return variants;
}

/// The 4-bit rows' configuration: pages of at least 64 tokens (Pi = 64), or none where head_dim is
/// not a multiple of 64. The rows run quant4 and quant4 with V per token at their defaults (Pi = 64,
/// nearest rounding, 4 sinks): docs/quantization.md.
inline bool quant4_config(const kvmosaic::cache_config& base, kvmosaic::cache_config& config) {
  if (base.head_dim % 64 != 0) return false;
  config = base;
  config.page_size = std::max(config.page_size, 64);
  return true;
}

/// The read-less selectors the demo reports, at budgets 1/16 and 1/8 of the context:
/// select::quest (one block per page, and blocks of 16 tokens at 1/16) and select::sentence_chunks
/// with the synthetic vocabulary's boundary tokens.
inline std::vector<kvmosaic::select::quest> quest_variants() {
  std::vector<kvmosaic::select::quest> v;
  for (const int inverse : {16, 8}) {
    kvmosaic::select::quest s;
    s.budget.ratio = 1.0 / inverse;
    s.block_tokens = 0;  // whole pages
    v.push_back(s);
  }
  kvmosaic::select::quest blocks;
  blocks.budget.ratio = 1.0 / 16;
  blocks.block_tokens = 16;
  v.push_back(blocks);
  return v;
}
inline std::vector<kvmosaic::select::sentence_chunks> sentence_chunk_variants() {
  std::vector<kvmosaic::select::sentence_chunks> v;
  for (const int inverse : {16, 8}) {
    kvmosaic::select::sentence_chunks s;
    s.budget.ratio = 1.0 / inverse;
    for (const auto& b : synthetic::boundary_tokens) s.boundaries.push_back(kvmosaic::select::boundary{b.id, b.weight});
    v.push_back(s);
  }
  return v;
}

/// select::mean_keys (MosaicKV's stage 2) at budgets 1/16 and 1/8 of the context, blocks of 16.
inline std::vector<kvmosaic::select::mean_keys> mean_keys_variants() {
  std::vector<kvmosaic::select::mean_keys> v;
  for (const int inverse : {16, 8}) {
    kvmosaic::select::mean_keys s;
    s.budget.ratio = 1.0 / inverse;
    s.block_tokens = 16;
    v.push_back(s);
  }
  return v;
}

/// MosaicKV's packed format at the paper's setting (25% of the channels retained per vector, the
/// bottom 25% truncated, g = 1) with 4 sinks, segments of the whole pages nearest 64K tokens;
/// false where head_dim / 4 is not a whole number.
inline bool mosaic(const kvmosaic::cache_config& base, kvmosaic::format::packed_bitmap& format) {
  if (base.head_dim % 4 != 0) return false;
  format = kvmosaic::format::packed_bitmap{};
  format.sink_tokens = 4;
  format.segment_tokens = base.page_size * std::max(1, 65536 / base.page_size);
  return true;
}

/// select::streaming at budgets 1/8 and 1/4 of the context (4 sinks and the most recent tokens).
inline std::vector<kvmosaic::select::streaming> streaming_variants() {
  std::vector<kvmosaic::select::streaming> v;
  for (const int inverse : {8, 4}) {
    kvmosaic::select::streaming s;
    s.budget.ratio = 1.0 / inverse;
    v.push_back(s);
  }
  return v;
}
/// The quant2 format the streaming rows use: Pi = 64, stochastic rounding, the 4 sinks kept 16-bit.
inline std::pair<kvmosaic::cache_config, kvmosaic::format::quant2> streaming_quant2(const kvmosaic::cache_config& base,
                                                                                   std::uint64_t seed) {
  kvmosaic::cache_config config = base;
  config.page_size = std::max(config.page_size, 64);
  return {config, kvmosaic::format::quant2{64, kvmosaic::format::rounding::stochastic, seed, kvmosaic::format::key_axis::tokens, 4}};
}

/// Runs `run_one(cache)` for every streaming row on `Backend`: dense and quant2 at 1/8 and 1/4 with
/// hole filling, and quant2 at 1/8 with repack (which re-encodes every page it slides).
template <class Backend, class RunOne>
void for_each_streaming_cache(const kvmosaic::cache_config& base, std::uint64_t seed, RunOne&& run_one) {
  using namespace kvmosaic;
  const auto [q2_config, q2] = streaming_quant2(base, seed);
  for (const auto& s : streaming_variants()) {
    cache<format::dense, select::streaming, compact::hole_fill, Backend> dense(base, {}, s);
    run_one(dense);
    cache<format::quant2, select::streaming, compact::hole_fill, Backend> quant(q2_config, q2, s);
    run_one(quant);
  }
  cache<format::quant2, select::streaming, compact::repack, Backend> repacked(q2_config, q2, streaming_variants().front());
  run_one(repacked);
}

/// Runs `run_one(cache)` for the rows that evict by attention scores on `Backend`, over dense
/// pages at 1/8 and 1/4 with repack: TOVA and H2O (scored by the attend path, a compaction pass
/// after every write so that the pages come back at once), SnapKV (one snapshot after the
/// prompt, window 32) and H2O per KV head.
template <class Backend, class RunOne>
void for_each_scored_eviction_cache(const kvmosaic::cache_config& base, RunOne&& run_one) {
  using namespace kvmosaic;
  for (const int inverse : {8, 4}) {
    const select::token_budget budget{1.0 / inverse, -1};
    select::tova tova;
    tova.budget = budget;
    tova.compact_every = 1;
    cache<format::dense, select::tova, compact::repack, Backend> by_tova(base, {}, tova);
    run_one(by_tova);
    select::h2o h2o;
    h2o.budget = budget;
    h2o.compact_every = 1;
    cache<format::dense, select::h2o, compact::repack, Backend> by_h2o(base, {}, h2o);
    run_one(by_h2o);
    select::snapkv snap;
    snap.budget = budget;
    cache<format::dense, select::snapkv, compact::repack, Backend> by_snapkv(base, {}, snap);
    run_one(by_snapkv);
    // H2O with one decision per KV head, each head in pages of its own (select::per_kv_head).
    select::per_kv_head<select::h2o> h2o_by_head;
    h2o_by_head.selector = h2o;
    cache<format::dense, select::per_kv_head<select::h2o>, compact::repack, Backend> by_head(base, {}, h2o_by_head);
    run_one(by_head);
  }
}

/// The CUDA rows: defined in demo_cuda.cu when the demo is built with CUDA. Returns no rows when
/// no GPU is present (the caller then runs the host backend).
std::vector<row> run_cuda(const workload& w, int steps);

}  // namespace demo
