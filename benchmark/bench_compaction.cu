// SPDX-License-Identifier: Apache-2.0
// Compaction passes on the CUDA backend (Google Benchmark, manual timing with CUDA events, L2
// flushed before every timed pass). Every run first measures the device's copy bandwidth
// (`copy_bandwidth`: cudaMemcpyAsync device to device of 1 GiB, bytes read plus bytes written),
// so each pass is also reported as a fraction of it.
//
// A pass: one sequence of `context` tokens (Hkv = 8, head_dim 128, bf16, pages of 64; quant2 at
// Pi = 64, bitmap_tiles at s_k = s_v = 0.5), `evicted` percent of its sealed tokens evicted at
// random, then `cache::compact` with the cache's compactor. The pass's device part (the metadata
// copy, unpack, gather, encode or copy back) is captured in a CUDA graph and replayed: a replay
// does the same reads and writes as the pass (the data it moves differs after the first, which
// does not change its cost). A second sequence with the same evictions, compacted first without
// capture, sizes the engine's scratch arenas.
//
// Counters (decimal units): time_us (median pass), pages_freed, slot_copies, pages_written,
// pages_unpacked (encoded formats: the pages the written ones read from), moved_bytes (the
// tokens moved, read and written at the format's bytes per token), bytes (what the pass's
// kernels read and write: the pages unpacked, the dense rows gathered, the pages encoded or
// copied back), GBps = bytes / time, fraction_of_copy = GBps / copy_bandwidth's GBps.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kvmosaic/kvmosaic.cuh"
#include "timing.cuh"

namespace {

using namespace kvmosaic;
using namespace kvmosaic_bench;

double g_copy_gbps = 0;  // measured by the first benchmark of the run

void copy_bandwidth(benchmark::State& state) {
  const std::size_t bytes = std::size_t{1} << 30;
  kvmosaic::cuda::device_buffer from(bytes), to(bytes);
  KVMOSAIC_CUDA_CHECK(cudaMemset(from.data(), 1, bytes));
  KVMOSAIC_CUDA_CHECK(cudaMemset(to.data(), 0, bytes));
  event_timer timer;
  std::vector<double> times;
  for (auto _ : state) {
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.start));
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), bytes, cudaMemcpyDeviceToDevice));
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.stop));
    const double s = timer.seconds();
    times.push_back(s);
    state.SetIterationTime(s);
  }
  const double t = median(times);
  g_copy_gbps = 2.0 * static_cast<double>(bytes) / t / 1e9;
  state.counters["time_us"] = t * 1e6;
  state.counters["bytes"] = 2.0 * static_cast<double>(bytes);
  state.counters["GBps"] = g_copy_gbps;
  state.counters["fraction_of_copy"] = 1.0;
}

template <class Format>
Format bench_format() {
  Format f{};
  if constexpr (std::is_same<Format, format::bitmap_tiles>::value) f.s_k = f.s_v = 0.5f;
  if constexpr (std::is_same<Format, format::quant2>::value) {
    f.partition = 64;
    f.mode = format::rounding::stochastic;  // the paper's settings, as these rows have always measured
  }
  if constexpr (!std::is_same<Format, format::dense>::value) f.sink_tokens = 0;
  return f;
}

