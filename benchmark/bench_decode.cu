// SPDX-License-Identifier: Apache-2.0
// Decode-attention benchmarks on the CUDA backend (Google Benchmark, manual timing with CUDA
// events, L2 flushed before every timed step). Every run first measures the GPU's streaming-read
// bandwidth (`hbm_read`) so each decode result is also reported as a fraction of it.
//
// The step's device part is a captured CUDA graph (as engines replay decode steps), enqueued
// behind a short busy-wait kernel, so the events measure GPU time, not host launch latency.
//
// Counters (decimal units): time_us (median step), bytes (the stored K and V by the format's
// accounting, plus q and out, read/written per step), GBps = bytes / median time,
// fraction_of_hbm = GBps / hbm_read GBps, plan_us (host time of the step's plan, not included in
// time_us), prefill_us_per_page (the first sequence's prefill: row kernels plus, for compressed
// formats, the device encoder; per page of all KV heads), stages (bitmap_tiles: compressed pages
// in flight per CTA). KVMOSAIC_BENCH_BITMAP_STAGES (_QUANT2_, _PACKED_) overrides them, for tuning;
// KVMOSAIC_BENCH_PDL=0 turns programmatic dependent launch off (counter dependent_launch).
// select::quest rows (`*_quest_decode`) time the whole selected step (scoring, top-k, attention
// over the chosen pages, merge) as time_us, and the scoring and top-k alone (with the metadata
// copy) as select_us, in a second graph timed the same way; bytes count the pages read, the tail,
// every page's key bounds, q and out. select::streaming rows (`*_streaming_decode`) count the
// bytes the sequences still store after eviction and compaction (counter budget).

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <memory>
#include <type_traits>
#include <vector>

#include "kvmosaic/kvmosaic.cuh"
#include "kvmosaic/support/synthetic.hpp"
#include "timing.cuh"

namespace {

using namespace kvmosaic;
using namespace kvmosaic_bench;
/// The kernels a row compiles: every shape for the formats timed over several shapes, the shape of
/// record (bf16, head_dim 128, groups of 4) for the quantized formats other than quant2 and for
/// the selectors that read token scores. A developer build may define KVMOSAIC_BENCH_ONE_SHAPE
/// (the shape of record everywhere: rows of other shapes then fail) to compile faster.
template <class Format, class Selector>
using backend_for =
    std::conditional_t<(format::is_quant_v<Format> && !std::is_same<Format, format::quant2>::value) ||
                           std::is_same<Format, format::packed_bitmap>::value ||
                           detail::token_scores_of<Selector>::value != score_use::none ||
                           std::is_same<Selector, select::snapkv>::value
#ifdef KVMOSAIC_BENCH_ONE_SHAPE
                           || true
#endif
                       ,
                       backend::cuda_for<kernel_shape<dtype::bf16, 128, 4>>, backend::cuda>;

/// Keep-less selectors (select::streaming, tova, h2o) compact by hole filling; the others keep
/// everything.
template <class Format, class Selector = select::all>
using cuda_cache = cache<Format, Selector, std::conditional_t<selector_traits<Selector>::evicts, compact::hole_fill, compact::none>,
                         backend_for<Format, Selector>>;

double g_hbm_read_gbps = 0;  // measured by the first benchmark of the run

/// Reads `words` 16-byte words once, four independent loads in flight per thread per step (the
/// best of the variants we tried: a peak that flatters no kernel); one xor per word so nothing is
/// optimized away.
__global__ void stream_read_kernel(const uint4* __restrict__ data, std::size_t words, unsigned* sink) {
  unsigned acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      v[u] = i + u * stride < words ? kvmosaic::cuda::detail::load_streaming(data + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;  // practically never: keeps the loads
}

void report(benchmark::State& state, const std::vector<double>& times, double bytes) {
  const double t = median(times);
  state.counters["time_us"] = t * 1e6;
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = bytes / t / 1e9;
  if (g_hbm_read_gbps > 0) state.counters["fraction_of_hbm"] = bytes / t / 1e9 / g_hbm_read_gbps;
}

void hbm_read(benchmark::State& state) {
  const std::size_t bytes = std::size_t{4} << 30;  // 4 GiB: far beyond L2
  kvmosaic::cuda::device_buffer data(bytes), sink(sizeof(unsigned));
  KVMOSAIC_CUDA_CHECK(cudaMemset(data.data(), 1, bytes));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  event_timer timer;
  std::vector<double> times;
  for (auto _ : state) {
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.start));
    stream_read_kernel<<<sms * 4, 512>>>(data.as<const uint4>(), bytes / 16, sink.as<unsigned>());
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.stop));
    const double s = timer.seconds();
    times.push_back(s);
    state.SetIterationTime(s);
  }
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  report(state, times, static_cast<double>(bytes));
  g_hbm_read_gbps = static_cast<double>(bytes) / median(times) / 1e9;
  state.counters["fraction_of_hbm"] = 1.0;
}

