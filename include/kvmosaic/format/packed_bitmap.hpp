// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap`: MosaicKV's stage-1 two-D compression, per-vector channel compression
/// in a rotated basis (Qiang et al., "MosaicKV: Serving Long-Context LLM with Dynamic Two-D KV
/// Cache Compression", sections 4.2, 5.1, 5.2, 5.3 and 5.5). Host part: the segment basis and
/// strategy, encode, decode, and the host attend on the packed form (PackedAttention's math).
///
/// Segments. A sequence's pages are cut into segments of `segment_tokens` tokens (64K by
/// default, the paper's prefill segment). Per segment and KV head, K and V each get a basis: the
/// eigenvectors of the segment's uncentered covariance sum_t x_t x_t^T (the right singular
/// vectors of the segment's matrix, the paper's "SVD rotation"), by decreasing eigenvalue, each
/// signed so that its largest-magnitude component is positive (one answer for one input). The
/// last `truncated` fraction of the rotated channels (the least variance) is never stored and has
/// no bit in the bitmap (channel truncation, 5.2); the first `kept` = head_dim (1 - truncated)
/// columns are the basis B ([head_dim][kept], fp32).
///
/// Per vector (5.1). y = x B; the kept channels form kept / g groups of g adjacent channels; the
/// r / g groups of largest energy sum y_c^2 (ties: the lower group) are kept, the others are
/// zero. A token's record is a bitmap of one bit per group (bit j of 32-bit word j / 32) and its
/// r retained values, in group order, rounded to the storage dtype (16-bit). Decode is
/// x^ = y^ B^T. Energy rather than the sum of |y_c| ranks groups of g > 1: it is the choice that
/// minimizes ||y - y^||, and equals magnitude order at g = 1.
///
/// Strategy (5.5). `strategy::fixed` (the default) uses `retained` and `group` for every segment.
/// `strategy::search` picks, per segment, KV head and K or V, the highest compression rate among
/// 87.5%, 75%, 62.5% retaining at most `retained`, then the largest g in {4, 2, 1}, whose loss
/// stays at or below `loss_threshold`; none passing, it keeps `retained` at g = 1. The loss of a
/// candidate is the segment's relative squared error, sum_t ||x_t - x^_t||^2 / sum_t ||x_t||^2
/// (truncated energy included), before the 16-bit rounding. The token block size of the mean
/// keys (stage 2, `block_tokens` of the segment) is the largest of 16, 8, 4 whose mean
/// intra-block key variance, relative to the mean squared key norm, is at most
/// `block_variance_threshold`. Differences from the paper (docs/packed_bitmap.md): channels keep
/// eigenvalue order (no reordering by selection pattern before grouping); a pool slot is sized
/// for `retained` at the smallest group, so a searched segment that keeps less reads fewer bytes
/// but frees no memory.
///
/// PackedAttention's math (5.3). The query is rotated once per segment, q' = q B_k; a score is
/// q' . y^_k over a record's set bits (no unpacked tile); p . y^_v accumulates in the rotated V
/// space ([G][kept]); the output is rotated back once per segment, o = o' B_v^T. Equal to
/// attention over the decoded vectors, up to fp32 rounding.
///
/// Page layout (one head, K or V): [bitmaps: page_size x words x u32][values: page_size x r_slot
/// x 16-bit] padded to 16 bytes; words = ceil(kept / g_slot / 32), where r_slot = `retained` x
/// head_dim and g_slot = `group` (fixed) or 1 (search). A record shorter than the slot (a
/// searched strategy) leaves the rest zero. Per segment and KV head: B_k and B_v in fp32 and the
/// strategy, `format_traits::segment_bytes`. At head_dim 128, 25% retained, 25% truncated, g = 1:
/// 76 bytes a token for K or V against dense 256 (3.37x), plus 2 x 48 KB of bases per 64K-token
/// segment and KV head (0.3% of the dense bytes).
///
/// Non-finite inputs: a NaN or infinity in a segment makes its covariance non-finite; the
/// segment then uses the identity basis (no rotation) and the non-finite values stay in the
/// records that select them, so only the outputs that read them are affected.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/fused.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/host/eigen.hpp"  // first: it configures Eigen for nvcc

#include <Eigen/Eigenvalues>

namespace kvmosaic {
namespace format {

/// How `packed_bitmap` chooses each segment's channel strategy.
enum class strategy {
  fixed,   ///< `retained` and `group` for every segment
  search,  ///< per segment, KV head, K and V: MosaicKV's candidate search (section 5.5)
};

/// MosaicKV's packed bitmap (sections 4-5): per segment a rotated basis, channel truncation,
/// and per vector the top groups by energy, stored as a bitmap and packed 16-bit values. Cost
/// per token (K or V): ceil(kept / g / 32) x 4 + retained x head_dim x 2 bytes. Encode: one
/// head_dim x kept product and a partial sort of kept / g groups per vector, plus per segment a
/// covariance (n x head_dim^2) and one eigendecomposition (head_dim^3). Attend: per segment one
/// rotation of the G queries and one of the G outputs (G x head_dim x kept each), per token r
/// multiply-adds per query head for q.k and for p.v. Source: MosaicKV, sections 4.2, 5.1-5.3, 5.5.
struct packed_bitmap {
  using policy_category = format_tag;
  float retained = 0.25f;        ///< channels a vector keeps, a fraction of head_dim (the paper: 25%); the slot's bound with `strategy::search`
  int group = 1;                 ///< g: adjacent rotated channels per bitmap bit, 1, 2 or 4
  float truncated = 0.25f;       ///< rotated channels never stored, a fraction of head_dim (the paper: the bottom 25%)
  int segment_tokens = 65536;    ///< tokens per segment (one basis per segment and KV head), a multiple of page_size
  strategy mode = strategy::fixed;
  float loss_threshold = 0.05f;  ///< `strategy::search`: the largest relative squared error a candidate may lose
  float block_variance_threshold = 0.5f;  ///< the largest relative intra-block key variance of a mean-key block
  int sink_tokens = 4;           ///< leading tokens always read exactly (0 to 16); 4 by measurement (docs/defaults.md)
  int recent_tokens = 0;         ///< latest sealed tokens always read exactly (0 to 1024), besides the tail
};

}  // namespace format

namespace detail {

/// One segment's choice for K or for V: r retained channels in groups of g.
struct packed_strategy {
  int retained = 0;  ///< r, a multiple of `group`
  int group = 1;     ///< g: 1, 2 or 4
};

/// A segment of one KV head: its K and V bases ([head_dim][kept], row-major, fp32), strategies,
/// and the token block size of its mean keys.
struct packed_segment {
  int kept = 0;
  std::vector<float> basis[2];  ///< [0]: K, [1]: V
  packed_strategy strategy[2];
  int block_tokens = 16;
};

/// Channel counts a format's fractions give at one head_dim.
struct packed_geometry {
  int head_dim = 0;
  int kept = 0;          ///< rotated channels stored (head_dim minus the truncated ones)
  int retained = 0;      ///< r of the slot
  int slot_group = 1;    ///< the smallest g the slot holds a bitmap for
  int words = 0;         ///< 32-bit bitmap words per record of the slot
  int page_size = 0;

