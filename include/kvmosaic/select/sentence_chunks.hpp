// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::sentence_chunks`: sentence-level selection (SentKVCompress: the sentence split of its
/// Algorithm 2, the per-sentence min and max key of section 4.1.2, selection within a token budget
/// and reuse across steps of section 4.2).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/select/selection_request.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// A boundary token of the caller's vocabulary and its semantic weight S(b) in [0, 1].
struct boundary {
  std::int32_t id;
  float weight;
};

/// Reads, per (sequence, KV head) and step, whole sentence chunks in score order until the token
/// budget is full, plus the open chunk and the dense tail (always read).
///
/// What it computes:
///   - the token stream (ids the caller passes with every prefill and append) is cut into chunks
///     by Algorithm 2 of SentKVCompress, exactly (`sentence_split`): from `current`, ideal_end =
///     min(current + L, n); candidates are the boundary tokens t in [max(ideal_end - Delta,
///     current + 1), min(ideal_end + Delta, n)] (t < n: a token must exist); the chunk ends at the
///     candidate maximizing 0.7 S(t) + 0.3 (1 - |ideal_end - t| / Delta) (the first of equals), or
///     at ideal_end when there is none. As in the pseudocode, the chunk is [current, best_split)
///     and the boundary token at best_split opens the next chunk.
///   - a chunk is final once the tokens its window can see exist (n > current + L + Delta); the
///     tokens after the last final chunk (the open chunk, fewer than L + Delta + 1) are always read.
///   - each final chunk keeps the channel-wise min and max of its keys per KV head (16-bit, exact).
///   - a step scores every chunk as `select::quest` scores a block (sum_c max(q_c hi_c, q_c lo_c),
///     the group combined by `combine`) and takes chunks in score order while their lengths fit the
///     budget (stopping at the first that does not), with no padding: kernels read the selected
///     tokens' pages and mask the rest.
///
/// Cost: 2 x head_dim 16-bit values per chunk and KV head (about 1/7 of the dense K bytes at the
/// default L = 14; SentKVCompress reports 7% of the KV); per step, reading those bounds and a
/// budgeted top-k per (sequence, KV head). Both backends: on CUDA the host cuts the chunks from
/// the ids (host memory) and the device keeps their bounds (docs/selectors.md).
struct sentence_chunks {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int target_length = 14;                     ///< L: the ideal chunk length (the paper's setting), 1 to
                                              ///< `max_length`
  int window = 8;                             ///< Delta: how far a split may move from the ideal end, 1 to
                                              ///< `max_length`
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head
  std::vector<boundary> boundaries;           ///< the boundary token ids and their weights S(b)

  /// The largest L and Delta: chunks are sentences (the paper's L is 14), and an engine keeps
  /// each sequence's open chunk, up to L + Delta rows, in memory, so both stay small and L + Delta
  /// (at most 8192) far from int's range.
  static constexpr int max_length = 4096;

  /// S(b) of `id`: its weight, or -1 for a token that is not a boundary.
  float weight_of(std::int32_t id) const noexcept {
    for (const boundary& b : boundaries)
      if (b.id == id) return b.weight;
    return -1.0f;
  }
};

/// One chunk: tokens [begin, end).
struct chunk {
  std::int64_t begin;
  std::int64_t end;
};

/// Algorithm 2 of SentKVCompress over ids[0, n): the chunks, in order, covering [0, n).
inline std::vector<chunk> sentence_split(const std::int32_t* ids, std::int64_t n, const sentence_chunks& s);

