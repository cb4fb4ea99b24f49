// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::bitmap_tiles`: MUSTAFAR's unstructured KV sparsity (Joo et al., "MUSTAFAR: Promoting
/// Unstructured Sparsity for KV Cache Pruning in LLM Inference", sections 2-3, 4.3, appendix C).
///
/// Pruning: every token's K vector and V vector keeps exactly `head_dim - round(s * head_dim)`
/// elements of largest magnitude (per-token magnitude pruning, the paper's choice for both caches).
/// Ties in magnitude keep the lower channel. Optionally K is pruned output-aware (section 2.1): the
/// score of k_c is |k_c| * w_c, with w the sum of |q| over a window of queries (the GQA group
/// summed), set per sequence with `cache::set_key_weights` (`output_aware_key_weights` computes
/// w); scores are fp32 products on host and device alike.
///
/// Storage of one page (page_size tokens) of one KV head, K and V alike:
///   [bitmaps: tiles x uint64][tile offsets: tiles x uint32][non-zero values: 16-bit, packed]
/// with 1x64 tiles. The paper (appendix C) tiles K along tokens for each channel (tile (c, j) =
/// channel c, tokens 64 j .. 64 j + 63: the dimension q.k does not reduce over) and V along
/// channels for each token (tile (t, j) = token t, channels 64 j .. 64 j + 63). Bit b of a tile's
/// bitmap marks element b as kept; its values follow in bit order at its tile offset (values
/// before it in the page). Pages append without touching earlier pages.
///
/// Deliberate difference, the default (`k_layout = bitmap_k_layout::along_channels`): K is tiled as
/// V, along channels per token; the paper's orientation is `bitmap_k_layout::along_tokens`. Same
/// bytes. Why: our decode kernel expands tiles into a dense shared-memory tile, one tile per lane,
/// so a warp runs as long as its fullest tile. A K tile along tokens holds one channel's 64
/// tokens, and channels with outliers are kept for nearly every token: on K with outlier channels
/// (`synthetic::generate_kv`), a warp's fullest K tile holds 51 values along tokens against 24
/// along channels at s = 0.7 (mean 19); along channels was the faster default on K with outlier
/// channels at s = 0.7 (benchmark/README.md, "Decisions the code cites": "bitmap_tiles K layout").
///
/// Deliberate difference: the paper pads each tile's values to a multiple of 8 so a thread can
/// load a tile with aligned vector loads from global memory. Here the values of a page form one
/// run padded to 16 bytes at its end: kernels stage whole pages in shared memory, where any
/// offset is cheap, and since every token keeps the same count the page size is exact and fixed.
/// Bytes per page and head: tiles x 12 + align16(page_size x kept x 2), tiles = page_size x
/// head_dim / 64. At head_dim 128, pages of 64: 59% of dense at s = 0.5, 39% at s = 0.7 (the
/// paper: 65% and 45%, with its per-tile padding).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"