  static packed_geometry of(const format::packed_bitmap& f, const page_shape& shape) {
    packed_geometry g;
    g.head_dim = shape.head_dim;
    g.page_size = shape.page_size;
    g.kept = shape.head_dim - static_cast<int>(std::lround(static_cast<double>(f.truncated) * shape.head_dim));
    g.retained = static_cast<int>(std::lround(static_cast<double>(f.retained) * shape.head_dim));
    g.slot_group = f.mode == format::strategy::fixed ? f.group : 1;
    g.words = bitmap_words(g.kept, g.slot_group);
    return g;
  }
  static int bitmap_words(int kept, int group) { return (kept / group + 31) / 32; }
  std::size_t bitmap_bytes() const { return static_cast<std::size_t>(page_size) * words * 4; }
  std::size_t page_bytes() const {
    const std::size_t bytes = bitmap_bytes() + static_cast<std::size_t>(page_size) * retained * 2;
    return (bytes + 15) / 16 * 16;
  }
  const std::uint32_t* bitmap(const std::byte* page, int t) const {
    return reinterpret_cast<const std::uint32_t*>(page) + static_cast<std::size_t>(t) * words;
  }
  std::uint32_t* bitmap(std::byte* page, int t) const {
    return reinterpret_cast<std::uint32_t*>(page) + static_cast<std::size_t>(t) * words;
  }
  std::size_t values_offset(int t) const { return bitmap_bytes() + static_cast<std::size_t>(t) * retained * 2; }
};

/// A segment's plan is made of sums over its rows that every backend computes in one order, so
/// that every backend fits the same bases, bit for bit: the segment's rows are cut into tiles of
/// `packed_sum_tile_rows` from its first row, each tile's sums run from zero in token order, and
/// the tiles' sums add up in tile order. Per KV head (`packed_sum_count` doubles, this layout):
///   [0, d^2)           K's covariance sum_t k_t k_t^T, row-major, the lower triangle (i >= j)
///                      (the upper one is zero);
///   [d^2, 2 d^2)       V's, the same;
///   [2 d^2, 2 d^2 + d) K's per-channel squared norms sum_t k_tc^2;
///   then 3 x d         K's per-channel intra-block squared deviations sum_t (k_tc - mean_c)^2 of
///                      the whole blocks of 16, 8 and 4 rows (blocks from the segment's first row;
///                      mean_c the block's fp64 sum in token order over its count; each term one
///                      fused multiply-add).
/// Every other term is a product of two fp32 values, exact in fp64, so a fused and an unfused
/// multiply-add give the same sum. The CUDA engine computes these sums on the device
/// (cuda/format/packed_bitmap/segment_sums.cuh) and only the eigendecompositions on the host.
inline constexpr int packed_sum_tile_rows = 2048;

KVMOSAIC_HOST_DEVICE constexpr std::size_t packed_sum_count(int head_dim) {
  return 2 * static_cast<std::size_t>(head_dim) * head_dim + 4 * static_cast<std::size_t>(head_dim);
}

/// The sums of one tile (`rows` <= packed_sum_tile_rows rows from a multiple of the tile size;
/// K and V [rows][head_dim]) into `out` (`packed_sum_count` doubles, overwritten), each from zero
/// in token order. Cost: head_dim (head_dim + 1) multiply-adds a row for each covariance, four
/// passes over K for the norms and deviations.
inline void packed_tile_sums(const float* k, const float* v, std::int64_t rows, int head_dim, double* out) {
  const std::size_t d = static_cast<std::size_t>(head_dim);  // unsigned offsets
  const auto n = static_cast<std::size_t>(std::min<std::int64_t>(rows, packed_sum_tile_rows));  // a tile at most
  std::fill(out, out + packed_sum_count(head_dim), 0.0);
  std::vector<double> x(4 * d);
  for (std::size_t which = 0; which < 2; ++which) {
    const float* in = which == 0 ? k : v;
    double* covariance = out + which * d * d;
    for (std::size_t t = 0; t < n; t += 4) {  // four rows at a time: each entry still adds them in token order
      const std::size_t m = std::min<std::size_t>(4, n - t);
      std::copy(in + t * d, in + (t + m) * d, x.begin());
      const double *x0 = x.data(), *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
      for (std::size_t i = 0; i < d; ++i) {
        double* row = covariance + i * d;
        if (m == 4) {
          for (std::size_t j = 0; j <= i; ++j) {
            double a = row[j];
            a += x0[i] * x0[j];
            a += x1[i] * x1[j];
            a += x2[i] * x2[j];
            a += x3[i] * x3[j];
            row[j] = a;
          }
        } else {
          for (std::size_t r = 0; r < m; ++r)
            for (std::size_t j = 0; j <= i; ++j) row[j] += x[r * d + i] * x[r * d + j];
        }
      }
    }
  }
  double* norms = out + 2 * d * d;
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t c = 0; c < d; ++c) norms[c] += static_cast<double>(k[t * d + c]) * k[t * d + c];
  const std::size_t sizes[3] = {16, 8, 4};
  for (std::size_t s = 0; s < 3; ++s) {
    const std::size_t b = sizes[s];
    double* deviations = norms + (1 + s) * d;
    for (std::size_t first = 0; first + b <= n; first += b)
      for (std::size_t c = 0; c < d; ++c) {
        double mean = 0;
        for (std::size_t t = 0; t < b; ++t) mean += k[(first + t) * d + c];
        mean /= static_cast<double>(b);
        for (std::size_t t = 0; t < b; ++t) {
          const double e = k[(first + t) * d + c] - mean;
          deviations[c] = std::fma(e, e, deviations[c]);
        }
      }
  }
}

/// A segment's sums (`out`: `packed_sum_count` doubles) from its K and V rows ([n][head_dim]):
/// the tiles' sums added in tile order to zero.
inline void packed_segment_sums(const float* k, const float* v, std::int64_t n, int head_dim, double* out) {
  const std::size_t count = packed_sum_count(head_dim);
  std::fill(out, out + count, 0.0);
  std::vector<double> tile(count);
  for (std::int64_t first = 0; first < n; first += packed_sum_tile_rows) {
    const std::int64_t offset = first * head_dim;
    packed_tile_sums(k + offset, v + offset, std::min<std::int64_t>(packed_sum_tile_rows, n - first), head_dim, tile.data());
    for (std::size_t e = 0; e < count; ++e) out[e] += tile[e];
  }
}

/// The basis of a segment of n rows from their covariance (`covariance`: [head_dim][head_dim],
/// the lower triangle read): the first `kept` eigenvectors (fp64) by decreasing eigenvalue, each
/// with its largest-magnitude component positive; [head_dim][kept] row-major. A non-finite
/// covariance or n = 0: the first `kept` columns of the identity.
/// A template (Real is double at every call), as are `packed_search` and `plan_segment`, so that
/// Eigen's eigensolver and products are instantiated only in the units that encode this format,
/// not in every unit that includes the library.
template <class Real>
std::vector<float> packed_basis(const Real* covariance, std::int64_t n, int head_dim, int kept) {
  using real_matrix = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>;
  std::vector<float> basis(static_cast<std::size_t>(head_dim) * kept, 0.0f);
  real_matrix sigma(head_dim, head_dim);
  bool finite = true;
  for (int i = 0; i < head_dim; ++i)
    for (int j = 0; j <= i; ++j) {
      const Real value = covariance[static_cast<std::size_t>(i) * head_dim + j];
      finite = finite && std::isfinite(value);
      sigma(i, j) = value;
      sigma(j, i) = value;
    }
  if (n == 0 || !finite) {
    for (int j = 0; j < kept; ++j) basis[static_cast<std::size_t>(j) * kept + j] = 1.0f;
    return basis;
  }
  const Eigen::SelfAdjointEigenSolver<real_matrix> solver(sigma);
  for (int j = 0; j < kept; ++j) {
    Eigen::Matrix<Real, Eigen::Dynamic, 1> column = solver.eigenvectors().col(head_dim - 1 - j);  // ascending eigenvalues
    Eigen::Index largest = 0;
    column.cwiseAbs().maxCoeff(&largest);
    if (column(largest) < 0) column = -column;
    for (int c = 0; c < head_dim; ++c) basis[static_cast<std::size_t>(c) * kept + j] = static_cast<float>(column(c));
  }
  return basis;
}

/// Each group's energy: energy[j] = the squares of y[j g .. j g + g) added in order from 0, for
/// the kept / g groups of y ([kept]). Each square is rounded to fp32 before it is added (the
/// product of two fp32 values is exact in fp64), so that no contraction into a fused
/// multiply-add changes the bits a device computes.
inline void packed_group_energies(const float* y, int kept, int group, std::vector<float>& energy) {
  energy.assign(static_cast<std::size_t>(kept / group), 0.0f);
  for (int j = 0; j < kept / group; ++j)
    for (int i = 0; i < group; ++i) {
      const double value = y[j * group + i];
      energy[static_cast<std::size_t>(j)] += static_cast<float>(value * value);
    }
}

/// The order a record ranks its groups in (a strict total order): NaN first (a record keeps what
/// it cannot judge), then higher energy, then the lower group.
struct packed_group_order {
  const float* energy;
  bool operator()(int a, int b) const {
    const float ea = energy[a], eb = energy[b];
    if (std::isnan(ea) != std::isnan(eb)) return std::isnan(ea);
    return ea > eb || (!(ea < eb) && a < b);
  }
};

/// The groups a record keeps: of the kept / g groups of y ([kept]), the r / g first in
/// `packed_group_order`, in increasing order, into `chosen`.
inline void packed_choose_groups(const float* y, int kept, const packed_strategy& s, std::vector<int>& order,
                                 std::vector<float>& energy, std::vector<int>& chosen) {
  const int keep = s.retained / s.group;
  packed_group_energies(y, kept, s.group, energy);
  order.resize(energy.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), packed_group_order{energy.data()});
  chosen.assign(order.begin(), order.begin() + keep);
  std::sort(chosen.begin(), chosen.end());
}

