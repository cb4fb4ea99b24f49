// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the read-less selectors share: the token budget, Quest's upper-bound score of a span of
/// tokens from its per-channel key bounds, the combination of a GQA group's scores, and the
/// reference selection (the longest prefix of the spans in score order that fits the budget).
///
/// A *span* is a run of tokens with the channel-wise min and max of their keys: a fixed block of a
/// page for `select::quest`, a sentence chunk for `select::sentence_chunks`. Both selectors score
/// spans the same way and select them the same way; they differ in how spans are cut.
///
/// The score's fp32 arithmetic has one fixed order (`span_score`), written so that the host and
/// the CUDA scoring kernel (lane l accumulates its head_dim / 32 contiguous channels in turn by
/// fused multiply-adds, read with one vector load per bound row, then a butterfly over the 32
/// lanes) round identically: both backends select the same spans.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kvmosaic/core/config.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/fused.hpp"

namespace kvmosaic {

/// How the scores of the query heads of a GQA group become the one score per span that selects
/// for their shared KV head (one selection per KV head: the group shares every K/V load).
///   - `max` (the default): the largest of the group's scores: a span any head of the group ranks
///     high is kept.
///   - `sum`: the sum of the group's scores, Quest's bound of the group's summed logits.
/// On the synthetic workload (32K, budget 1/8) `max` keeps more of the exact attention mass (0.72
/// against 0.69) and gives the lower output error; `sum` recalls each query head's own top pages a
/// little better. docs/selectors.md has the measurements.
enum class group_combine { max, sum };

inline const char* to_string(group_combine c) noexcept { return c == group_combine::max ? "max" : "sum"; }

/// What a read-less selector keeps per block of a page to score it, and how it scores it:
///   - `bounds` (select::quest): the channel-wise min and max rows of the block's keys; the score is
///     Quest's upper bound of q . k, sum_c q_c (q_c >= 0 ? hi_c : lo_c). Two rows per block.
///   - `mean` (select::mean_keys): the mean key row (MosaicKV's per-block key); the score is
///     q . mean. One row per block.
/// Both are scored by `span_score`, `mean` as bounds with lo = hi = mean: the same canonical order
/// on both backends.
enum class block_summary { bounds, mean };

/// Stored rows per block of a summary.
constexpr int summary_rows(block_summary s) noexcept { return s == block_summary::bounds ? 2 : 1; }

namespace select {

/// The tokens a read-less selector may pick per (sequence, KV head) and step: `tokens` when it is
/// >= 0, else floor(`ratio` x the sequence's length). The dense tail, exact sink and window rows and (for sentence
/// chunks) the open chunk are read on top of it. A budget of 0 reads only those; a budget of the
/// whole context or more reads every token.
struct token_budget {
  double ratio = 1.0 / 16.0;  ///< fraction of the context, in [0, 1]
  std::int64_t tokens = -1;   ///< absolute budget in tokens; >= 0 overrides `ratio` (any value:
                              ///< one past the context reads it all)