/// Which settings of a format a benchmark row times besides the ones its arguments give.
enum class format_settings {
  paper,    ///< the source paper's: no exact tokens (sink_tokens = recent_tokens = 0), quant2 rounding stochastic
  library,  ///< the library's defaults (docs/defaults.md: 4 sink tokens, quant2 rounding to nearest)
  paper_search,  ///< the paper's, and packed_bitmap's strategy search (section 5.5: rate, g and block size per segment)
};

/// Decode of one format: batch x context tokens, Hkv=8, head_dim 128 (or range 3), GQA group 4
/// (Hq=32; or range 2), bf16, pages of 64; bitmap_tiles at s_k = s_v = range 4 percent; quant2
/// with partition Pi = range 4 (pages of max(64, Pi) tokens); the rest as `Settings` says.
/// Also times the prefill (row kernels, and the device encoder for compressed formats) of the
/// first sequence: prefill_us_per_page is per page of all KV heads, K and V. packed_bitmap keeps
/// `ElementGroup` adjacent rotated channels a bit (its fixed strategy's g). `PageSize` replaces
/// the pages of 64 of every format but quant2 (a selector's `page` argument replaces both).
template <class Format, class Selector = select::all, format_settings Settings = format_settings::paper,
          int ElementGroup = 1, int PageSize = 64>