/// Adds to `stored[m]`, for each of `count` rates keeping `keep[m]` groups, the energies of the
/// groups that `packed_choose_groups` keeps of one row (`energy`, `groups` of them, no NaN), in
/// increasing group order. A rate keeps every group above its threshold, the keep-th largest
/// energy, and of those equal to it the lowest-numbered (`packed_group_order`). Up to 128 groups
/// each group's place in that order is counted without branches (G^2 comparisons, which the
/// compiler vectorizes); past that the thresholds come from selections (`std::nth_element`, from
/// the deepest rate down, each on the prefix the one before left), O(G) but branchy: each is the
/// faster there by measurement (benchmark/README.md, "packed_bitmap's strategy search without
/// branches"). The sums skip no group: a group a rate leaves adds 0, which leaves a sum of
/// non-negative energies as it was, bit for bit.
inline void packed_add_kept(const float* energy, int groups, const int* keep, int count, double* stored,
                            std::vector<int>& rank, std::vector<float>& selected) {
  if (groups <= 128) {
    rank.resize(static_cast<std::size_t>(groups));
    for (int j = 0; j < groups; ++j) {  // before j: higher or equal energy; from j on: higher
      const float ej = energy[j];
      int before = 0;
      for (int i = 0; i < j; ++i) before += static_cast<int>(energy[i] >= ej);
      for (int i = j + 1; i < groups; ++i) before += static_cast<int>(energy[i] > ej);
      rank[static_cast<std::size_t>(j)] = before;
    }
    for (int m = 0; m < count; ++m) {
      double sum = stored[m];
      for (int j = 0; j < groups; ++j) sum += rank[static_cast<std::size_t>(j)] < keep[m] ? static_cast<double>(energy[j]) : 0.0;
      stored[m] = sum;
    }
    return;
  }
  selected.assign(energy, energy + groups);
  int prefix = groups;
  for (int m = 0; m < count; ++m) {
    const auto nth = selected.begin() + (keep[m] - 1);
    std::nth_element(selected.begin(), nth, selected.begin() + prefix, std::greater<float>());
    const float threshold = *nth;
    // The groups equal to the threshold it keeps: keep less those above it.
    int ties = keep[m] - static_cast<int>(std::count_if(selected.begin(), nth, [&](float e) { return e > threshold; }));
    prefix = keep[m];
    double sum = stored[m];
    for (int j = 0; j < groups; ++j) {
      const bool tie = energy[j] == threshold;
      const bool take = energy[j] > threshold || (tie && ties > 0);
      ties -= static_cast<int>(tie);
      sum += take ? static_cast<double>(energy[j]) : 0.0;
    }
    stored[m] = sum;
  }
}