  /// The budget for a sequence of `length` (>= 0) tokens: in [0, length] for a ratio (the
  /// product is clamped before its conversion to an integer, so no ratio or length overflows).
  std::int64_t resolve(std::int64_t length) const noexcept {
    if (tokens >= 0) return tokens;
    const double share = std::floor(ratio * static_cast<double>(length));
    if (!(share > 0.0)) return 0;  // also a NaN ratio (rejected by validate)
    return share >= static_cast<double>(length) ? length : static_cast<std::int64_t>(share);
  }
  /// Throws `invalid_argument` naming `budget.ratio` unless it is in [0, 1] (NaN is not). Every
  /// `tokens` is valid.
  void validate(const char* where) const {
    detail::require(ratio >= 0.0 && ratio <= 1.0, where, "budget.ratio", ratio, "0 to 1");
  }
  /// For `describe`: "N tokens"; "1/n" for a ratio that is the reciprocal of an integer n up to
  /// 2^31 - 1 (1/16); else "ratio x" (x to 6 significant digits, so "ratio 0" and "ratio 0.3").
  std::string describe() const {
    if (tokens >= 0) return std::to_string(tokens) + " tokens";
    if (ratio > 0.0 && ratio <= 1.0) {
      const double n = std::floor(1.0 / ratio + 0.5);  // infinite for a tiny ratio: then no n
      if (n <= 2147483647.0 && std::abs(ratio * n - 1.0) <= 1e-12) return "1/" + std::to_string(static_cast<long>(n));
    }
    return "ratio " + detail::to_text(ratio);
  }
};

}  // namespace select

namespace detail {

/// Lanes of the canonical score order (a warp).
inline constexpr int span_score_lanes = 32;

namespace span_score_detail {
/// The canonical order's lane sums (`span_score`): lane[l] for l < 32.
template <class Load>
inline void lane_sums(const float* q, int head_dim, Load& load, float* lane) {
  const int width = head_dim / span_score_lanes;
  for (int l = 0; l < span_score_lanes; ++l) {
    float s = 0.0f;
    for (int c = l * width; c < (l + 1) * width; ++c) {
      const auto bounds = load(c);
      s = std::fma(q[c], q[c] >= 0.0f ? bounds.second : bounds.first, s);  // rounded once, as the device's FFMA
    }
    lane[l] = s;
  }
}

// Where `std::fma` would be a C library call (core/fused.hpp), `lane_sums` is also compiled for FMA
// hardware and chosen at run time: the same bits.
#ifdef KVMOSAIC_FMA_DISPATCH
template <class Load>
__attribute__((target("fma"))) inline void lane_sums_fma(const float* q, int head_dim, Load& load, float* lane) {
  lane_sums(q, head_dim, load, lane);  // inlined: std::fma is one instruction under this target
}
#endif
}  // namespace span_score_detail

/// Quest's upper bound of q . k over keys k with lo[c] <= k[c] <= hi[c]:
///   sum_c max(q[c] * hi[c], q[c] * lo[c]) = sum_c q[c] * (q[c] >= 0 ? hi[c] : lo[c]),
/// computed as the right-hand side (one product per channel, the bound chosen by q's sign), in the
/// canonical order: lane l accumulates its channels l * w .. (l + 1) * w - 1 in turn by fused
/// multiply-adds (fp32, s = fma(q[c], bound, s) from s = 0), w = head_dim / 32, then lanes combine
/// by a butterfly (offsets 16, 8, 4, 2, 1). `load(c)` returns the pair (lo[c], hi[c]) as floats.
/// Cost: head_dim fused multiply-adds (one instruction each on FMA hardware, a C library call
/// elsewhere) and 31 additions.
template <class Load>
inline float span_score(const float* q, int head_dim, Load&& load) {
  float lane[span_score_lanes];
#ifdef KVMOSAIC_FMA_DISPATCH
  if (fma_hardware())
    span_score_detail::lane_sums_fma(q, head_dim, load, lane);
  else
#endif
    span_score_detail::lane_sums(q, head_dim, load, lane);
  for (int offset = span_score_lanes / 2; offset >= 1; offset /= 2) {
    float next[span_score_lanes];
    for (int l = 0; l < span_score_lanes; ++l) next[l] = lane[l] + lane[l ^ offset];
    std::copy(next, next + span_score_lanes, lane);
  }
  return lane[0];
}

/// Combines per-head scores of a group in the canonical order (heads 0, 1, ... in turn).
inline float combine_scores(const float* scores, int group, group_combine how) noexcept {
  float total = scores[0];
  for (int g = 1; g < group; ++g) total = how == group_combine::max ? (scores[g] > total ? scores[g] : total) : total + scores[g];
  return total;
}

/// The reference selection, which the device selection reproduces exactly: order the spans by
/// score (higher first; equal scores by lower index), take the longest prefix of that order whose
/// `weights` (token counts) sum to at most `budget`. Returns the chosen indices, ascending. NaN
/// scores sort last. Cost: O(n log n).
inline std::vector<std::int32_t> budget_prefix(const std::vector<float>& scores, const std::vector<std::int32_t>& weights,
                                               std::int64_t budget) {
  std::vector<std::int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](std::int32_t i) {
    const float s = scores[static_cast<std::size_t>(i)];
    return std::isnan(s) ? -INFINITY : s;
  };
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return key(a) > key(b); });
  std::vector<std::int32_t> chosen;
  std::int64_t used = 0;
  for (const std::int32_t i : order) {
    used += weights[static_cast<std::size_t>(i)];
    if (used > budget) break;
    chosen.push_back(i);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace detail
}  // namespace kvmosaic
