// SPDX-License-Identifier: Apache-2.0
// format::bitmap_tiles (MUSTAFAR) on the host: pruning keeps exactly the largest magnitudes,
// decode(encode(x)) is the pruned x, attention equals exact attention on the pruned cache, s = 0
// is dense, the byte accounting, and bad parameters.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../support/oracle.hpp"
#include "../support/prune.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

page_shape shape_of(int page_size, int head_dim, dtype storage = dtype::bf16) {
  return page_shape{page_size, head_dim, storage};
}

/// Rows [n][d] rounded to the storage dtype, from the generator's K (or V) of one head.
std::vector<float> stored_rows(const synthetic::kv_data& kv, int head, bool v, dtype storage) {
  std::vector<float> rows;
  for (int t = 0; t < kv.num_tokens; ++t)
    for (int c = 0; c < kv.head_dim; ++c) {
      const float x = (v ? kv.v : kv.k)[(static_cast<std::size_t>(t) * kv.num_kv_heads + head) * kv.head_dim + c];
      rows.push_back(storage == dtype::f16 ? to_float(half(x)) : to_float(bfloat16(x)));
    }
  return rows;
}

}  // namespace

TEST_CASE("bitmap_tiles: decode(encode(x)) is x pruned to its largest magnitudes per token", "[bitmap_tiles]") {
  const int head_dim = GENERATE(64, 128, 256);
  const float sparsity = GENERATE(0.0f, 0.3f, 0.5f, 0.7f, 0.95f);
  const int page_size = GENERATE(64, 128);
  const bool is_v = GENERATE(false, true);
  const auto k_layout = GENERATE(format::bitmap_k_layout::along_tokens, format::bitmap_k_layout::along_channels);
  CAPTURE(head_dim, sparsity, page_size, is_v, static_cast<int>(k_layout));
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 1;
  cfg.head_dim = head_dim;
  const auto kv = synthetic::generate_kv(cfg, 3, page_size);
  const std::vector<float> rows = stored_rows(kv, 0, is_v, dtype::bf16);
  const format::bitmap_tiles f{sparsity, sparsity, k_layout};
  const page_shape shape = shape_of(page_size, head_dim);
  using traits = format_traits<format::bitmap_tiles>;
  std::vector<std::byte> page(is_v ? traits::v_page_bytes(f, shape) : traits::k_page_bytes(f, shape));
  std::vector<float> decoded(rows.size());
  if (is_v) {
    traits::encode_v(f, shape, rows.data(), page.data());
    traits::decode_v(f, shape, page.data(), page_size, decoded.data());
  } else {
    traits::encode_k(f, shape, rows.data(), page.data());
    traits::decode_k(f, shape, page.data(), page_size, decoded.data());
  }
  REQUIRE(decoded == test::reference_prune(rows, head_dim, sparsity));
  // exactly D - round(sD) survivors per token (the generator has no exact zeros)
  const int keep = head_dim - static_cast<int>(std::lround(static_cast<double>(sparsity) * head_dim));
  for (int t = 0; t < page_size; ++t)
    CHECK(std::count_if(decoded.begin() + t * head_dim, decoded.begin() + (t + 1) * head_dim,
                        [](float x) { return x != 0.0f; }) == keep);
}

