// SPDX-License-Identifier: Apache-2.0
// kvmosaic demo: build a realistic synthetic KV cache, run decode attention through the library on
// the best backend available, and report, per cache configuration, the bytes it stores and how
// close its attention is to exact fp64 attention.
//
//   kvmosaic_demo [--kv-heads 8] [--q-heads 32] [--head-dim 128] [--context 32768] [--batch 1]
//                 [--page-size 64] [--dtype bf16] [--steps 5] [--seed N] [--json FILE]

#include <algorithm>

#include "demo_common.hpp"

int main(int argc, char** argv) {
  using namespace kvmosaic;
  const demo::options o = demo::parse(argc, argv);
  try {
    const demo::workload w = demo::make_workload(o);
    // The best backend available: CUDA when the demo was built with it and a GPU is present.
    std::vector<demo::row> rows = demo::run_cuda(w, o.steps);
    if (rows.empty()) {
      cache<format::dense, select::all, compact::none, backend::host> c(w.config);
      rows.push_back(demo::run_host(c, w, o.steps));
      for (const float sparsity : {0.5f, 0.7f}) {
        cache<format::bitmap_tiles> sparse(w.config, demo::mustafar(sparsity));
        rows.push_back(demo::run_host(sparse, w, o.steps));
      }
      for (const auto& [config, format] : demo::quant2_variants(w.config, o.seed)) {
        cache<format::quant2> c(config, format);
        rows.push_back(demo::run_host(c, w, o.steps));
      }
      if (cache_config config; demo::quant4_config(w.config, config)) {
        cache<format::quant4> c(config);
        rows.push_back(demo::run_host(c, w, o.steps));
        cache<format::quant<4, format::value_axis::head_dim>> per_token(config);
        rows.push_back(demo::run_host(per_token, w, o.steps));
      }
      for (const auto& selector : demo::quest_variants()) {
        cache<format::dense, select::quest> c(w.config, {}, selector);
        rows.push_back(demo::run_host(c, w, o.steps));
      }
      for (const auto& selector : demo::sentence_chunk_variants()) {
        cache<format::dense, select::sentence_chunks> c(w.config, {}, selector);
        rows.push_back(demo::run_host(c, w, o.steps));
      }
      for (const auto& selector : demo::mean_keys_variants()) {
        cache<format::dense, select::mean_keys> c(w.config, {}, selector);
        rows.push_back(demo::run_host(c, w, o.steps));
      }
      demo::for_each_streaming_cache<backend::host>(w.config, o.seed, [&](auto& c) { rows.push_back(demo::run_host(c, w, o.steps)); });
      demo::for_each_scored_eviction_cache<backend::host>(w.config, [&](auto& c) { rows.push_back(demo::run_host(c, w, o.steps)); });
    }
    // MosaicKV's packed format runs on the host backend in either build (the demo's CUDA build
    // would compile its kernels for every shape: docs/packed_bitmap.md), with every token and with
    // mean keys (its block keys) at 1/16.
    if (format::packed_bitmap packed; demo::mosaic(w.config, packed)) {
      cache<format::packed_bitmap> c(w.config, packed);
      rows.push_back(demo::run_host(c, w, o.steps));
      cache<format::packed_bitmap, select::mean_keys> selected(w.config, packed, demo::mean_keys_variants().front());
      rows.push_back(demo::run_host(selected, w, o.steps));
    }
    demo::print_table(rows, o);
    if (!o.json.empty()) {
      demo::write_json(rows, o.json);
      std::printf("wrote %s\n", o.json.c_str());
    }
  } catch (const kvmosaic::error& e) {
    std::fprintf(stderr, "\n%s\n", e.what());
    return 1;
  }
  return 0;
}

#if !defined(KVMOSAIC_DEMO_WITH_CUDA)
// Built without CUDA: no CUDA rows, the host backend runs everything.
std::vector<demo::row> demo::run_cuda(const workload&, int) { return {}; }
#endif