void decode(benchmark::State& state) {
  constexpr bool selects = !selector_traits<Selector>::reads_all_pages;
  const int batch = static_cast<int>(state.range(0));
  const int context = static_cast<int>(state.range(1));
  cache_config c;
  c.num_kv_heads = 8;
  c.group_size = state.range(2) > 0 ? static_cast<int>(state.range(2)) : 4;
  c.head_dim = state.range(3) > 0 ? static_cast<int>(state.range(3)) : 128;
  constexpr bool is_quant2 = format::is_quant_v<Format>;  // any width, either V axis
  c.page_size = is_quant2 ? std::max<int>(64, static_cast<int>(state.range(4))) : PageSize;
  if (selects && state.range(6) > 0) c.page_size = static_cast<int>(state.range(6));  // quest with smaller pages
  c.storage = dtype::bf16;
  c.max_sequences = batch;
  c.max_pages = batch * (context / c.page_size + 1);
  Format format{};
  if constexpr (Settings == format_settings::paper || Settings == format_settings::paper_search) {
    format.sink_tokens = format.recent_tokens = 0;
    if constexpr (is_quant2) format.mode = format::rounding::stochastic;
  }
  if constexpr (Settings == format_settings::paper_search) {
    static_assert(std::is_same<Format, format::packed_bitmap>::value, "format_settings::paper_search: packed_bitmap only");
    format.mode = format::strategy::search;
  }
  state.counters["sink_tokens"] = format.sink_tokens;
  if constexpr (std::is_same<Format, format::bitmap_tiles>::value) {
    format.s_k = format.s_v = static_cast<float>(state.range(4)) / 100.0f;
    // KVMOSAIC_BENCH_BITMAP_K_LAYOUT=channels: K tiled as V (bitmap_k_layout::along_channels, the
    // default); =tokens: the paper's.
    if (const char* layout = std::getenv("KVMOSAIC_BENCH_BITMAP_K_LAYOUT"); layout != nullptr)
      format.k_layout = std::string(layout) == "channels" ? format::bitmap_k_layout::along_channels
                                                          : format::bitmap_k_layout::along_tokens;
    state.counters["k_along_tokens"] = format.k_layout == format::bitmap_k_layout::along_tokens ? 1 : 0;
  }
  if constexpr (is_quant2) format.partition = static_cast<int>(state.range(4));
  constexpr bool is_packed = std::is_same<Format, format::packed_bitmap>::value;
  if constexpr (is_packed) {
    format.retained = static_cast<float>(state.range(4)) / 100.0f;
    format.group = ElementGroup;
    state.counters["element_group"] = ElementGroup;
  }
  Selector selector{};
  constexpr bool evicts = selector_traits<Selector>::evicts;
  if constexpr (selects || evicts) selector.budget.ratio = 1.0 / static_cast<double>(state.range(5));
  if constexpr (evicts) state.counters["budget"] = 1.0 / static_cast<double>(state.range(5));
  constexpr bool chunked = selector_traits<Selector>::needs_token_ids;
  if constexpr (std::is_same<Selector, select::quest>::value || std::is_same<Selector, select::mean_keys>::value)
    selector.block_tokens = static_cast<int>(state.range(7));
  if constexpr (chunked)
    for (const auto& b : synthetic::boundary_tokens) selector.boundaries.push_back(select::boundary{b.id, b.weight});
  cuda_cache<Format, Selector> kv(c, format, selector);
  if constexpr (std::is_same<Format, format::bitmap_tiles>::value || is_quant2 || is_packed) {
    // Tuning experiments: KVMOSAIC_BENCH_BITMAP_STAGES (KVMOSAIC_BENCH_QUANT2_STAGES,
    // KVMOSAIC_BENCH_PACKED_STAGES) overrides the engine's compressed stages where its kernel
    // streams pages by bulk copies.
    const char* stages = std::getenv(is_quant2   ? "KVMOSAIC_BENCH_QUANT2_STAGES"
                                     : is_packed ? "KVMOSAIC_BENCH_PACKED_STAGES"
                                                 : "KVMOSAIC_BENCH_BITMAP_STAGES");
    if (stages != nullptr && kv.engine().compressed_stages() > 0) kv.engine().set_compressed_stages(std::atoi(stages));
    state.counters["stages"] = kv.engine().compressed_stages();
  }
  // Tuning experiments: KVMOSAIC_BENCH_SPLIT_COST overrides the split cost the plan weighs (the
  // format's estimate otherwise).
  if (const char* cost = std::getenv("KVMOSAIC_BENCH_SPLIT_COST"); cost != nullptr)
    kv.engine().set_split_cost_pages(std::atoi(cost));
  state.counters["split_cost_pages"] = kv.engine().split_cost_pages();
  // Tuning experiments: KVMOSAIC_BENCH_TARGET_SPLITS sets the splits a KV head's wave aims for
  // (one wave of the device otherwise).
  if (const char* splits = std::getenv("KVMOSAIC_BENCH_TARGET_SPLITS"); splits != nullptr)
    kv.engine().set_target_splits(std::atoi(splits));

  // Prefill every sequence in chunks from one random source (the bytes differ per page slot).
  const int chunk = std::min(context, 16384);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kvmosaic::cuda::device_buffer source(2 * chunk * row * sizeof(bfloat16));
  // KVMOSAIC_BENCH_KV=synthetic: K and V from the synthetic generator (outlier channels in K, as
  // models have), which is what decides how full bitmap_tiles' K tiles are; the default is
  // uniform random values, cheaper to make.
  const char* kv_source = std::getenv("KVMOSAIC_BENCH_KV");
  const bool synthetic_kv = kv_source != nullptr && std::string(kv_source) == "synthetic";
  state.counters["synthetic_kv"] = synthetic_kv ? 1 : 0;
  if (synthetic_kv) {
    synthetic::kv_config source_config;
    source_config.num_kv_heads = c.num_kv_heads;
    source_config.group_size = c.group_size;
    source_config.head_dim = c.head_dim;
    const synthetic::kv_data generated = synthetic::generate_kv(source_config, 7, chunk);
    std::vector<bfloat16> rows(2 * chunk * row);
    for (std::size_t i = 0; i < chunk * row; ++i) {
      rows[i] = bfloat16(generated.k[i]);
      rows[chunk * row + i] = bfloat16(generated.v[i]);
    }
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(source.data(), rows.data(), rows.size() * sizeof(bfloat16), cudaMemcpyHostToDevice));
  } else {
    fill_kernel<<<1024, 256>>>(source.as<bfloat16>(), 2 * chunk * row, 7u);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  }
  std::vector<sequence_id> seqs;
  event_timer prefill_timer;
  double prefill_seconds = 0;
  for (int b = 0; b < batch; ++b) {
    seqs.push_back(kv.add_sequence());
    // sentence_chunks: the synthetic generator's token ids (sentences of ~20 tokens).
    synthetic::kv_config tokens_config;
    tokens_config.seed = 11;
    const std::vector<std::int32_t> ids =
        chunked ? synthetic::generate_tokens(tokens_config, static_cast<std::uint64_t>(b), context).ids : std::vector<std::int32_t>{};
    for (int done = 0; done < context; done += chunk) {
      const int n = std::min(chunk, context - done);
      const bfloat16* k = source.as<const bfloat16>();  // values repeat per chunk; addresses never do
      if (b == 0) KVMOSAIC_CUDA_CHECK(cudaEventRecord(prefill_timer.start));
      const tensor_view<const bfloat16, 3> keys(k, n, c.num_kv_heads, c.head_dim);
      const tensor_view<const bfloat16, 3> values(k + chunk * row, n, c.num_kv_heads, c.head_dim);
      if constexpr (chunked)
        kv.prefill(seqs.back(), keys, values, span<const std::int32_t>(ids.data() + done, n));
      else
        kv.prefill(seqs.back(), keys, values);
      if (b == 0) {
        KVMOSAIC_CUDA_CHECK(cudaEventRecord(prefill_timer.stop));
        prefill_seconds += prefill_timer.seconds();
      }
    }
  }
  const std::size_t q_count = static_cast<std::size_t>(batch) * c.num_q_heads() * c.head_dim;
  kvmosaic::cuda::device_buffer q(q_count * sizeof(float)), out(q_count * sizeof(float));
  std::vector<float> q_host(q_count);
  for (std::size_t i = 0; i < q_count; ++i) q_host[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(q.data(), q_host.data(), q_count * sizeof(float), cudaMemcpyHostToDevice));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());

  auto& engine = kv.engine();
  // KVMOSAIC_BENCH_PDL=0: split and merge kernels without programmatic dependent launch, for
  // same-binary comparisons (counter dependent_launch).
  if (const char* pdl = std::getenv("KVMOSAIC_BENCH_PDL"); pdl != nullptr && std::string(pdl) == "0")
    engine.use_dependent_launch(false);
  state.counters["dependent_launch"] = engine.uses_dependent_launch() ? 1 : 0;
  const span<const sequence_id> step_seqs(seqs.data(), static_cast<std::int64_t>(seqs.size()));
  const tensor_view<const float, 3> step_q(q.as<const float>(), batch, c.num_q_heads(), c.head_dim);
  const tensor_view<float, 3> step_out(out.as<float>(), batch, c.num_q_heads(), c.head_dim);
  l2_flusher flusher;
  event_timer timer;
  std::vector<double> times, plan_times;
  // The step's device part captured once in a CUDA graph, as an engine replays decode steps:
  // the copy, the split kernel and the merge run back to back without host launch gaps.
  cudaStream_t stream;
  KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream));
  engine.set_stream(stream);
  kv.plan(step_seqs);
  cudaGraph_t graph;
  cudaGraphExec_t step;
  KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  kv.run(step_q, step_out);
  KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&step, graph, 0));
  // Warm-up by time, at least 0.2 s of steps: the first configuration run after a large one
  // (dense, batch 8, 128K) ran up to 3x slow through its whole timing loop, and the same
  // configuration right after it did not (H100, 2026-11-22: quant2 batch 1, 128K, 210 us then
  // 80 us); two warm-up steps did not absorb it.
  const auto warm_start = std::chrono::steady_clock::now();
  do {
    for (int warm = 0; warm < 10; ++warm) KVMOSAIC_CUDA_CHECK(cudaGraphLaunch(step, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - warm_start).count() < 0.2);
  for (auto _ : state) {
    const auto plan_start = std::chrono::steady_clock::now();
    kv.plan(step_seqs);
    plan_times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - plan_start).count());
    const double s = timed_replay(step, stream, flusher, timer);
    times.push_back(s);
    state.SetIterationTime(s);
  }
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  if constexpr (selects) {  // scoring and top-k alone, timed the same way
    cudaGraph_t select_graph;
    cudaGraphExec_t select_step;
    KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    engine.launch_selection_only(q.as<const float>());
    KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &select_graph));
    KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&select_step, select_graph, 0));
    std::vector<double> select_times;
    for (int i = 0; i < 30; ++i) select_times.push_back(timed_replay(select_step, stream, flusher, timer));
    state.counters["select_us"] = median(select_times) * 1e6;
    state.counters["budget"] = 1.0 / static_cast<double>(state.range(5));
    state.counters["page"] = c.page_size;
    cudaGraphExecDestroy(select_step);
    cudaGraphDestroy(select_graph);
  }
  cudaGraphExecDestroy(step);
  cudaGraphDestroy(graph);
  engine.set_stream(nullptr);
  cudaStreamDestroy(stream);
  // Bytes read: the stored K and V (pages by the format's accounting, dense tail rows), q and out.
  double kv_bytes = 0, pages_read = 0, pages_stored = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const memory_stats m = kv.sequence_memory(seqs[b]);
    if constexpr (selects) {  // the pages the device chose (mean over KV heads), the tail, every span's bounds
      const auto pages = static_cast<std::int64_t>(kv.pages(seqs[b]).size());
      double read = 0;
      for (int h = 0; h < c.num_kv_heads; ++h)
        read += static_cast<double>(engine.selection().selected_pages(static_cast<std::int32_t>(b), h).size()) / c.num_kv_heads;
      const auto slot = static_cast<double>(engine.page_slot_bytes());  // stored_bytes counts the bounds
      kv_bytes += static_cast<double>(m.stored_bytes) - static_cast<double>(pages) * slot + read * slot;
      pages_read += read;
      pages_stored += static_cast<double>(pages);
    } else {
      kv_bytes += static_cast<double>(m.stored_bytes);
    }
  }
  if constexpr (selects) {
    state.counters["pages_read"] = pages_stored > 0 ? pages_read / pages_stored : 0.0;
    state.counters["block"] = selector_traits<Selector>::bounds_block_tokens(selector, c.page_size);
  }
  const double qo_bytes = 2.0 * static_cast<double>(q_count) * sizeof(float);
  report(state, times, kv_bytes + qo_bytes);
  state.counters["prefill_us_per_page"] = prefill_seconds * 1e6 / (context / c.page_size);
  if constexpr (is_quant2)
    state.counters["partition"] = static_cast<double>(state.range(4));
  else if constexpr (is_packed)
    state.counters["retained"] = static_cast<double>(state.range(4)) / 100.0;
  else
    state.counters["sparsity"] = static_cast<double>(state.range(4)) / 100.0;
  state.counters["plan_us"] = median(plan_times) * 1e6;
  state.counters["splits"] = kv.engine().last_step_splits();
  state.counters["batch"] = batch;
  state.counters["context"] = context;
  state.counters["group"] = c.group_size;
  state.counters["head_dim"] = c.head_dim;
}