TEST_CASE("bitmap_tiles: K tiles along tokens (the paper's) or along channels, hand-computed bytes", "[bitmap_tiles]") {
  // head_dim 64, a page of 64 tokens, s = 0.5: every token keeps 32 channels; token t has 2 at
  // channels 0..31 and 1 elsewhere, so channels 0..31 are kept for every token.
  const page_shape shape = shape_of(64, 64);
  std::vector<float> rows(64 * 64);
  for (int t = 0; t < 64; ++t)
    for (int c = 0; c < 64; ++c) rows[static_cast<std::size_t>(t) * 64 + c] = c < 32 ? 2.0f : 1.0f;
  using traits = format_traits<format::bitmap_tiles>;
  for (const auto layout : {format::bitmap_k_layout::along_tokens, format::bitmap_k_layout::along_channels}) {
    const format::bitmap_tiles f{0.5f, 0.5f, layout};
    std::vector<std::byte> page(traits::k_page_bytes(f, shape));
    CHECK(page.size() == 64 * 12 + 64 * 32 * 2);  // the same bytes in either layout
    traits::encode_k(f, shape, rows.data(), page.data());
    std::vector<std::uint64_t> bitmaps(64);
    std::vector<std::uint32_t> offsets(64);
    std::memcpy(bitmaps.data(), page.data(), 64 * 8);
    std::memcpy(offsets.data(), page.data() + 64 * 8, 64 * 4);
    for (int tile = 0; tile < 64; ++tile) {
      CAPTURE(static_cast<int>(layout), tile);
      if (layout == format::bitmap_k_layout::along_tokens) {  // tile = channel: all 64 tokens or none
        CHECK(bitmaps[static_cast<std::size_t>(tile)] == (tile < 32 ? ~std::uint64_t{0} : 0));
        CHECK(offsets[static_cast<std::size_t>(tile)] == static_cast<std::uint32_t>(std::min(tile, 32) * 64));
      } else {  // tile = token: channels 0..31
        CHECK(bitmaps[static_cast<std::size_t>(tile)] == 0xffffffffull);
        CHECK(offsets[static_cast<std::size_t>(tile)] == static_cast<std::uint32_t>(tile * 32));
      }
    }
    std::vector<float> decoded(rows.size());
    traits::decode_k(f, shape, page.data(), 64, decoded.data());
    for (std::size_t i = 0; i < rows.size(); ++i) REQUIRE(decoded[i] == (i % 64 < 32 ? 2.0f : 0.0f));
  }
  CHECK(traits::describe(format::bitmap_tiles{0.5f, 0.7f, format::bitmap_k_layout::along_tokens}) ==
        "bitmap_tiles(k0.5,v0.7,k/tokens)");
  CHECK(traits::describe(format::bitmap_tiles{0.5f, 0.7f}) == "bitmap_tiles(k0.5,v0.7)");
  CHECK(format::bitmap_tiles{}.k_layout == format::bitmap_k_layout::along_channels);
}

TEST_CASE("bitmap_tiles: ties in magnitude keep the lower channel", "[bitmap_tiles]") {
  const page_shape shape = shape_of(64, 64);
  std::vector<float> rows(64 * 64, 1.0f);  // every element ties
  for (int t = 0; t < 64; ++t) rows[static_cast<std::size_t>(t) * 64 + 63] = -2.0f;  // one clear winner
  const format::bitmap_tiles f{0.5f, 0.5f};
  std::vector<std::byte> page(format_traits<format::bitmap_tiles>::k_page_bytes(f, shape));
  format_traits<format::bitmap_tiles>::encode_k(f, shape, rows.data(), page.data());
  std::vector<float> decoded(rows.size());
  format_traits<format::bitmap_tiles>::decode_k(f, shape, page.data(), 64, decoded.data());
  for (int c = 0; c < 64; ++c) CHECK(decoded[static_cast<std::size_t>(c)] == (c < 31 ? 1.0f : c == 63 ? -2.0f : 0.0f));
}