namespace detail {
/// One step of Algorithm 2 from `current` over a stream of n tokens: the chunk's end.
inline std::int64_t split_end(const std::int32_t* ids, std::int64_t n, std::int64_t current, const sentence_chunks& s) {
  const std::int64_t ideal_end = std::min<std::int64_t>(current + s.target_length, n);
  const std::int64_t window_start = std::max<std::int64_t>(ideal_end - s.window, current + 1);
  const std::int64_t window_end = std::min<std::int64_t>(ideal_end + s.window, n);
  std::int64_t best = -1;
  double best_score = 0.0;
  for (std::int64_t t = window_start; t <= window_end && t < n; ++t) {
    const float weight = s.weight_of(ids[t]);
    if (weight < 0.0f) continue;
    const double distance = static_cast<double>(ideal_end > t ? ideal_end - t : t - ideal_end);
    const double score = 0.7 * weight + 0.3 * (1.0 - distance / s.window);
    if (best < 0 || score > best_score) {
      best = t;
      best_score = score;
    }
  }
  return best >= 0 ? best : ideal_end;
}
}  // namespace detail

inline std::vector<chunk> sentence_split(const std::int32_t* ids, std::int64_t n, const sentence_chunks& s) {
  std::vector<chunk> chunks;
  for (std::int64_t current = 0; current < n;) {
    const std::int64_t end = detail::split_end(ids, n, current, s);
    chunks.push_back(chunk{current, end});
    current = end;
  }
  return chunks;
}

/// The chunk stream of one sequence (`select::sentence_chunks`' per-sequence state): its final
/// chunks, their key bounds on the host backend, and the open chunk's tokens, which Algorithm 2
/// has not cut yet. Memory: 8 bytes per chunk, plus on the host backend 2 x head_dim 16-bit values
/// per chunk and KV head, plus the open chunk's ids (and, on the host, its keys as floats: at most
/// L + Delta rows).
struct chunk_stream {
  std::vector<std::int64_t> starts{0};     ///< chunk i is [starts[i], starts[i+1]); back(): the open chunk
  std::vector<std::uint16_t> bounds;       ///< host backend: [chunk][num_kv_heads][lo row, hi row], storage dtype bits
  std::vector<std::int32_t> pending_ids;   ///< ids of the open chunk's tokens
  std::vector<float> pending_keys;         ///< host backend: their keys, rounded to the storage dtype [token][heads][head_dim]

  /// The final chunks, in order ([begin, end)). Cost: O(chunks), a new vector.
  std::vector<chunk> chunks() const {
    std::vector<chunk> out;
    for (std::size_t i = 0; i + 1 < starts.size(); ++i) out.push_back(chunk{starts[i], starts[i + 1]});
    return out;
  }
};

/// What some rows add to a `chunk_stream`, computed without changing it (`selector_traits::stage`):
/// the chunks Algorithm 2 closes, their key bounds (host backend), and the open tokens left.
struct chunk_stream_update {
  std::vector<std::int32_t> lengths;      ///< closed chunks, in order
  std::vector<std::uint16_t> bounds;      ///< host backend: their bounds, as chunk_stream::bounds
  std::vector<std::int32_t> pending_ids;  ///< the open chunk's ids afterwards
  std::vector<float> pending_keys;        ///< host backend: their keys afterwards
};

}  // namespace select

template <>
struct selector_traits<select::sentence_chunks> {
  static constexpr const char* name = "sentence_chunks";
  static constexpr bool reads_all_pages = false;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = true;
  /// Chunks are runs of slots: a compaction would move tokens out from under them.
  static constexpr bool keeps_token_ranges = true;
  static std::string describe(const select::sentence_chunks& s) {
    std::string text = "sentence_chunks(";
    text += s.budget.describe();
    text += ", L " + std::to_string(s.target_length) + ", delta " + std::to_string(s.window) + ", " + to_string(s.combine) + ")";
    return text;
  }
  static void validate(const select::sentence_chunks& s, int /*page_size*/) {
    const char* where = "select::sentence_chunks";
    s.budget.validate(where);
    detail::require(s.target_length >= 1 && s.target_length <= select::sentence_chunks::max_length, where,
                    "target_length", s.target_length, "1 to 4096 (sentence_chunks::max_length)");
    detail::require(s.window >= 1 && s.window <= select::sentence_chunks::max_length, where, "window", s.window,
                    "1 to 4096 (sentence_chunks::max_length)");
    for (const select::boundary& b : s.boundaries)
      detail::require(b.weight >= 0.0f && b.weight <= 1.0f, where, "boundaries[].weight", b.weight, "0 to 1");
  }
  static int bounds_block_tokens(const select::sentence_chunks&, int) noexcept { return 0; }