namespace kvmosaic {
namespace format {

/// How bitmap_tiles tiles K (V is always tiled along channels, per token).
enum class bitmap_k_layout {
  along_tokens,    ///< tile = one channel, 64 tokens: the paper's orientation (appendix C)
  along_channels,  ///< tile = one token, 64 channels, as V: the default (faster decode, see the file comment)
};

/// Unstructured per-token magnitude pruning of K and V to sparsities `s_k`, `s_v` in [0, 0.95],
/// stored as 1x64 bitmap tiles. Cost per page: the kept values plus 12 bytes per 64 elements,
/// the same in either K layout.
struct bitmap_tiles {
  using policy_category = format_tag;
  float s_k = 0.5f;  ///< fraction of each K vector pruned
  float s_v = 0.5f;  ///< fraction of each V vector pruned
  bitmap_k_layout k_layout = bitmap_k_layout::along_channels;  ///< orientation of K's tiles (see the file comment)
  /// Attention sinks kept unpruned: the first `sink_tokens` (0 to 16) tokens of every sequence are
  /// also kept as dense 16-bit rows once its first page is sealed, attended exactly, and masked in
  /// that page. Cost: sink_tokens dense rows per sequence. Default 0 (MUSTAFAR's): on a real
  /// model 4 sinks changed nothing measurable here, unlike quant2's (docs/defaults.md).
  int sink_tokens = 0;
  /// The recent window kept unpruned (0 to 1024; MUSTAFAR keeps 32): the last `recent_tokens`
  /// sealed tokens are also kept as dense rows (a ring in the tail slot) and attended in place of
  /// their masked page copies. Cost: recent_tokens dense rows per sequence, written at seal. Not
  /// with a compactor that frees memory (the cache rejects it), hence 0 by default; 64 is worth
  /// setting where no compactor frees memory (docs/defaults.md).
  int recent_tokens = 0;
};

}  // namespace format

namespace detail {

constexpr int tile_length = 64;

/// Elements a vector of `head_dim` keeps at sparsity s.
inline int kept_per_vector(float sparsity, int head_dim) {
  return head_dim - static_cast<int>(std::lround(static_cast<double>(sparsity) * head_dim));
}

/// Indices of the `keep` largest scores |x_i| (times weights[i] when weights are given) of
/// x[0..n), ties to the lower index, in increasing order.
inline void largest_magnitudes(const float* x, int n, int keep, std::vector<int>& kept, const float* weights = nullptr) {
  kept.resize(static_cast<std::size_t>(n));
  std::iota(kept.begin(), kept.end(), 0);
  const auto score = [x, weights](int i) { return weights ? std::abs(x[i]) * weights[i] : std::abs(x[i]); };
  std::stable_sort(kept.begin(), kept.end(), [&score](int a, int b) { return score(a) > score(b); });
  kept.resize(static_cast<std::size_t>(keep));
  std::sort(kept.begin(), kept.end());
}

/// Layout of one bitmap-tiles page: where its bitmaps, offsets and values start.
struct bitmap_page_layout {
  int tiles;
  int values;  ///< kept values in the page
  std::size_t offsets_at() const { return static_cast<std::size_t>(tiles) * 8; }
  std::size_t values_at() const { return offsets_at() + static_cast<std::size_t>(tiles) * 4; }
  std::size_t bytes() const { return values_at() + (static_cast<std::size_t>(values) * 2 + 15) / 16 * 16; }
};

inline bitmap_page_layout bitmap_layout(float sparsity, const page_shape& shape) {
  return bitmap_page_layout{shape.page_size * shape.head_dim / tile_length,
                            shape.page_size * kept_per_vector(sparsity, shape.head_dim)};
}

/// Prunes rows [page_size][head_dim] per token (scores weighted by `weights` when given) and packs
/// them; `along_tokens` tiles each channel along tokens (K), otherwise each token along channels (V).
inline void encode_bitmap_page(float sparsity, const page_shape& shape, const float* rows, bool along_tokens,
                               std::byte* page, const float* weights = nullptr) {
  const int p = shape.page_size, d = shape.head_dim;
  const bitmap_page_layout layout = bitmap_layout(sparsity, shape);
  // Which elements each token keeps (the decision, not the value: a kept zero stays kept, so
  // every page holds exactly `layout.values` values).
  std::vector<std::uint8_t> keep_mask(static_cast<std::size_t>(p) * d, 0);
  std::vector<int> kept;
  for (int t = 0; t < p; ++t) {
    largest_magnitudes(rows + static_cast<std::size_t>(t) * d, d, kept_per_vector(sparsity, d), kept, weights);
    for (const int c : kept) keep_mask[static_cast<std::size_t>(t) * d + c] = 1;
  }
  std::vector<float> values;
  values.reserve(static_cast<std::size_t>(layout.values));
  auto* bitmaps = reinterpret_cast<std::uint64_t*>(page);
  auto* offsets = reinterpret_cast<std::uint32_t*>(page + layout.offsets_at());
  const int tiles_per_line = along_tokens ? p / tile_length : d / tile_length;
  for (int tile = 0; tile < layout.tiles; ++tile) {
    const int line = tile / tiles_per_line, part = tile % tiles_per_line;
    std::uint64_t bits = 0;
    offsets[tile] = static_cast<std::uint32_t>(values.size());
    for (int b = 0; b < tile_length; ++b) {
      const int t = along_tokens ? part * tile_length + b : line;
      const int c = along_tokens ? line : part * tile_length + b;
      const std::size_t index = static_cast<std::size_t>(t) * d + c;
      if (keep_mask[index]) {
        bits |= std::uint64_t{1} << b;
        values.push_back(rows[index]);
      }
    }
    std::memcpy(&bitmaps[tile], &bits, sizeof bits);
  }
  std::byte* value_bytes = page + layout.values_at();
  std::memset(value_bytes, 0, layout.bytes() - layout.values_at());
  store_dense_rows(shape.storage, values.data(), values.size(), value_bytes);
}

/// Index of the lowest set bit of a non-zero word.
inline int lowest_set_bit(std::uint64_t x) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctzll(x);
#else
  int i = 0;
  for (; (x & 1u) == 0; x >>= 1) ++i;
  return i;
#endif
}

/// Unpacks the first n tokens of a page into dense rows [n][head_dim] (pruned elements are 0).
/// The page's values are widened to float in one pass (`load_dense_rows`, vectorized), then each
/// tile's set bits place them. Cost: O(n x head_dim) to clear the rows, then one step per kept
/// value; no allocation once the per-thread scratch has grown to a page's values.
inline void decode_bitmap_page(float sparsity, const page_shape& shape, const std::byte* page, int n,
                               bool along_tokens, float* rows) {
  const int p = shape.page_size, d = shape.head_dim;
  const bitmap_page_layout layout = bitmap_layout(sparsity, shape);
  std::fill(rows, rows + static_cast<std::size_t>(n) * d, 0.0f);
  thread_local std::vector<float> values;
  if (values.size() < static_cast<std::size_t>(layout.values)) values.resize(static_cast<std::size_t>(layout.values));
  load_dense_rows(shape.storage, page + layout.values_at(), static_cast<std::size_t>(layout.values), values.data());
  const int tiles_per_line = along_tokens ? p / tile_length : d / tile_length;
  for (int tile = 0; tile < layout.tiles; ++tile) {
    std::uint64_t bits;
    std::memcpy(&bits, page + static_cast<std::size_t>(tile) * 8, sizeof bits);
    std::uint32_t offset;
    std::memcpy(&offset, page + layout.offsets_at() + static_cast<std::size_t>(tile) * 4, sizeof offset);
    const int line = tile / tiles_per_line, part = tile % tiles_per_line;
    if (!along_tokens && line >= n) continue;  // a token's tiles: past the rows asked for
    for (; bits != 0; bits &= bits - 1, ++offset) {
      const int b = lowest_set_bit(bits);
      const int t = along_tokens ? part * tile_length + b : line;
      const int c = along_tokens ? line : part * tile_length + b;
      if (t < n) rows[static_cast<std::size_t>(t) * d + c] = values[offset];
    }
  }
}

}  // namespace detail