/// The shape of record (8 KV heads, groups of 4, head_dim 128, pages of 64, bf16) for `sequences`
/// sequences of `context` tokens, with `spare_pages` pages more each.
cache_config record_shape(int sequences, int context, int spare_pages) {
  cache_config c;
  c.num_kv_heads = 8;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = 64;
  c.storage = dtype::bf16;
  c.max_sequences = sequences;
  c.max_pages = sequences * (context / c.page_size + spare_pages);
  return c;
}

/// Prefills `seq` with `context` tokens in chunks of `chunk` rows from `rows` (K rows, then V rows
/// chunk x row further): the values repeat per chunk, the pages they land in never do.
template <class Cache>
void prefill_repeated(Cache& kv, sequence_id seq, const bfloat16* rows, int chunk, int context) {
  const cache_config& c = kv.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  for (int done = 0; done < context; done += chunk) {
    const int n = std::min(chunk, context - done);
    kv.prefill(seq, tensor_view<const bfloat16, 3>(rows, n, c.num_kv_heads, c.head_dim),
               tensor_view<const bfloat16, 3>(rows + chunk * row, n, c.num_kv_heads, c.head_dim));
  }
}

/// select::snapkv's scoring on the device: `cache::window_votes` over one format::dense sequence
/// of `context` tokens (Hkv=8, head_dim 128, groups of 4, bf16, pages of 64) and a window of
/// `window` queries: the host staging, ceil(window / 8) decode steps of up to 8 copies of the
/// sequence writing their rows' logits, the two vote kernels and the copy of the votes back,
/// timed by CUDA events around the call after an L2 flush (it synchronizes: host time inside it
/// counts). Compare with dense_decode at batch 1 and the same context in the same run; bytes are
/// the sequence's K and V read once per window query.
void window_votes(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0)), window = static_cast<int>(state.range(1));
  const cache_config c = record_shape(1, context, 1);
  select::snapkv snap;
  snap.window = window;
  cuda_cache<format::dense, select::snapkv> kv(c, format::dense{}, snap);
  const sequence_id seq = kv.add_sequence();
  const int chunk = std::min(context, 16384);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kvmosaic::cuda::device_buffer source(2 * chunk * row * sizeof(bfloat16));
  fill_kernel<<<1024, 256>>>(source.as<bfloat16>(), 2 * chunk * row, 7u);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  prefill_repeated(kv, seq, source.as<const bfloat16>(), chunk, context);
  std::vector<float> queries(static_cast<std::size_t>(window) * c.num_q_heads() * c.head_dim);
  for (std::size_t i = 0; i < queries.size(); ++i) queries[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  const tensor_view<const float, 3> q(queries.data(), window, c.num_q_heads(), c.head_dim);
  (void)kv.window_votes(seq, q);  // warm-up: first launches, buffers
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  l2_flusher flusher;
  event_timer timer;
  std::vector<double> times;
  const cudaStream_t stream = kv.engine().stream();
  for (auto _ : state) {
    flusher.flush(stream);
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.start, stream));
    const std::vector<double> votes = kv.window_votes(seq, q);
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.stop, stream));
    const double seconds = timer.seconds();
    benchmark::DoNotOptimize(votes.data());
    times.push_back(seconds);
    state.SetIterationTime(seconds);
  }
  report(state, times, static_cast<double>(window) * static_cast<double>(kv.sequence_memory(seq).stored_bytes));
  state.counters["context"] = context;
  state.counters["window"] = window;
}