  // --- Host hooks (select/selector_traits.hpp) ---------------------------------------------------

  using sequence_state = select::chunk_stream;
  using update = select::chunk_stream_update;

  /// `cache::chunks(seq)`: the chunks cut for `seq` so far ([begin, end), final ones only).
  template <class Cache>
  struct cache_members {
    std::vector<select::chunk> chunks(std::int32_t seq) const {
      return static_cast<const Cache&>(*this).selector_state(seq).chunks();
    }
  };

  /// Rows [first, first + n) of a prefill or append extend the stream: Algorithm 2 runs over the
  /// open ids while the next chunk's window is complete (more than L + Delta open tokens). On the
  /// host backend the closed chunks' key bounds come from the open keys (rounded to the storage
  /// dtype, so exact); on a device backend `write` has the engine compute them. Cost: O(open
  /// tokens) copies, Algorithm 2's window scan per closed chunk, and on the host a min/max pass over
  /// the closed chunks' keys.
  template <bool OnDevice, class T>
  static update stage(const select::sentence_chunks& s, const selector_shape& shape, const sequence_state& c,
                      const tensor_view<const T, 3>& k, span<const std::int32_t> ids, std::int64_t first, std::int64_t n) {
    update u;
    const int heads = shape.num_kv_heads, d = shape.head_dim;
    const std::size_t row = static_cast<std::size_t>(heads) * d;
    u.pending_ids = c.pending_ids;
    for (std::int64_t t = first; t < first + n; ++t) u.pending_ids.push_back(ids(t));
    if constexpr (!OnDevice) {
      u.pending_keys = c.pending_keys;
      for (std::int64_t t = first; t < first + n; ++t)
        for (int h = 0; h < heads; ++h)
          for (int ch = 0; ch < d; ++ch) u.pending_keys.push_back(round_to_storage(shape.storage, to_float(k(t, h, ch))));
    }
    // Algorithm 2 over the open tokens, while the next chunk's window is complete (ids only).
    const std::int64_t horizon = static_cast<std::int64_t>(s.target_length) + s.window;
    std::size_t done = 0;  // tokens of pending already cut into chunks
    while (static_cast<std::int64_t>(u.pending_ids.size() - done) > horizon) {
      const std::int64_t end =
          select::detail::split_end(u.pending_ids.data() + done, static_cast<std::int64_t>(u.pending_ids.size() - done), 0, s);
      u.lengths.push_back(static_cast<std::int32_t>(end));
      done += static_cast<std::size_t>(end);
    }
    u.pending_ids.erase(u.pending_ids.begin(), u.pending_ids.begin() + static_cast<std::ptrdiff_t>(done));
    if constexpr (!OnDevice) {
      std::vector<float> bounds(2 * static_cast<std::size_t>(d));
      std::size_t at = 0;
      for (const std::int32_t length : u.lengths) {
        for (int h = 0; h < heads; ++h) {
          for (int ch = 0; ch < d; ++ch) {
            float lo = u.pending_keys[at * row + static_cast<std::size_t>(h) * d + ch], hi = lo;
            for (std::int64_t t = 1; t < length; ++t) {
              const float x = u.pending_keys[(at + static_cast<std::size_t>(t)) * row + static_cast<std::size_t>(h) * d + ch];
              lo = x < lo ? x : lo;
              hi = x > hi ? x : hi;
            }
            bounds[static_cast<std::size_t>(ch)] = lo;
            bounds[static_cast<std::size_t>(d + ch)] = hi;
          }
          for (const float x : bounds) u.bounds.push_back(storage_bits(shape.storage, x));  // lo row, then hi row
        }
        at += static_cast<std::size_t>(length);
      }
      u.pending_keys.erase(u.pending_keys.begin(), u.pending_keys.begin() + static_cast<std::ptrdiff_t>(done * row));
    }
    return u;
  }
  /// Room for `u` in `c`, so that `commit` cannot throw.
  static void reserve(sequence_state& c, const update& u) {
    c.starts.reserve(c.starts.size() + u.lengths.size());
    c.bounds.reserve(c.bounds.size() + u.bounds.size());
  }
  static void commit(sequence_state& c, update& u) noexcept {
    for (const std::int32_t length : u.lengths) c.starts.push_back(c.starts.back() + length);
    c.bounds.insert(c.bounds.end(), u.bounds.begin(), u.bounds.end());
    c.pending_ids.swap(u.pending_ids);
    c.pending_keys.swap(u.pending_keys);
  }
  /// On a device backend the selection stage (cuda/select/sentence_chunks.cuh) computes the closed
  /// chunks' bounds from the device rows [first, first + n) of `k` and keeps the open rows
  /// (pending until the engine's commit).
  template <bool OnDevice, class Engine, class T>
  static void write(Engine& engine, std::int32_t slot, const update& u, const tensor_view<const T, 3>& k, std::int64_t first,
                    std::int64_t n) {
    if constexpr (OnDevice) engine.selection().add_chunks(slot, k, first, n, u.lengths, engine.stream());
  }
  /// On a device backend the child's slot gets a copy of the parent's chunks and open rows.
  template <bool OnDevice, class Engine>
  static void fork(Engine& engine, std::int32_t from, std::int32_t to) {
    if constexpr (OnDevice) engine.selection().copy_chunks(from, to, engine.stream());
  }
  /// On a device backend the slot's chunk storage goes back to the selection stage.
  template <bool OnDevice, class Engine>
  static void release(Engine& engine, std::int32_t slot) {
    if constexpr (OnDevice) engine.selection().release_chunks(slot);
  }
  /// The chunks' key bounds: 2 rows of head_dim 16-bit values per chunk and KV head (counted on
  /// both backends, wherever they live).
  static std::int64_t extra_bytes(const selector_shape& shape, const sequence_state& c) noexcept {
    return static_cast<std::int64_t>(c.starts.size() - 1) * shape.num_kv_heads * 2 * shape.head_dim *
           static_cast<std::int64_t>(sizeof(std::uint16_t));
  }
  /// Every step reads the open chunk (and everything after it).
  static std::int64_t always_from(const sequence_state& c, std::int64_t sealed) noexcept {
    return std::min(sealed, c.starts.back());
  }