/// The strategy search's sums are made, like the plan's, in one order that every backend follows,
/// so that a device computes them in parallel and both backends choose the same strategies: the
/// segment's rows are cut into chunks of `packed_search_chunk_rows` from its first; each row is
/// rotated by `fused_rotate` (the device's chains), and its squared norm and, per candidate, the
/// energies of the groups it keeps are summed from zero (channels, then groups, in order); a
/// chunk adds its rows in order from zero, and the chunks add up in order. Per K or V matrix and
/// chunk, `packed_search_sum_count` doubles: the rows' squared norms, then each candidate's kept
/// energy in `packed_candidates`' order (zeros past its last).
inline constexpr int packed_search_chunk_rows = 64;
inline constexpr int packed_max_candidates = 9;  ///< `packed_candidates`: three rates, three group sizes
inline constexpr int packed_search_sum_count = 1 + packed_max_candidates;

/// A row's squared norm: sum_c x_c^2 from zero in channel order (fp64; each square exact).
inline double packed_row_norm(const float* x, int head_dim) {
  double sum = 0;
  for (int c = 0; c < head_dim; ++c) sum += static_cast<double>(x[c]) * x[c];
  return sum;
}

/// Sets `stored[i]`, for every candidate i of group size `group` (`candidates[i].group`), to the
/// energy it keeps of one chunk's rotated rows y ([rows][kept]) in the search's order: per row
/// what `packed_choose_groups` keeps, its groups' energies added in increasing group order from
/// zero, the rows added in order from zero. One pass over the rows for all rates of a group size
/// (`packed_add_kept`); a row with a NaN energy makes every rate's sum NaN. Cost per row: G^2
/// vectorized comparisons (G = kept / group <= 128) or three selections of G, and G steps a rate.
inline void packed_chunk_stored(const float* y, int rows, int kept, const std::vector<packed_strategy>& candidates, int group,
                                double* stored) {
  constexpr int max_rates = 3;  // `packed_candidates`: three rates at most a group size
  std::size_t rates[max_rates] = {};
  int keep[max_rates] = {}, count = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (candidates[i].group == group) {
      require(count < max_rates, "packed_chunk_stored", "candidates of one group size", count + 1, "at most 3");
      rates[count++] = i;
    }
  // Deepest first: the selections narrow from its groups (an insertion sort of at most three).
  for (int m = 1; m < count; ++m)
    for (int k = m; k > 0 && candidates[rates[k - 1]].retained < candidates[rates[k]].retained; --k) std::swap(rates[k - 1], rates[k]);
  for (int m = 0; m < count; ++m) keep[m] = candidates[rates[m]].retained / group;
  const int groups = kept / group;
  std::vector<float> energy, selected;
  std::vector<int> rank;
  double chunk[max_rates] = {};
  for (int t = 0; t < rows; ++t) {
    double row[max_rates] = {};
    packed_group_energies(y + static_cast<std::size_t>(t) * kept, kept, group, energy);
    if (std::any_of(energy.begin(), energy.end(), [](float e) { return std::isnan(e); }))
      for (double& sum : row) sum = std::numeric_limits<double>::quiet_NaN();
    else
      packed_add_kept(energy.data(), groups, keep, count, row, rank, selected);
    for (int m = 0; m < count; ++m) chunk[m] += row[m];
  }
  for (int m = 0; m < count; ++m) stored[rates[m]] = chunk[m];
}

/// A candidate's loss, the relative squared error (total - kept) / total, from the rows' squared
/// norms (the truncated energy counts as lost) and the energy it keeps: 0 for a zero segment.
inline double packed_loss(double total, double kept) { return total > 0 ? std::max(0.0, (total - kept) / total) : 0.0; }

/// The strategies `strategy::search` tries, in the order it tries them: rate first (87.5%, 75%,
/// 62.5% compression: 1/8, 2/8, 3/8 of head_dim retained, none above the slot's r), then g = 4,
/// 2, 1 (a g that does not divide kept, r and the slot's r is skipped: a record then starts on a
/// whole group, which the CUDA kernel loads at once).
inline std::vector<packed_strategy> packed_candidates(const packed_geometry& g) {
  std::vector<packed_strategy> candidates;
  for (const int eighths : {1, 2, 3}) {
    const int r = g.head_dim * eighths / 8;
    if (r > g.retained) continue;
    for (const int group : {4, 2, 1})
      if (g.kept % group == 0 && r % group == 0 && g.retained % group == 0) candidates.push_back({r, group});
  }
  return candidates;
}

/// The search's first pass over one K or V matrix of a segment (n rows [n][head_dim], its basis
/// [head_dim][kept]): the rows rotated into y ([n][kept], `fused_rotate`), and each chunk's sums
/// (`sums`: [chunks][stride]) set to its rows' squared norms, then zeros. Cost per row: head_dim x
/// kept fused multiply-adds.
template <class Float>
void packed_search_rotate(const packed_geometry& g, const Float* rows, std::int64_t n, const std::vector<float>& basis, float* y,
                          double* sums, std::size_t stride) {
  for (std::int64_t first = 0, chunk = 0; first < n; first += packed_search_chunk_rows, ++chunk) {
    double* out = sums + static_cast<std::size_t>(chunk) * stride;
    std::fill(out, out + packed_search_sum_count, 0.0);
    for (std::int64_t t = first; t < std::min<std::int64_t>(n, first + packed_search_chunk_rows); ++t) {
      out[0] += packed_row_norm(rows + static_cast<std::size_t>(t) * g.head_dim, g.head_dim);
      fused_rotate(rows + static_cast<std::size_t>(t) * g.head_dim, g.head_dim, basis.data(), g.kept, y + static_cast<std::size_t>(t) * g.kept);
    }
  }
}