/// MUSTAFAR's output-aware K weights (section 2.1): w[h][c] = sum over the window's queries and
/// the query heads of KV head h of |q[t][h * group_size + g][c]|. `queries`: [window][num_q_heads]
/// [head_dim] (the paper uses the 32 most recent). Returns [num_kv_heads][head_dim].
inline std::vector<float> output_aware_key_weights(tensor_view<const float, 3> queries, int group_size) {
  detail::require(group_size >= 1 && queries.extent(1) % group_size == 0, "output_aware_key_weights", "group_size",
                  group_size, "a divisor of queries.extent(1) (the query heads)");
  const std::int64_t kv_heads = queries.extent(1) / group_size, d = queries.extent(2);
  std::vector<float> w(static_cast<std::size_t>(kv_heads * d), 0.0f);
  for (std::int64_t t = 0; t < queries.extent(0); ++t)
    for (std::int64_t j = 0; j < queries.extent(1); ++j)
      for (std::int64_t c = 0; c < d; ++c) w[static_cast<std::size_t>((j / group_size) * d + c)] += std::abs(queries(t, j, c));
  return w;
}

template <>
struct format_traits<format::bitmap_tiles> {
  static constexpr const char* name = "bitmap_tiles";
  /// K may be pruned output-aware (cache::set_key_weights).
  static constexpr bool has_key_weights = true;

