// SPDX-License-Identifier: Apache-2.0
// format::bitmap_tiles on the CUDA backend against the host backend and the fp64 oracle on the
// pruned cache: the device encoder writes the host's bytes exactly (prefill chunks and pages that
// appends complete), and the fused sparse decode (sm_90 pipeline and the portable kernel) equals
// exact attention on the pruned cache on ragged batches, every shape, long contexts and graphs.

#include "reliability.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;
using test::small_config;
using twin = test::twin<format::bitmap_tiles>;

TEST_CASE("GPU bitmap_tiles: device encode writes the host's bytes and decode equals fp64 on the pruned cache",
          "[gpu][bitmap_tiles]") {
  if (!gpu_available()) return;
  const int head_dim = GENERATE(64, 128, 256);
  const int group_size = GENERATE(1, 3, 8);
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  const int page_size = GENERATE(64, 128);
  const auto sparsity = GENERATE(std::pair<float, float>{0.0f, 0.5f}, std::pair<float, float>{0.7f, 0.7f});
  const float s_k = sparsity.first, s_v = sparsity.second;
  const bool portable = GENERATE(false, true);
  CAPTURE(head_dim, group_size, to_string(storage), page_size, s_k, s_v, portable);
  twin t(small_config(head_dim, group_size, storage, page_size), 13, format::bitmap_tiles{s_k, s_v});
  if (portable) t.device.engine().use_portable_kernel();
  for (int length : {1, 7, page_size - 1, page_size, page_size + 1, 3 * page_size + 3, 700}) t.add(length, t.seqs.size());
  t.check_storage();
  t.check_attention();
  for (int step = 0; step < 3; ++step) t.append_step();  // completes pages from the tail
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU bitmap_tiles with K tiled along channels: host bytes, fp64 on the pruned cache",
          "[gpu][bitmap_tiles]") {
  if (!gpu_available()) return;
  const int head_dim = GENERATE(64, 128, 256);
  const int group_size = GENERATE(1, 8);
  const int page_size = GENERATE(64, 128);
  const auto sparsity = GENERATE(std::pair<float, float>{0.0f, 0.5f}, std::pair<float, float>{0.7f, 0.7f});
  const bool portable = GENERATE(false, true);
  CAPTURE(head_dim, group_size, page_size, sparsity.first, sparsity.second, portable);
  twin t(small_config(head_dim, group_size, dtype::bf16, page_size), 29,
         format::bitmap_tiles{sparsity.first, sparsity.second, format::bitmap_k_layout::along_channels});
  if (portable) t.device.engine().use_portable_kernel();
  for (int length : {1, page_size, page_size + 1, 3 * page_size + 3, 700}) t.add(length, t.seqs.size());
  t.check_storage();
  t.check_attention();
  for (int step = 0; step < 3; ++step) t.append_step();
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU bitmap_tiles on small cases (compute-sanitizer)", "[gpu][bitmap_tiles][sanitize]") {
  if (!gpu_available()) return;
  const bool portable = GENERATE(false, true);
  const auto k_layout = GENERATE(format::bitmap_k_layout::along_channels, format::bitmap_k_layout::along_tokens);
  twin t(small_config(128, 4, dtype::bf16, 64), 3, format::bitmap_tiles{0.7f, 0.5f, k_layout});
  if (portable) t.device.engine().use_portable_kernel();
  t.add(1, 0);
  t.add(64, 1);
  t.add(200, 2);
  t.check_storage();
  t.check_attention();
  t.append_step();
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU bitmap_tiles at 128K context, batch 1: prefill in encode chunks, split and merged",
          "[gpu][bitmap_tiles][long]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 4, dtype::bf16, 64);
  c.num_kv_heads = 1;
  c.max_pages = 2100;
  twin t(c, 5, format::bitmap_tiles{0.7f, 0.7f});
  t.add(131072 + 5, 0);
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU bitmap_tiles with batch 64 of ragged sequences", "[gpu][bitmap_tiles]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 8, dtype::f16, 64);
  c.max_sequences = 64;
  c.max_pages = 64 * 10;
  twin t(c, 9, format::bitmap_tiles{0.5f, 0.5f});
  for (int b = 0; b < 64; ++b) t.add(1 + (b * 37) % 500, static_cast<std::uint64_t>(b));
  t.check_attention();
  for (int step = 0; step < 70; ++step) t.append_step();  // every sequence completes a page
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU bitmap_tiles with output-aware K weights: the device prunes as the host does",
          "[gpu][bitmap_tiles]") {
  if (!gpu_available()) return;
  const int head_dim = GENERATE(64, 128);
  CAPTURE(head_dim);
  cache_config c = small_config(head_dim, 4, dtype::bf16, 64);
  twin t(c, 17, format::bitmap_tiles{0.7f, 0.5f});
  // Weights from a window of 32 generated queries, as MUSTAFAR does (many ties broken by channel
  // when weights repeat: every fourth channel gets the same weight).
  std::vector<float> window;
  for (int step = 0; step < 32; ++step) {
    const auto q = synthetic::generate_query(t.generator, 99, step);
    window.insert(window.end(), q.begin(), q.end());
  }
  t.key_weights = output_aware_key_weights(
      tensor_view<const float, 3>(window.data(), 32, c.num_q_heads(), head_dim), c.group_size);
  for (std::size_t i = 0; i < t.key_weights.size(); i += 4) t.key_weights[i] = t.key_weights[0];
  for (int length : {63, 64, 300}) t.add(length, t.seqs.size());
  t.check_storage();
  t.check_attention();
  for (int step = 0; step < 2; ++step) t.append_step();
  t.check_storage();
  t.check_attention();
}

// --- Reliability (test/gpu/reliability.hpp) -----------------------------------------------------

TEST_CASE("GPU bitmap_tiles: chunked prefills equal one prefill; all or nothing under CUDA errors; "
          "key weights end with their sequence",
          "[gpu][bitmap_tiles][reliability][faults]") {
  if (!gpu_available()) return;
  test::reliability::check_chunked_prefill<format::bitmap_tiles>({0, 1, 31, 63});
  test::reliability::check_every_operation_all_or_nothing<format::bitmap_tiles, select::all>();
  test::reliability::check_key_weights_end_with_sequence();
}