/// The search's pass for the candidates of group size `group` over rotated rows y ([n][kept]):
/// each chunk's sums (`packed_chunk_stored`) into its entries 1 + i. Cost per row: as
/// `packed_chunk_stored`'s.
inline void packed_search_pass(const float* y, std::int64_t n, int kept, const std::vector<packed_strategy>& candidates, int group,
                               double* sums, std::size_t stride) {
  for (std::int64_t first = 0, chunk = 0; first < n; first += packed_search_chunk_rows, ++chunk)
    packed_chunk_stored(y + static_cast<std::size_t>(first) * kept, static_cast<int>(std::min<std::int64_t>(packed_search_chunk_rows, n - first)),
                        kept, candidates, group, sums + static_cast<std::size_t>(chunk) * stride + 1);
}

/// Entry `index` of every chunk's sums (`sums` [chunks][stride]) added in chunk order.
inline double packed_chunks_added(const double* sums, std::size_t stride, std::int64_t chunks, int index) {
  double sum = 0;
  for (std::int64_t c = 0; c < chunks; ++c) sum += sums[static_cast<std::size_t>(c) * stride + index];
  return sum;
}

/// The search's sums of one K or V matrix of a segment for every candidate of
/// `packed_candidates(g)`, into `sums` ([chunks][stride]: each chunk's `packed_search_sum_count`
/// doubles at its start), in the search's order: what a device computes
/// (cuda/format/packed_bitmap/search_sums.cuh). Cost: `packed_search_rotate` and a pass per group
/// size; n x kept floats of scratch.
template <class Float>
void packed_search_sums(const packed_geometry& g, const Float* rows, std::int64_t n, const std::vector<float>& basis, double* sums,
                        std::size_t stride) {
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  std::vector<float> y(static_cast<std::size_t>(n) * g.kept);
  packed_search_rotate(g, rows, n, basis, y.data(), sums, stride);
  for (const int group : {4, 2, 1})
    if (std::any_of(candidates.begin(), candidates.end(), [&](const packed_strategy& c) { return c.group == group; }))
      packed_search_pass(y.data(), n, g.kept, candidates, group, sums, stride);
}

/// The strategy of one K or V matrix of a segment from its search's sums (`packed_search_sums`,
/// or a device's: [chunks][stride], the chunks of n rows): `strategy::fixed`'s, or the first
/// candidate whose loss (the chunks' sums added in order) is at most `loss_threshold`, else the
/// slot's (r, g = 1).
inline packed_strategy packed_search_from_sums(const format::packed_bitmap& f, const packed_geometry& g, std::int64_t n,
                                               const double* sums, std::size_t stride) {
  if (f.mode == format::strategy::fixed) return {g.retained, f.group};
  const packed_strategy fallback{g.retained, 1};
  if (n == 0) return fallback;
  const std::int64_t chunks = (n + packed_search_chunk_rows - 1) / packed_search_chunk_rows;
  const double total = packed_chunks_added(sums, stride, chunks, 0);
  if (!std::isfinite(total)) return fallback;
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (packed_loss(total, packed_chunks_added(sums, stride, chunks, 1 + static_cast<int>(i))) <= f.loss_threshold) return candidates[i];
  return fallback;
}

/// The strategy of one K or V matrix of a segment from its rows: what `packed_search_from_sums`
/// chooses from `packed_search_sums`, bit for bit, with each group size's pass made only when one
/// of its candidates is tried.
template <class Float>
packed_strategy packed_search(const format::packed_bitmap& f, const packed_geometry& g, const Float* rows,
                              std::int64_t n, const std::vector<float>& basis) {
  if (f.mode == format::strategy::fixed || n == 0) return packed_search_from_sums(f, g, n, nullptr, 0);
  const packed_strategy fallback{g.retained, 1};
  const std::int64_t chunks = (n + packed_search_chunk_rows - 1) / packed_search_chunk_rows;
  constexpr std::size_t stride = packed_search_sum_count;
  std::vector<double> sums(static_cast<std::size_t>(chunks) * stride);
  std::vector<float> y(static_cast<std::size_t>(n) * g.kept);
  packed_search_rotate(g, rows, n, basis, y.data(), sums.data(), stride);
  const double total = packed_chunks_added(sums.data(), stride, chunks, 0);
  if (!std::isfinite(total)) return fallback;
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  bool passed[5] = {};  // by group size
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const int group = candidates[i].group;
    if (!passed[group]) packed_search_pass(y.data(), n, g.kept, candidates, group, sums.data(), stride);
    passed[group] = true;
    if (packed_loss(total, packed_chunks_added(sums.data(), stride, chunks, 1 + static_cast<int>(i))) <= f.loss_threshold) return candidates[i];
  }
  return fallback;
}

/// The mean-key block size of a segment of n rows from its K sums (`norms` [head_dim], then
/// `deviations` [3][head_dim] for blocks of 16, 8, 4; `packed_segment_sums`): the largest of 16, 8,
/// 4 whose intra-block variance (the deviations summed over channels in order, over the rows of
/// whole blocks), relative to the mean squared key norm, is at most `threshold` (4 when none; 16
/// for fewer than 4 rows or a zero segment).
inline int packed_block_tokens(const double* norms, std::int64_t n, int head_dim, float threshold) {
  double norm = 0;
  for (int c = 0; c < head_dim; ++c) norm += norms[c];
  if (n < 4 || !(norm > 0) || !std::isfinite(norm)) return 16;
  norm /= static_cast<double>(n);
  const int sizes[3] = {16, 8, 4};
  for (int s = 0; s < 3; ++s) {
    double variance = 0;
    for (int c = 0; c < head_dim; ++c) variance += norms[static_cast<std::size_t>(1 + s) * head_dim + c];
    const std::int64_t counted = n / sizes[s] * sizes[s];
    if (counted > 0 && variance / static_cast<double>(counted) / norm <= threshold) return sizes[s];
  }
  return 4;
}

}  // namespace detail