using kvmosaic::detail::policy_of;

/// A whole decode step of format::dense as an engine waits for it, host bookkeeping included:
/// plan, run, then the append of the next token, timed on the host clock from the plan to the end
/// of the stream's work, after an L2 flush. Batch x context; an evicting selector keeps a budget
/// of the context in tokens, so every append over it evicts one token per sequence (its ranking,
/// the copy back of the chosen slot, the host's position map), and compacts beyond the timed steps
/// (compaction is timed apart). `select::all`: the same step without scores or eviction, same run;
/// with `Masked`, the same after the caller evicted 40 tokens of each sequence (`cache::evict`,
/// no compaction): what reading around evicted rows costs (the live-row masks every step stages
/// and the split kernels apply), apart from any selector.
template <class Selector, bool Masked = false>
void decode_append_step(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), context = static_cast<int>(state.range(1));
  const cache_config c = record_shape(batch, context, 4);
  constexpr bool per_head = detail::is_per_kv_head<Selector>::value;  // select::per_kv_head<Policy>
  using Policy = typename policy_of<Selector>::type;
  Selector selector{};
  if constexpr (selector_traits<Policy>::evicts) {
    Policy& policy = policy_of<Selector>::get(selector);
    policy.budget.tokens = context;
    policy.compact_every = 1 << 30;
  }
  using compactor = std::conditional_t<Masked || selector_traits<Policy>::evicts, compact::hole_fill, compact::none>;
  cache<format::dense, Selector, compactor, backend_for<format::dense, Policy>> kv(c, format::dense{}, selector);
  const int chunk = std::min(context, 16384);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kvmosaic::cuda::device_buffer source(2 * chunk * row * sizeof(bfloat16));
  fill_kernel<<<1024, 256>>>(source.as<bfloat16>(), 2 * chunk * row, 7u);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  const bfloat16* rows = source.as<const bfloat16>();
  std::vector<sequence_id> seqs;
  for (int b = 0; b < batch; ++b) {
    seqs.push_back(kv.add_sequence());
    prefill_repeated(kv, seqs.back(), rows, chunk, context);
    if constexpr (Masked) {  // 40 tokens spread over the context, as 40 steps of TOVA would leave
      std::vector<std::int64_t> evicted;
      for (int i = 0; i < 40; ++i) evicted.push_back(64 + static_cast<std::int64_t>(i) * (context / 41));
      kv.evict(seqs.back(), span<const std::int64_t>(evicted.data(), static_cast<std::int64_t>(evicted.size())));
    }
  }
  const std::size_t q_count = static_cast<std::size_t>(batch) * c.num_q_heads() * c.head_dim;
  kvmosaic::cuda::device_buffer q(q_count * sizeof(float)), out(q_count * sizeof(float));
  std::vector<float> q_host(q_count);
  for (std::size_t i = 0; i < q_count; ++i) q_host[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(q.data(), q_host.data(), q_count * sizeof(float), cudaMemcpyHostToDevice));
  const span<const sequence_id> step_seqs(seqs.data(), batch);
  const tensor_view<const float, 3> step_q(q.as<const float>(), batch, c.num_q_heads(), c.head_dim);
  const tensor_view<float, 3> step_out(out.as<float>(), batch, c.num_q_heads(), c.head_dim);
  const tensor_view<const bfloat16, 3> next_k(rows, batch, c.num_kv_heads, c.head_dim);
  const tensor_view<const bfloat16, 3> next_v(rows + chunk * row, batch, c.num_kv_heads, c.head_dim);
  const cudaStream_t stream = kv.engine().stream();
  const auto step = [&] {
    kv.plan(step_seqs);
    kv.run(step_q, step_out);
    kv.append(step_seqs, next_k, next_v);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  for (int warm = 0; warm < 3; ++warm) step();  // first launches, the buffers' growth
  l2_flusher flusher;
  std::vector<double> times;
  for (auto _ : state) {
    flusher.flush(stream);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto start = std::chrono::steady_clock::now();
    step();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    times.push_back(seconds);
    state.SetIterationTime(seconds);
  }
  double bytes = 0;
  for (const sequence_id seq : seqs) bytes += static_cast<double>(kv.sequence_memory(seq).stored_bytes);
  report(state, times, bytes);
  state.counters["length"] = static_cast<double>(kv.length(seqs[0]));
  if constexpr (selector_traits<Policy>::evicts) {  // live sealed tokens of the first sequence (its head 0)
    std::vector<std::int64_t> positions;
    if constexpr (per_head) positions = kv.positions(seqs[0], 0);
    else positions = kv.positions(seqs[0]);
    state.counters["live_sealed"] = static_cast<double>(std::count_if(positions.begin(), positions.end(), [](std::int64_t p) { return p >= 0; }));
  }
}

}  // namespace