  /// A step scores each sequence's final chunks.
  static detail::selection_request start_request(const select::sentence_chunks& s, const selector_shape&) {
    detail::selection_request r;
    r.combine = s.combine;
    r.block_tokens = 0;
    return r;
  }
  /// One sequence's entry: the budget for its length, the open chunk (never empty, so every step
  /// attends to a token) read besides the selection, and the final chunks as spans. Cost: O(1).
  static void request(const select::sentence_chunks& s, const selector_shape&, const sequence_state& c, std::int64_t length,
                      std::int64_t /*tail_rows*/, detail::selection_request& r) {
    r.budget.push_back(s.budget.resolve(length));
    r.always_from.push_back(c.starts.back());
    r.chunks.push_back(detail::chunk_list{c.starts.data(), static_cast<std::int32_t>(c.starts.size() - 1), c.bounds.data()});
  }

 private:
  static float round_to_storage(dtype storage, float x) noexcept {
    return storage == dtype::f16 ? detail::half_bits_to_float(detail::float_to_half_bits(x))
                                 : detail::bfloat16_bits_to_float(detail::float_to_bfloat16_bits(x));
  }
  static std::uint16_t storage_bits(dtype storage, float x) noexcept {
    return storage == dtype::f16 ? detail::float_to_half_bits(x) : detail::float_to_bfloat16_bits(x);
  }
};

}  // namespace kvmosaic