TEST_CASE("bitmap_tiles: attention on compressed pages equals exact attention on the pruned cache",
          "[bitmap_tiles][oracle]") {
  const float s_k = GENERATE(0.5f, 0.7f);
  const float s_v = GENERATE(0.0f, 0.5f, 0.7f);
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  const auto k_layout = GENERATE(format::bitmap_k_layout::along_tokens, format::bitmap_k_layout::along_channels);
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = 64;
  c.storage = storage;
  c.max_pages = 64;
  c.max_sequences = 4;
  CAPTURE(s_k, s_v, to_string(storage), static_cast<int>(k_layout));
  cache<format::bitmap_tiles> sparse(c, format::bitmap_tiles{s_k, s_v, k_layout});
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 4;
  cfg.head_dim = 128;
  for (const int length : {40, 64, 64 * 5 + 17}) {
    CAPTURE(length);
    const auto kv = synthetic::generate_kv(cfg, static_cast<std::uint64_t>(length), length);
    const sequence_id s = sparse.add_sequence();
    sparse.prefill(s, test::k_view(kv), test::v_view(kv));
    // The reference: stored values, pruned per token in every full page, the tail left dense.
    synthetic::kv_data pruned = test::rounded(kv, storage);
    const int full_tokens = length / 64 * 64;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < full_tokens; ++t) {
        for (const bool v : {false, true}) {
          std::vector<float> row(128);
          float* base = (v ? pruned.v.data() : pruned.k.data()) + (static_cast<std::size_t>(t) * 2 + h) * 128;
          std::copy(base, base + 128, row.begin());
          const std::vector<float> kept = test::reference_prune(row, 128, v ? s_v : s_k);
          std::copy(kept.begin(), kept.end(), base);
        }
      }
    const std::vector<float> q = synthetic::generate_query(cfg, static_cast<std::uint64_t>(length), length);
    std::vector<float> out(q.size());
    sparse.attend(span<const sequence_id>(&s, 1), tensor_view<const float, 3>(q.data(), 1, 8, 128),
                  tensor_view<float, 3>(out.data(), 1, 8, 128));
    const double scale = 1.0 / std::sqrt(128.0);
    const auto exact = test::exact(q, pruned, scale);
    const auto bound = test::attention_error_bound(q, pruned, 4, scale, storage, 64, /*exact_storage=*/true);
    for (std::size_t i = 0; i < exact.size(); ++i) REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
    sparse.remove_sequence(s);
  }
}

TEST_CASE("bitmap_tiles at s = 0 attends exactly like dense", "[bitmap_tiles]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 8;
  cache<format::bitmap_tiles> sparse(c, format::bitmap_tiles{0.0f, 0.0f});
  cache<format::dense> dense(c);
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 1;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  const auto kv = synthetic::generate_kv(cfg, 1, 200);
  const sequence_id a = sparse.add_sequence(), b = dense.add_sequence();
  sparse.prefill(a, test::k_view(kv), test::v_view(kv));
  dense.prefill(b, test::k_view(kv), test::v_view(kv));
  const auto q = synthetic::generate_query(cfg, 1, 200);
  std::vector<float> out_a(q.size()), out_b(q.size());
  sparse.attend(span<const sequence_id>(&a, 1), tensor_view<const float, 3>(q.data(), 1, 2, 64),
                tensor_view<float, 3>(out_a.data(), 1, 2, 64));
  dense.attend(span<const sequence_id>(&b, 1), tensor_view<const float, 3>(q.data(), 1, 2, 64),
               tensor_view<float, 3>(out_b.data(), 1, 2, 64));
  CHECK(out_a == out_b);
}

TEST_CASE("bitmap_tiles accounting: every byte counted, at most the paper's 65% and 45% of dense",
          "[bitmap_tiles][accounting]") {
  const page_shape shape = shape_of(64, 128);
  using traits = format_traits<format::bitmap_tiles>;
  // 128 tiles x (8-byte bitmap + 4-byte offset) + 64 tokens x kept x 2 bytes, padded to 16
  CHECK(traits::k_page_bytes(format::bitmap_tiles{0.5f, 0.5f}, shape) == 128 * 12 + 64 * 64 * 2);
  CHECK(traits::k_page_bytes(format::bitmap_tiles{0.7f, 0.7f}, shape) == 128 * 12 + 64 * 38 * 2);
  cache_config c;
  c.max_pages = 600;
  for (const auto& [s, limit] : {std::pair<float, double>{0.5f, 0.65}, {0.7f, 0.45}}) {
    cache<format::bitmap_tiles> sparse(c, format::bitmap_tiles{s, s});
    synthetic::kv_config cfg;
    const auto kv = synthetic::generate_kv(cfg, 0, 8192 + 10);
    const sequence_id id = sparse.add_sequence();
    sparse.prefill(id, test::k_view(kv), test::v_view(kv));
    const memory_stats m = sparse.sequence_memory(id);
    const double pages = 8192 / 64;
    const double expected = (pages * 8 * 2 * static_cast<double>(traits::k_page_bytes(format::bitmap_tiles{s, s}, shape)) +
                             10.0 * 8 * 128 * 2 * 2) /
                            ((8192 + 10) * 8 * 128 * 2 * 2.0);
    CAPTURE(s, m.compression_ratio());
    CHECK(m.compression_ratio() == Approx(expected).epsilon(1e-12));
    CHECK(m.compression_ratio() <= limit);
  }
}