  static std::string describe(const format::bitmap_tiles& f) {
    return "bitmap_tiles(k" + detail::to_text(f.s_k) + ",v" + detail::to_text(f.s_v) +
           (f.k_layout == format::bitmap_k_layout::along_tokens ? ",k/tokens" : "") +
           detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens) + ")";
  }

  static void validate(const format::bitmap_tiles& f, const page_shape& shape) {
    const char* where = "format::bitmap_tiles";
    detail::require(f.s_k >= 0.0f && f.s_k <= 0.95f, where, "s_k", f.s_k, "0 to 0.95");
    detail::require(f.s_v >= 0.0f && f.s_v <= 0.95f, where, "s_v", f.s_v, "0 to 0.95");
    detail::require(shape.page_size % detail::tile_length == 0, where, "page_size", shape.page_size,
                    "a multiple of 64 (pages are whole 1x64 tiles along tokens)");
    detail::require(shape.head_dim % detail::tile_length == 0, where, "head_dim", shape.head_dim, "a multiple of 64");
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage",
                    to_string(shape.storage), "f16 or bf16");
    detail::require(f.k_layout == format::bitmap_k_layout::along_tokens || f.k_layout == format::bitmap_k_layout::along_channels,
                    where, "k_layout", static_cast<int>(f.k_layout), "bitmap_k_layout::along_tokens or along_channels");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
  }
  static int sink_rows(const format::bitmap_tiles& f) { return f.sink_tokens; }
  static int window_rows(const format::bitmap_tiles& f) { return f.recent_tokens; }
  static bool k_along_tokens(const format::bitmap_tiles& f) { return f.k_layout == format::bitmap_k_layout::along_tokens; }

  static std::size_t k_page_bytes(const format::bitmap_tiles& f, const page_shape& shape) {
    return detail::bitmap_layout(f.s_k, shape).bytes();
  }
  static std::size_t v_page_bytes(const format::bitmap_tiles& f, const page_shape& shape) {
    return detail::bitmap_layout(f.s_v, shape).bytes();
  }

  static void encode_k(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_bitmap_page(f.s_k, shape, rows, k_along_tokens(f), page);
  }
  /// As encode_k, each element scored |k_c| * weights[c] (weights: [head_dim], or null).
  static void encode_k(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, const float* weights,
                       std::byte* page) {
    detail::encode_bitmap_page(f.s_k, shape, rows, k_along_tokens(f), page, weights);
  }
  static void encode_v(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_bitmap_page(f.s_v, shape, rows, /*along_tokens=*/false, page);
  }
  static void decode_k(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* page, int n,
                       float* rows) {
    detail::decode_bitmap_page(f.s_k, shape, page, n, k_along_tokens(f), rows);
  }
  static void decode_v(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* page, int n,
                       float* rows) {
    detail::decode_bitmap_page(f.s_v, shape, page, n, /*along_tokens=*/false, rows);
  }

  /// Host reference: unpack, then the dense product (the CUDA kernels compute on the tiles).
  static void score(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* k_page, int n,
                    const float* q, int groups, float* logits) {
    const int d = shape.head_dim;
    std::vector<float>& keys = detail::host_scratch(static_cast<std::size_t>(shape.page_size) * d);
    decode_k(f, shape, k_page, n, keys.data());
    host::row_matrix_map(logits, groups, n).noalias() =
        host::const_row_matrix_map(q, groups, d) * host::const_row_matrix_map(keys.data(), n, d).transpose();
  }
  static void accumulate(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    const int d = shape.head_dim;
    std::vector<float>& values = detail::host_scratch(static_cast<std::size_t>(shape.page_size) * d);
    decode_v(f, shape, v_page, n, values.data());
    host::row_matrix_map(o, groups, d).noalias() +=
        host::const_row_matrix_map(p, groups, n) * host::const_row_matrix_map(values.data(), n, d);
  }
};

namespace detail {
/// Compaction moves format::bitmap_tiles' tokens without changing a stored value: both backends
/// unpack the pages a pass reads and prune and pack the pages it writes again, by the moved rows'
/// plain magnitudes. A moved row holds exactly the values its first encode kept (at most `keep`
/// nonzeros per vector, zeros elsewhere), so the magnitudes keep them all: zeros never outrank
/// them, whatever K weights the sequence has now. (Pruning with the current weights could drop
/// kept values where a weight is 0, or where the weights changed since the page was sealed.)
template <>
struct reencodes_moved_rows<format::bitmap_tiles> : std::false_type {};
template <>
struct reencoding<format::bitmap_tiles> {
  static format::bitmap_tiles format(const format::bitmap_tiles& f) { return f; }
  static constexpr bool key_weights = false;
  static int limit(const format::bitmap_tiles&) noexcept { return 255; }
};
}  // namespace detail

}  // namespace kvmosaic