BENCHMARK(hbm_read)->Name("hbm_read")->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);
// The matrix of record: Hq=32, Hkv=8, head_dim 128, bf16.
BENCHMARK(decode<format::dense>)
    ->Name("dense_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
    ->ArgsProduct({{1, 8, 32}, {4096, 32768, 131072}, {4}, {128}, {0}})
    ->Args({1, 524288, 4, 128, 0})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// Other GQA groups and head sizes at batch 8, 32K.
BENCHMARK(decode<format::dense>)
    ->Name("dense_decode_shapes")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
    ->ArgsProduct({{8}, {32768}, {1, 8}, {128}, {0}})
    ->Args({8, 32768, 4, 64, 0})
    ->Args({8, 32768, 4, 256, 0})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// MUSTAFAR's bitmap_tiles at s_k = s_v = 0.5 and 0.7, the same matrix as dense.
BENCHMARK(decode<format::bitmap_tiles>)
    ->Name("bitmap_tiles_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
    ->ArgsProduct({{1, 8, 32}, {4096, 32768, 131072}, {4}, {128}, {50, 70}})
    ->Args({1, 524288, 4, 128, 50})
    ->Args({1, 524288, 4, 128, 70})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// HACK's quant2 at Pi = 64 over the same matrix, and Pi = 32 and 128 at batch 8.
BENCHMARK(decode<format::quant2>)
    ->Name("quant2_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
    ->ArgsProduct({{1, 8, 32}, {4096, 32768, 131072}, {4}, {128}, {64}})
    ->Args({1, 524288, 4, 128, 64})
    ->ArgsProduct({{8}, {32768, 131072}, {4}, {128}, {32, 128}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// MosaicKV's packed_bitmap at 25% of the channels retained (the paper's setting; 25% truncated,
// g = 1, 64K-token segments), select::all: batch 1 and 8, 32K and 128K. Its prefill plans each
// segment (its sums on the device, the eigendecompositions on the host; prefill_us_per_page
// counts it).
BENCHMARK(decode<format::packed_bitmap>)
    ->Name("packed_bitmap_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// The same with MosaicKV's strategy search (section 5.5) in slots of 25%: each segment and KV
// head picks its rate and g for K and V (loss threshold 0.05) from sums over the segment's rows
// that the device computes (prefill_us_per_page counts it).
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper_search>)
    ->Name("packed_bitmap_search_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// MosaicKV's pairing: select::mean_keys (blocks of 16) at budgets 1/16 and 1/8 over packed_bitmap
// at 25% retained, batch 1 and 8, 32K and 128K.
BENCHMARK(decode<format::packed_bitmap, select::mean_keys>)
    ->Name("packed_bitmap_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}, {16, 8}, {0}, {16}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// The same two at groups of 2 and 4 rotated channels a bitmap bit (MosaicKV's variable-granularity
// bitmap; the strategy search takes the largest g within its loss limit): a group's values are
// read by one load.
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper, 2>)
    ->Name("packed_bitmap_g2_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper, 4>)
    ->Name("packed_bitmap_g4_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::mean_keys, format_settings::paper, 4>)
    ->Name("packed_bitmap_g4_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}, {16, 8}, {0}, {16}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// Pages of 16 tokens, so that a mean_keys block of 16 is a whole page (the split kernel copies
// only the chosen blocks, four pages a slot): the same selections as the rows above at
// page 64, block 16, and select::all on the same pages.
BENCHMARK(decode<format::packed_bitmap, select::mean_keys>)
    ->Name("packed_bitmap_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}, {16, 8}, {16}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::mean_keys, format_settings::paper, 4>)
    ->Name("packed_bitmap_g4_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}, {16, 8}, {16}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper, 1, 16>)
    ->Name("packed_bitmap_page16_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper, 4, 16>)
    ->Name("packed_bitmap_g4_page16_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// Batch 32 at 128K, the dense rows' largest: how the ratios move when the selection's and the
// split kernel's fixed costs (launches, round trips, per-split opens and closes) are spread over
// four times the work of batch 8. g = 4 (the kernel's fastest) and g = 1 (the real model's).
BENCHMARK(decode<format::packed_bitmap, select::mean_keys, format_settings::paper, 4>)
    ->Name("packed_bitmap_g4_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->Args({32, 131072, 4, 128, 25, 16, 16, 0})
    ->Args({32, 131072, 4, 128, 25, 8, 16, 0})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::mean_keys>)
    ->Name("packed_bitmap_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse", "page", "block"})
    ->Args({32, 131072, 4, 128, 25, 16, 16, 0})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap, select::all, format_settings::paper, 4>)
    ->Name("packed_bitmap_g4_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->Args({32, 131072, 4, 128, 25})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::packed_bitmap>)
    ->Name("packed_bitmap_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained"})
    ->Args({32, 131072, 4, 128, 25})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// 4-bit codes (quant4) at Pi = 32, 64 and 128, V per channel (the paper's axis) and V per token
// (KIVI's), batch 1 and 8, 32K and 128K, the paper's settings as the quant2 rows.
BENCHMARK(decode<format::quant4>)
    ->Name("quant4_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {32, 64, 128}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant<4, format::value_axis::head_dim>>)
    ->Name("quant4_vtoken_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {32, 64, 128}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant<2, format::value_axis::head_dim>>)
    ->Name("quant2_vtoken_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
    ->ArgsProduct({{8}, {32768, 131072}, {4}, {128}, {64}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// The library's defaults (4 sink tokens; quant2 rounding to nearest) against the rows above at
// batch 8: what the exact sinks cost a step.
BENCHMARK(decode<format::bitmap_tiles, select::all, format_settings::library>)
    ->Name("bitmap_tiles_defaults_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {50, 70}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant2, select::all, format_settings::library>)
    ->Name("quant2_defaults_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);

// select::quest (one block per page, pages of 64 but where "page" says) at budgets 1/16 and 1/8 over dense, bitmap_tiles (s = 0.7)
// and quant2 (Pi = 64): contexts 32K and 128K, batch 1 and 8.
BENCHMARK(decode<format::dense, select::quest>)
    ->Name("dense_quest_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {16, 8}, {0}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// Quest's own page size: pages (= blocks) of 16 tokens, dense, batch 8, 128K.
BENCHMARK(decode<format::dense, select::quest>)
    ->Name("dense_quest_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->Args({8, 131072, 4, 128, 0, 16, 16, 0})
    ->Args({8, 131072, 4, 128, 0, 8, 16, 0})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// Token-granular selections over dense pages of 64 (the split kernels read row masks): Quest
// blocks of 16 tokens, and sentence chunks (L = 14, Delta = 8) on the synthetic token stream.
BENCHMARK(decode<format::dense, select::quest>)
    ->Name("dense_quest_blocks_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {16, 8}, {0}, {16}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// select::mean_keys (MosaicKV's stage 2: blocks scored by q . mean key) at the same budgets, over
// whole pages and over blocks of 16 (the paper's), dense and quant2: against the quest rows above.
BENCHMARK(decode<format::dense, select::mean_keys>)
    ->Name("dense_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {16, 8}, {0}, {0, 16}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant2, select::mean_keys>)
    ->Name("quant2_mean_keys_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}, {16, 8}, {0}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::dense, select::sentence_chunks>)
    ->Name("dense_chunks_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {16, 8}, {0}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::bitmap_tiles, select::quest>)
    ->Name("bitmap_tiles_quest_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {70}, {16, 8}, {0}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant2, select::quest>)
    ->Name("quant2_quest_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition", "budget_inverse", "page", "block"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}, {16, 8}, {0}, {0}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// select::streaming (4 sinks and a recent window within a budget of 1/8 or 1/4 of the context,
// evicted as the prefill is sealed and compacted by hole filling): a step reads the live tokens
// only, through live-row masks. Against dense_decode at the same logical context, in the same run.
BENCHMARK(decode<format::dense, select::streaming>)
    ->Name("dense_streaming_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {8, 4}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::quant2, select::streaming>)
    ->Name("quant2_streaming_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}, {8}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// Steps that compute token scores on the device (select::tova, select::h2o: the split kernels
// write their rows' logits, a score kernel normalizes them after the merge and files them by
// position) with a budget of the whole context, so no token is evicted and every step reads what
// dense_decode reads: the cost of the scores alone, against dense_decode in the same run.
BENCHMARK(decode<format::dense, select::tova>)
    ->Name("dense_tova_scores_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {0}, {1}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode<format::dense, select::h2o>)
    ->Name("dense_h2o_scores_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {131072}, {4}, {128}, {0}, {1}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// The same over bitmap_tiles at 70% sparsity, against bitmap_tiles_decode.
BENCHMARK(decode<format::bitmap_tiles, select::tova>)
    ->Name("bitmap_tiles_tova_scores_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "sparsity", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {70}, {1}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// The same over quant2 (HACK's logits from its int8 kernel), against quant2_decode.
BENCHMARK(decode<format::quant2, select::tova>)
    ->Name("quant2_tova_scores_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "partition", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {64}, {1}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// The same over packed_bitmap at 25% retained (its logits in each segment's rotated space),
// against packed_bitmap_decode.
BENCHMARK(decode<format::packed_bitmap, select::tova>)
    ->Name("packed_bitmap_tova_scores_decode")
    ->ArgNames({"batch", "context", "group", "head_dim", "retained", "budget_inverse"})
    ->ArgsProduct({{1, 8}, {32768, 131072}, {4}, {128}, {25}, {1}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// Whole decode steps with the next token's append, on the host clock: TOVA and H2O at a budget of
// the context (each append evicts a token per sequence, ranked on the device) against the same
// step of select::all, with and without 40 evicted rows per sequence to read around.
BENCHMARK(decode_append_step<select::all>)
    ->Name("dense_decode_append_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{1, 8}, {32768, 131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode_append_step<select::all, true>)
    ->Name("dense_masked_append_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{1, 8}, {32768, 131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode_append_step<select::tova>)
    ->Name("dense_tova_evict_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{1, 8}, {32768, 131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode_append_step<select::h2o>)
    ->Name("dense_h2o_evict_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{8}, {131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// The same TOVA step with one decision per KV head (select::per_kv_head): each head's tokens are
// a one-head sequence of their own, batch x 8 of them per step.
BENCHMARK(decode_append_step<select::per_kv_head<select::tova>>)
    ->Name("dense_tova_per_head_evict_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{1, 8}, {32768, 131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(decode_append_step<select::per_kv_head<select::h2o>>)
    ->Name("dense_h2o_per_head_evict_step")
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{8}, {131072}})
    ->UseManualTime()
    ->Iterations(30)
    ->Unit(benchmark::kMicrosecond);
// select::snapkv's snapshot scoring on the device (cache::window_votes), window 32 (SnapKV's).
BENCHMARK(window_votes)
    ->Name("dense_snapkv_window_votes")
    ->ArgNames({"context", "window"})
    ->ArgsProduct({{32768, 131072}, {32}})
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