TEST_CASE("bitmap_tiles rejects bad sparsities and shapes, naming the parameter", "[bitmap_tiles][errors]") {
  const auto message = [](float s_k, float s_v, int page_size) {
    cache_config c;
    c.page_size = page_size;
    try {
      cache<format::bitmap_tiles> bad(c, format::bitmap_tiles{s_k, s_v});
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(message(-0.1f, 0.5f, 64) == "kvmosaic: format::bitmap_tiles: s_k = -0.1; allowed: 0 to 0.95");
  CHECK(message(0.5f, 0.96f, 64) == "kvmosaic: format::bitmap_tiles: s_v = 0.96; allowed: 0 to 0.95");
  CHECK_THAT(message(NAN, 0.5f, 64), Catch::Contains("s_k = nan"));
  CHECK(message(0.5f, 0.5f, 40) == "kvmosaic: cache_config: page_size = 40; allowed: a multiple of 16 from 16 to 1024");
  CHECK(message(0.5f, 0.5f, 48) ==
        "kvmosaic: format::bitmap_tiles: page_size = 48; allowed: a multiple of 64 (pages are whole 1x64 tiles along tokens)");
  CHECK(message(0.5f, 0.5f, 128) == "accepted");
}

TEST_CASE("bitmap_tiles output-aware K (section 2.1): S = |K| * sum|Q| decides, hand-computed", "[bitmap_tiles]") {
  // Every |k| is 1, so magnitudes tie everywhere and keep the lowest channels; weights 1 on
  // channels 0-31 and 2 on 32-63 make the scores 1 and 2: the upper half is kept instead.
  const page_shape shape = shape_of(64, 64);
  using traits = format_traits<format::bitmap_tiles>;
  const format::bitmap_tiles f{0.5f, 0.5f};
  std::vector<float> rows(64 * 64);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = (i % 3 == 0) ? -1.0f : 1.0f;
  std::vector<float> weights(64, 1.0f);
  for (int c = 32; c < 64; ++c) weights[static_cast<std::size_t>(c)] = 2.0f;
  std::vector<std::byte> page(traits::k_page_bytes(f, shape));
  std::vector<float> decoded(rows.size());
  for (const bool weighted : {false, true}) {
    traits::encode_k(f, shape, rows.data(), weighted ? weights.data() : nullptr, page.data());
    traits::decode_k(f, shape, page.data(), 64, decoded.data());
    for (int t = 0; t < 64; ++t)
      for (int c = 0; c < 64; ++c) {
        const std::size_t i = static_cast<std::size_t>(t) * 64 + c;
        CHECK(decoded[i] == ((c >= 32) == weighted ? rows[i] : 0.0f));
      }
  }
  // A random case against the independent reference.
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 1;
  cfg.head_dim = 64;
  const auto kv = synthetic::generate_kv(cfg, 4, 64);
  const std::vector<float> k = stored_rows(kv, 0, false, dtype::bf16);
  for (std::size_t c = 0; c < weights.size(); ++c) weights[c] = 0.25f * static_cast<float>((c * 7) % 5);  // ties
  traits::encode_k(f, shape, k.data(), weights.data(), page.data());
  traits::decode_k(f, shape, page.data(), 64, decoded.data());
  CHECK(decoded == test::reference_prune(k, 64, 0.5f, weights.data()));
}

TEST_CASE("output_aware_key_weights sums |q| over the window and the GQA group", "[bitmap_tiles]") {
  // window 2, 4 query heads in groups of 2, head_dim 1... padded to 2 channels for clarity.
  const std::vector<float> q{1, -2, /*h1*/ 3, 4, /*h2*/ -5, 6, /*h3*/ 7, -8,   // t = 0
                             -1, 1, /*h1*/ 1, -1, /*h2*/ 2, 2, /*h3*/ -2, 2};  // t = 1
  const auto w = output_aware_key_weights(tensor_view<const float, 3>(q.data(), 2, 4, 2), 2);
  CHECK(w == std::vector<float>{1 + 3 + 1 + 1, 2 + 4 + 1 + 1, 5 + 7 + 2 + 2, 6 + 8 + 2 + 2});
  CHECK_THROWS_WITH(output_aware_key_weights(tensor_view<const float, 3>(q.data(), 2, 4, 2), 3),
                    Catch::Contains("group_size = 3"));
}

TEST_CASE("cache::set_key_weights prunes sealed K pages output-aware, and rejects bad weights", "[bitmap_tiles]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 16;
  cache<format::bitmap_tiles> sparse(c, format::bitmap_tiles{0.7f, 0.3f});
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  std::vector<float> weights(2 * 64);
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = 1.0f + static_cast<float>((i * 13) % 7);
  const auto kv = synthetic::generate_kv(cfg, 6, 150);
  const sequence_id id = sparse.add_sequence();
  sparse.set_key_weights(id, tensor_view<const float, 2>(weights.data(), 2, 64));
  sparse.prefill(id, test::k_view(kv), test::v_view(kv));
  const auto q = synthetic::generate_query(cfg, 6, 150);
  std::vector<float> out(q.size());
  sparse.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
                tensor_view<float, 3>(out.data(), 1, 4, 64));
  const synthetic::kv_data kept = test::pruned_cache(test::rounded(kv, dtype::bf16), 64, 0.7f, 0.3f, weights);
  const double scale = 1.0 / 8.0;
  const auto exact = test::exact(q, kept, scale);
  const auto bound = test::attention_error_bound(q, kept, 2, scale, dtype::bf16, 64, /*exact_storage=*/true);
  for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  // Magnitude pruning gives a different cache on this data: the weights took effect.
  const auto magnitude = test::exact(q, test::pruned_cache(test::rounded(kv, dtype::bf16), 64, 0.7f, 0.3f), scale);
  double differ = 0;
  for (std::size_t i = 0; i < out.size(); ++i) differ = std::max(differ, std::abs(magnitude[i] - exact[i]));
  CHECK(differ > 1e-3);

  CHECK_THROWS_WITH(sparse.set_key_weights(id, tensor_view<const float, 2>(weights.data(), 1, 64)),
                    "kvmosaic: cache::set_key_weights: weights shape = 1x64; allowed: num_kv_heads x head_dim");
  weights[5] = -1.0f;
  CHECK_THROWS_WITH(sparse.set_key_weights(id, tensor_view<const float, 2>(weights.data(), 2, 64)),
                    Catch::Contains("weights = -1; allowed: finite and >= 0"));
  sparse.set_key_weights(id, tensor_view<const float, 2>(nullptr, 0, 0));  // back to magnitudes
}

TEST_CASE("cache::fork_sequence: the child inherits the output-aware K weights", "[bitmap_tiles]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 16;
  cache<format::bitmap_tiles> sparse(c, format::bitmap_tiles{0.7f, 0.3f});
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  std::vector<float> weights(2 * 64);
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = 1.0f + static_cast<float>((i * 13) % 7);
  const auto kv = synthetic::generate_kv(cfg, 8, 150);
  const sequence_id parent = sparse.add_sequence();
  sparse.set_key_weights(parent, tensor_view<const float, 2>(weights.data(), 2, 64));
  // 30 tokens stay in the parent's tail; the child seals them, with 120 more, into its own pages.
  const auto rows = [&](const std::vector<float>& x, int first, int n) {
    return tensor_view<const float, 3>(x.data() + static_cast<std::size_t>(first) * 2 * 64, n, 2, 64);
  };
  sparse.prefill(parent, rows(kv.k, 0, 30), rows(kv.v, 0, 30));
  const sequence_id child = sparse.fork_sequence(parent);
  sparse.prefill(child, rows(kv.k, 30, 120), rows(kv.v, 30, 120));
  const auto q = synthetic::generate_query(cfg, 8, 150);
  std::vector<float> out(q.size());
  sparse.attend(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
                tensor_view<float, 3>(out.data(), 1, 4, 64));
  const synthetic::kv_data kept = test::pruned_cache(test::rounded(kv, dtype::bf16), 64, 0.7f, 0.3f, weights);
  const auto exact = test::exact(q, kept, 1.0 / 8.0);
  const auto bound = test::attention_error_bound(q, kept, 2, 1.0 / 8.0, dtype::bf16, 64, /*exact_storage=*/true);
  for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
}
