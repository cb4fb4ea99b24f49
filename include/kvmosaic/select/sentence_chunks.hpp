// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::sentence_chunks`: sentence-level selection (SentKVCompress: the sentence split of its
/// Algorithm 2, the per-sentence min and max key of section 4.1.2, selection within a token budget
/// and reuse across steps of section 4.2).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"
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

}  // namespace select

template <>
struct selector_traits<select::sentence_chunks> {
  static constexpr const char* name = "sentence_chunks";
  static constexpr bool reads_all_pages = false;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = true;
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
};

}  // namespace kvmosaic
