// SPDX-License-Identifier: Apache-2.0
// The demo's CUDA rows: the same workload on the CUDA backend, timed with CUDA events. Built into
// kvmosaic_demo when CUDA is enabled; returns no rows on a machine without a GPU.

#include <cuda_runtime.h>

#include "demo_common.hpp"
#include "kvmosaic/kvmosaic.cuh"

namespace demo {

/// The kernel shapes the demo's CUDA rows compile, as an engine lists its model's: the default
/// (bf16, head_dim 128, groups of 4), f16, and groups of 1 and 8. `backend::cuda` would compile all
/// 48 supported shapes for every cache type below, and the demo's build time with them; another
/// `--storage/--head-dim/--q-heads` runs on the host backend.
using demo_backend = kvmosaic::backend::cuda_for<
    kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>, kvmosaic::kernel_shape<kvmosaic::dtype::f16, 128, 4>,
    kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 1>, kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 8>>;

std::vector<row> run_cuda(const workload& w, int steps) {
  using namespace kvmosaic;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    std::fprintf(stderr, "  no CUDA device: running the host backend\n");
    return {};
  }
  if (!kvmosaic::cuda::compiles_shape<demo_backend>(w.config.storage, w.config.head_dim, w.config.group_size)) {
    std::fprintf(stderr, "  the demo's CUDA build holds the shapes %s (storage/head_dim/group) only: running the host backend\n",
                 kvmosaic::cuda::compiled_shapes<demo_backend>().c_str());
    return {};
  }
  std::vector<row> rows;
  // Device copies of the inputs, shared by every configuration.
  std::vector<kvmosaic::cuda::device_buffer> k, v;
  for (const auto& kv : w.kv) {
    k.emplace_back(kv.k.size() * sizeof(float));
    v.emplace_back(kv.v.size() * sizeof(float));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(k.back().data(), kv.k.data(), kv.k.size() * sizeof(float), cudaMemcpyHostToDevice));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(v.back().data(), kv.v.data(), kv.v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  kvmosaic::cuda::device_buffer q(w.q.size() * sizeof(float)), out(w.q.size() * sizeof(float));
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(q.data(), w.q.data(), w.q.size() * sizeof(float), cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  KVMOSAIC_CUDA_CHECK(cudaEventCreate(&start));
  KVMOSAIC_CUDA_CHECK(cudaEventCreate(&stop));
  const auto rows_of = [&](int b) {
    return std::make_pair(k[static_cast<std::size_t>(b)].as<const float>(), v[static_cast<std::size_t>(b)].as<const float>());
  };
  const auto timed = [&](auto&& step) {
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(start));
    step(q.as<const float>(), out.as<float>());
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(stop));
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KVMOSAIC_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return 1e3 * static_cast<double>(ms);
  };
  const auto read_out = [&] {
    std::vector<float> host(w.q.size());
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(host.data(), out.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  };
  {
    cache<format::dense, select::all, compact::none, demo_backend> c(w.config);
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
  }
  for (const float sparsity : {0.5f, 0.7f}) {  // MUSTAFAR, encoded and attended on the device
    cache<format::bitmap_tiles, select::all, compact::none, demo_backend> c(w.config, mustafar(sparsity));
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
  }
  for (const auto& [config, format] : quant2_variants(w.config, w.generator.seed)) {  // HACK, codes attended on the device
    cache<format::quant2, select::all, compact::none, demo_backend> c(config, format);
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
  }
  if (cache_config config; quant4_config(w.config, config)) {  // 4-bit codes, V per channel and per token
    cache<format::quant4, select::all, compact::none, demo_backend> c(config);
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
    cache<format::quant<4, format::value_axis::head_dim>, select::all, compact::none, demo_backend> per_token(config);
    rows.push_back(run(per_token, w, steps, rows_of, timed, read_out));
  }
  for (const auto& selector : quest_variants()) {  // Quest: pages (or blocks) scored and chosen on the device
    cache<format::dense, select::quest, compact::none, demo_backend> c(w.config, {}, selector);
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
  }
  for (const auto& selector : sentence_chunk_variants()) {  // chunks cut on the host, bounded and chosen on the device
    cache<format::dense, select::sentence_chunks, compact::none, demo_backend> c(w.config, {}, selector);
    rows.push_back(run(c, w, steps, rows_of, timed, read_out));
  }
  // StreamingLLM: evicted as the prefill is sealed, compacted on the device.
  for_each_streaming_cache<demo_backend>(w.config, w.generator.seed,
                                         [&](auto& c) { rows.push_back(run(c, w, steps, rows_of, timed, read_out)); });
  // TOVA, H2O (scored by the split kernels) and SnapKV (voted by them), evicted and compacted on the device.
  for_each_scored_eviction_cache<demo_backend>(w.config, [&](auto& c) { rows.push_back(run(c, w, steps, rows_of, timed, read_out)); });
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return rows;
}

}  // namespace demo