template <>
struct format_traits<format::packed_bitmap> {
  using format_type = format::packed_bitmap;
  using segment = detail::packed_segment;
  static constexpr const char* name = "packed_bitmap";
  static constexpr bool has_segments = true;

  static std::string describe(const format_type& f) {
    char text[160];
    std::snprintf(text, sizeof(text), "packed_bitmap(retained%g,g%d,truncated%g,segment%d%s", static_cast<double>(f.retained),
                  f.group, static_cast<double>(f.truncated), f.segment_tokens, f.mode == format::strategy::search ? ",search" : "");
    return std::string(text) + detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens) + ")";
  }

  static void validate(const format_type& f, const page_shape& shape) {
    const char* where = "format::packed_bitmap";
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage", to_string(shape.storage), "f16 or bf16");
    detail::require(f.group == 1 || f.group == 2 || f.group == 4, where, "group", f.group, "1, 2 or 4");
    detail::require(f.truncated >= 0.0f && f.truncated < 1.0f, where, "truncated", f.truncated,
                    "0 <= truncated < 1 (a truncation of every channel leaves nothing)");
    const double kept_exact = (1.0 - static_cast<double>(f.truncated)) * shape.head_dim;
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    detail::require(std::abs(kept_exact - g.kept) < 1e-3 && g.kept >= 1, where, "truncated", f.truncated,
                    "a fraction leaving a whole number (>= 1) of head_dim's channels");
    detail::require(g.kept % f.group == 0, where, "group", f.group, "a divisor of the kept channel count");
    detail::require(f.retained > 0.0f && std::abs(static_cast<double>(f.retained) * shape.head_dim - g.retained) < 1e-3 &&
                        g.retained >= 1, where, "retained", f.retained, "a fraction giving a whole number (>= 1) of channels");
    detail::require(g.retained <= g.kept, where, "retained", f.retained, "at most 1 - truncated (the kept channels)");
    detail::require(g.retained % f.group == 0, where, "retained", f.retained, "a whole number of groups of `group` channels");
    detail::require(f.segment_tokens >= shape.page_size && f.segment_tokens % shape.page_size == 0, where, "segment_tokens",
                    f.segment_tokens, "a positive multiple of page_size");
    detail::require(f.mode == format::strategy::fixed || f.mode == format::strategy::search, where, "mode",
                    static_cast<int>(f.mode), "strategy::fixed or strategy::search");
    detail::require(f.loss_threshold >= 0.0f && f.loss_threshold <= 1.0f, where, "loss_threshold", f.loss_threshold, "0 to 1");
    detail::require(f.block_variance_threshold >= 0.0f, where, "block_variance_threshold", f.block_variance_threshold, ">= 0");
    detail::require(shape.head_dim <= 256, where, "head_dim", shape.head_dim, "at most 256 (block keys index channels in 8 bits)");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
  }
  static int sink_rows(const format_type& f) { return f.sink_tokens; }
  static int window_rows(const format_type& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format_type& f, const page_shape& shape) {
    return detail::packed_geometry::of(f, shape).page_bytes();
  }
  static std::size_t v_page_bytes(const format_type& f, const page_shape& shape) { return k_page_bytes(f, shape); }

  /// Pages per segment.
  static int segment_pages(const format_type& f, const page_shape& shape) { return f.segment_tokens / shape.page_size; }
  /// Channels of the rotated space (the query and output of a segment's attend have this many).
  static int basis_dim(const format_type& f, const page_shape& shape) { return detail::packed_geometry::of(f, shape).kept; }
  /// Bytes one segment keeps per KV head besides its pages: B_k and B_v in fp32 and the two
  /// strategies and block size (3 x 2 x 4 bytes).
  static std::size_t segment_bytes(const format_type& f, const page_shape& shape) {
    return 2 * static_cast<std::size_t>(shape.head_dim) * basis_dim(f, shape) * 4 + 24;
  }

  /// The segment of one KV head from its K and V rows ([n][head_dim], the rows the basis is fit
  /// to): bases, strategies (searched or fixed) and mean-key block size, from the rows' sums
  /// (`segment_sums`) and, with `strategy::search`, the rows. Cost: the sums (2 n head_dim^2
  /// multiply-adds), 2 eigendecompositions, and with `strategy::search` up to 9 candidate passes
  /// over the n rotated rows.
  template <class Float>  // float: a template only to defer Eigen's instantiation (detail::packed_basis)
  static segment plan_segment(const format_type& f, const page_shape& shape, const Float* k, const Float* v, std::int64_t n) {
    std::vector<double> sums(segment_sum_count(f, shape));
    detail::packed_segment_sums(k, v, n, shape.head_dim, sums.data());
    return plan_segment_from_sums(f, shape, sums.data(), n, k, v);
  }

  // A plan from sums (an optional part of a format with segments, which a device may compute):
  // the CUDA engine computes a segment's sums on the device, in the order `segment_sums`
  // defines, and copies back only them (and the rows, when `plan_reads_rows`).

  /// Doubles of one segment's sums per KV head (`detail::packed_segment_sums` says what they are).
  static std::size_t segment_sum_count(const format_type&, const page_shape& shape) { return detail::packed_sum_count(shape.head_dim); }
  /// Rows of a tile of the sums: each tile's sums run from zero, and tiles add up in order.
  static constexpr int segment_sum_tile_rows = detail::packed_sum_tile_rows;
  /// The sums of a segment's rows K and V ([n][head_dim]) into `out` (`segment_sum_count`).
  static void segment_sums(const format_type&, const page_shape& shape, const float* k, const float* v, std::int64_t n, double* out) {
    detail::packed_segment_sums(k, v, n, shape.head_dim, out);
  }
  /// Whether the plan reads the rows besides their sums: `strategy::search` (its candidate passes).
  static bool plan_reads_rows(const format_type& f) { return f.mode == format::strategy::search; }
  /// The segment of one KV head from its n rows' sums (`segment_sums`) and, when
  /// `plan_reads_rows`, its rows. With k and v null the strategies a search would choose are left
  /// to `search_segment_from_sums` (the slot's r at g = 1 until then). Cost: 2 eigendecompositions
  /// (head_dim^3) and the search's passes.
  template <class Float>
  static segment plan_segment_from_sums(const format_type& f, const page_shape& shape, const double* sums, std::int64_t n,
                                        const Float* k, const Float* v) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const int d = shape.head_dim;
    segment s;
    s.kept = g.kept;
    for (int which = 0; which < 2; ++which) {
      s.basis[which] = detail::packed_basis(sums + static_cast<std::size_t>(which) * d * d, n, d, g.kept);
      const Float* rows = which == 0 ? k : v;
      s.strategy[which] = plan_reads_rows(f) && rows == nullptr ? detail::packed_strategy{g.retained, 1}
                                                                : detail::packed_search(f, g, rows, n, s.basis[which]);  // fixed: reads no row
    }
    s.block_tokens = detail::packed_block_tokens(sums + 2 * static_cast<std::size_t>(d) * d, n, d, f.block_variance_threshold);
    return s;
  }

  // The search from sums (an optional part of a format whose plan reads rows): a device computes
  // the search's sums over a segment's rows in the segment's bases, in the order
  // `detail::packed_search_chunk_rows` defines, and copies back only them.

  /// Rows of a chunk of the search's sums.
  static constexpr int segment_search_chunk_rows = detail::packed_search_chunk_rows;
  /// Doubles of the search's sums per KV head and chunk: K's, then V's
  /// (`detail::packed_search_sum_count` each).
  static std::size_t segment_search_sum_count(const format_type&, const page_shape&) { return 2 * detail::packed_search_sum_count; }
  /// The strategies of a segment planned without rows (`plan_segment_from_sums`) from the search's
  /// sums of its n rows (`sums`: [chunks][segment_search_sum_count]): those `plan_segment_from_sums`
  /// chooses from the rows, bit for bit. Cost: 2 x 10 sums over the chunks.
  static void search_segment_from_sums(const format_type& f, const page_shape& shape, segment& s, std::int64_t n, const double* sums) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const std::size_t stride = segment_search_sum_count(f, shape);
    for (int which = 0; which < 2; ++which)
      s.strategy[which] = detail::packed_search_from_sums(f, g, n, sums + static_cast<std::size_t>(which) * detail::packed_search_sum_count, stride);
  }

  static void encode_k(const format_type& f, const page_shape& shape, const segment& s, const float* rows, std::byte* page) {
    encode(f, shape, s, 0, rows, page);
  }
  static void encode_v(const format_type& f, const page_shape& shape, const segment& s, const float* rows, std::byte* page) {
    encode(f, shape, s, 1, rows, page);
  }
  /// x^ = y^ B^T for the first n records.
  static void decode_k(const format_type& f, const page_shape& shape, const segment& s, const std::byte* page, int n, float* rows) {
    decode(f, shape, s, 0, page, n, rows);
  }
  static void decode_v(const format_type& f, const page_shape& shape, const segment& s, const std::byte* page, int n, float* rows) {
    decode(f, shape, s, 1, page, n, rows);
  }

  /// q' = q B_k: the G queries ([G][head_dim]) in the segment's K basis ([G][kept]).
  static void enter_segment(const format_type&, const page_shape& shape, const segment& s, const float* q, int groups, float* q_basis) {
    host::row_matrix_map(q_basis, groups, s.kept).noalias() =
        host::const_row_matrix_map(q, groups, shape.head_dim) * host::const_row_matrix_map(s.basis[0].data(), shape.head_dim, s.kept);
  }
  /// o = o' B_v^T: the G outputs of a segment ([G][kept], rotated V space) back in head_dim.
  static void leave_segment(const format_type&, const page_shape& shape, const segment& s, const float* o_basis, int groups, float* o) {
    host::row_matrix_map(o, groups, shape.head_dim).noalias() =
        host::const_row_matrix_map(o_basis, groups, s.kept) *
        host::const_row_matrix_map(s.basis[1].data(), shape.head_dim, s.kept).transpose();
  }

  /// logits[g][t] = q'[g] . y^_t over record t's set bits, for the first n records. Cost: r
  /// multiply-adds per token and query head, plus one pass over the bitmap.
  static void score(const format_type& f, const page_shape& shape, const segment& s, const std::byte* k_page, int n,
                    const float* q_basis, int groups, float* logits) {
    for_each_record(f, shape, s, 0, k_page, n, [&](int t, int channel, float value) {
      for (int g = 0; g < groups; ++g) logits[static_cast<std::size_t>(g) * n + t] += q_basis[static_cast<std::size_t>(g) * s.kept + channel] * value;
    }, [&](int t) {
      for (int g = 0; g < groups; ++g) logits[static_cast<std::size_t>(g) * n + t] = 0.0f;
    });
  }
  /// o'[g] += sum_t p[g][t] y^_t (rotated V space, [G][kept]) for the first n records.
  static void accumulate(const format_type& f, const page_shape& shape, const segment& s, const std::byte* v_page, int n,
                         const float* p, int groups, float* o_basis) {
    for_each_record(f, shape, s, 1, v_page, n, [&](int t, int channel, float value) {
      for (int g = 0; g < groups; ++g)
        o_basis[static_cast<std::size_t>(g) * s.kept + channel] += p[static_cast<std::size_t>(g) * n + t] * value;
    }, [](int) {});
  }

  // Block keys: MosaicKV's per-block keys, "channel-compressed together with the original K
  // vectors" (section 5.2), which `select::mean_keys` keeps and scores in place of dense rows.
  static constexpr bool has_block_keys = true;

  /// Bytes of one block key of one KV head (`block_key_layout` of the slot's r pairs): 96 at
  /// head_dim 128 and 25% retained, against 256 for a dense mean row.
  static std::size_t block_key_bytes(const format_type& f, const page_shape& shape) {
    return static_cast<std::size_t>(block_key_layout{detail::packed_geometry::of(f, shape).retained}.bytes());
  }

  /// The (channel, value) pairs a block key holds: the slot's r.
  static int block_key_values(const format_type& f, const page_shape& shape) { return detail::packed_geometry::of(f, shape).retained; }

  /// The block key of a block's fp32 mean key ([head_dim]) in segment `s`: y = mean B_k (each
  /// rotated channel summed over the head_dim channels in order by fused multiply-adds:
  /// `detail::fused_rotate`, the device's order), the r / g groups of largest energy under the
  /// segment's K strategy (`packed_choose_groups`, as a key's record), stored as each kept
  /// channel's index and value in channel order, the values rounded to the storage dtype; a
  /// strategy with fewer than the slot's r leaves the rest zero (index 0, value 0). Cost: head_dim
  /// x kept fused multiply-adds and a partial sort of kept / g groups.
  static void encode_block_key(const format_type& f, const page_shape& shape, const segment& s, const float* mean, std::byte* key) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const detail::packed_strategy& st = s.strategy[0];
    std::vector<float> y(static_cast<std::size_t>(s.kept)), values(static_cast<std::size_t>(g.retained), 0.0f);
    detail::fused_rotate(mean, shape.head_dim, s.basis[0].data(), s.kept, y.data());
    std::vector<int> order, chosen;
    std::vector<float> energy;
    detail::packed_choose_groups(y.data(), s.kept, st, order, energy, chosen);
    std::memset(key, 0, block_key_bytes(f, shape));
    auto* channels = reinterpret_cast<std::uint8_t*>(key);
    std::size_t at = 0;
    for (const int j : chosen)
      for (int i = 0; i < st.group; ++i, ++at) {
        channels[at] = static_cast<std::uint8_t>(j * st.group + i);
        values[at] = y[static_cast<std::size_t>(j * st.group + i)];
      }
    detail::store_dense_rows(shape.storage, values.data(), values.size(), key + block_key_layout{g.retained}.values_offset());
  }

  /// The G queries ([G][head_dim]) in segment `s`'s K basis for scoring its block keys
  /// ([G][kept]): q' = q B_k in `encode_block_key`'s order. Cost: G x head_dim x kept fused
  /// multiply-adds.
  static void block_key_query(const format_type&, const page_shape& shape, const segment& s, const float* q, int groups,
                              float* q_key) {
    for (int g = 0; g < groups; ++g)
      detail::fused_rotate(q + static_cast<std::size_t>(g) * shape.head_dim, shape.head_dim, s.basis[0].data(), s.kept,
                           q_key + static_cast<std::size_t>(g) * s.kept);
  }

  /// q' . y^ of one query (`block_key_query`'s, [kept]) and a block key: q'[channel] x value
  /// over the slot's r pairs (zeros included) in stored order by fused multiply-adds from 0.
  /// Cost: r fused multiply-adds.
  static float score_block_key(const format_type& f, const page_shape& shape, const float* q_key, const std::byte* key) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    float values[256];  // r <= head_dim <= 256 (validate)
    detail::load_dense_rows(shape.storage, key + block_key_layout{g.retained}.values_offset(), static_cast<std::size_t>(g.retained),
                            values);
    const auto* channels = reinterpret_cast<const std::uint8_t*>(key);
    float sum = 0.0f;
    for (int v = 0; v < g.retained; ++v) sum = std::fma(q_key[channels[v]], values[v], sum);
    return sum;
  }

 private:
  static void encode(const format_type& f, const page_shape& shape, const segment& s, int which, const float* rows, std::byte* page) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const detail::packed_strategy& st = s.strategy[which];
    const int p = shape.page_size;
    std::memset(page, 0, g.page_bytes());
    std::vector<float> y(static_cast<std::size_t>(p) * g.kept);
    host::row_matrix_map(y.data(), p, g.kept).noalias() =
        host::const_row_matrix_map(rows, p, shape.head_dim) * host::const_row_matrix_map(s.basis[which].data(), shape.head_dim, g.kept);
    std::vector<int> order, chosen;
    std::vector<float> energy, values(static_cast<std::size_t>(st.retained));
    for (int t = 0; t < p; ++t) {
      const float* row = y.data() + static_cast<std::size_t>(t) * g.kept;
      detail::packed_choose_groups(row, g.kept, st, order, energy, chosen);
      std::uint32_t* bits = g.bitmap(page, t);
      std::size_t at = 0;
      for (const int j : chosen) {
        bits[j / 32] |= std::uint32_t{1} << (j % 32);
        for (int i = 0; i < st.group; ++i) values[at++] = row[j * st.group + i];
      }
      detail::store_dense_rows(shape.storage, values.data(), values.size(), page + g.values_offset(t));
    }
  }

  static void decode(const format_type& f, const page_shape& shape, const segment& s, int which, const std::byte* page, int n, float* rows) {
    std::vector<float> y(static_cast<std::size_t>(n) * s.kept, 0.0f);
    for_each_record(f, shape, s, which, page, n,
                    [&](int t, int channel, float value) { y[static_cast<std::size_t>(t) * s.kept + channel] = value; }, [](int) {});
    host::row_matrix_map(rows, n, shape.head_dim).noalias() =
        host::const_row_matrix_map(y.data(), n, s.kept) *
        host::const_row_matrix_map(s.basis[which].data(), shape.head_dim, s.kept).transpose();
  }

  /// Calls start(t) then visit(t, channel, value) for every stored value of records [0, n).
  template <class Visit, class Start>
  static void for_each_record(const format_type& f, const page_shape& shape, const segment& s, int which, const std::byte* page,
                              int n, Visit&& visit, Start&& start) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const int group = s.strategy[which].group, words = detail::packed_geometry::bitmap_words(g.kept, group);
    std::vector<float>& values = detail::host_scratch(static_cast<std::size_t>(s.strategy[which].retained));
    for (int t = 0; t < n; ++t) {
      start(t);
      detail::load_dense_rows(shape.storage, page + g.values_offset(t), static_cast<std::size_t>(s.strategy[which].retained), values.data());
      const std::uint32_t* bits = g.bitmap(page, t);
      std::size_t at = 0;
      for (int w = 0; w < words; ++w)
        for (std::uint32_t word = bits[w]; word != 0; word &= word - 1) {
          const int j = w * 32 + lowest_bit(word);
          for (int i = 0; i < group; ++i) visit(t, j * group + i, values[at++]);
        }
    }
  }
  static int lowest_bit(std::uint32_t word) noexcept {
#if defined(__GNUC__)
    return __builtin_ctz(word);
#else
    int bit = 0;
    while ((word & 1u) == 0) {
      word >>= 1;
      ++bit;
    }
    return bit;
#endif
  }
};

namespace detail {
/// A moved token is re-encoded in its new page's segment basis.
template <>
struct reencodes_moved_rows<format::packed_bitmap> : std::true_type {};
}  // namespace detail

}  // namespace kvmosaic