template <class Format, class Compactor>
void compaction(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  const double evicted = static_cast<double>(state.range(1)) / 100.0;
  cache_config c;
  c.num_kv_heads = 8;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = 64;
  c.storage = dtype::bf16;
  c.max_sequences = 2;
  c.max_pages = 2 * (context / c.page_size + 1);
  cache<Format, select::all, Compactor, backend::cuda> kv(c, bench_format<Format>());

  const int chunk = std::min(context, 16384);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kvmosaic::cuda::device_buffer source(2 * chunk * row * sizeof(bfloat16));
  fill_kernel<<<1024, 256>>>(source.as<bfloat16>(), 2 * chunk * row, 7u);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  std::vector<std::int64_t> dead;
  std::mt19937_64 rng(5);
  const std::int64_t sealed = static_cast<std::int64_t>(context) / c.page_size * c.page_size;
  for (std::int64_t t = 0; t < sealed; ++t)
    if (std::bernoulli_distribution(evicted)(rng)) dead.push_back(t);
  const span<const std::int64_t> positions(dead.data(), static_cast<std::int64_t>(dead.size()));
  sequence_id seqs[2];
  for (sequence_id& seq : seqs) {
    seq = kv.add_sequence();
    for (int done = 0; done < context; done += chunk) {
      const int n = std::min(chunk, context - done);
      const bfloat16* k = source.as<const bfloat16>();
      kv.prefill(seq, tensor_view<const bfloat16, 3>(k, n, c.num_kv_heads, c.head_dim),
                 tensor_view<const bfloat16, 3>(k + chunk * row, n, c.num_kv_heads, c.head_dim));
    }
    kv.evict(seq, positions);
  }
  kv.compact(seqs[0]);  // sizes the arenas, so the captured pass allocates nothing
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());

  auto& engine = kv.engine();
  cudaStream_t stream;
  KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream));
  engine.set_stream(stream);
  cudaGraph_t graph;
  cudaGraphExec_t pass;
  KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  const compaction_report report = kv.compact(seqs[1]);
  KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&pass, graph, 0));
  const auto pages = engine.staged_moves();
  l2_flusher flusher;
  event_timer timer;
  std::vector<double> times;
  KVMOSAIC_CUDA_CHECK(cudaGraphLaunch(pass, stream));  // warm-up
  KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto _ : state) {
    const double s = timed_replay(pass, stream, flusher, timer);
    times.push_back(s);
    state.SetIterationTime(s);
  }
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  cudaGraphExecDestroy(pass);
  cudaGraphDestroy(graph);
  engine.set_stream(nullptr);
  cudaStreamDestroy(stream);

  const double slot = static_cast<double>(engine.page_slot_bytes());            // a page as stored
  const double rows = static_cast<double>(engine.geometry().tail_slot_bytes());  // a page as dense rows
  const bool encoded = kvmosaic::cuda::device_format<Format>::encodes_pages;
  const double written = static_cast<double>(pages.written), unpacked = static_cast<double>(pages.unpacked);
  // Encoded: unpack (read stored, write rows), gather (read rows, write rows), encode (read rows,
  // write stored). Dense: gather from the pages, copy back.
  const double bytes = encoded ? unpacked * (slot + rows) + written * 2 * rows + written * (rows + slot) : written * 4 * rows;
  const double t = median(times);
  state.counters["time_us"] = t * 1e6;
  state.counters["pages_freed"] = report.pages_freed;
  state.counters["slot_copies"] = static_cast<double>(report.slot_copies);
  state.counters["pages_written"] = written;
  state.counters["pages_unpacked"] = unpacked;
  state.counters["moved_bytes"] = 2.0 * static_cast<double>(report.slot_copies) * slot / c.page_size;
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = bytes / t / 1e9;
  if (g_copy_gbps > 0) state.counters["fraction_of_copy"] = bytes / t / 1e9 / g_copy_gbps;
  state.counters["context"] = context;
  state.counters["evicted"] = evicted;
}

}  // namespace

BENCHMARK(copy_bandwidth)->Name("copy_bandwidth")->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);
BENCHMARK(compaction<format::dense, compact::repack>)
    ->Name("dense_repack")
    ->ArgNames({"context", "evicted_percent"})
    ->ArgsProduct({{32768, 131072}, {50, 90}})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(compaction<format::dense, compact::hole_fill>)
    ->Name("dense_hole_fill")
    ->ArgNames({"context", "evicted_percent"})
    ->ArgsProduct({{32768, 131072}, {50, 90}})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(compaction<format::bitmap_tiles, compact::repack>)
    ->Name("bitmap_tiles_repack")
    ->ArgNames({"context", "evicted_percent"})
    ->ArgsProduct({{32768, 131072}, {50, 90}})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(compaction<format::quant2, compact::repack>)
    ->Name("quant2_repack")
    ->ArgNames({"context", "evicted_percent"})
    ->ArgsProduct({{32768, 131072}, {50, 90}})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(compaction<format::quant2, compact::hole_fill>)
    ->Name("quant2_hole_fill")
    ->ArgNames({"context", "evicted_percent"})
    ->ArgsProduct({{32768, 131072}, {50, 90}})
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
