// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device half of the score-based selectors (`select::tova`, `select::h2o`):
///   - `token_scores_kernel`: a decode step's per-token attention scores (select/token_scores.hpp)
///     from the logits its split kernels wrote (`decode_params::token_logits`), normalized by each
///     query head's log-sum-exp over all the step's splits (written by the merge), filed by
///     logical position into each sequence's device score buffer (written, or added for
///     cumulative scores): no eager attention, no second pass over K, no copy to the host.
///   - `lowest_scored_kernel`: the eviction ranking (`detail::lowest_scored` on the host) over
///     those buffers: the lowest shared scores among a sequence's live sealed slots, by a radix
///     select on 64-bit keys (score, position), so that only the chosen slots leave the device.

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// One sequence slot's score storage (cuda/select/scored_eviction.cuh keeps a device table of
/// them, one per sequence slot).
struct score_slot {
  float* scores;           ///< [num_kv_heads][stride] fp32, by logical position
  std::int64_t stride;     ///< positions per head row
  std::int64_t* positions; ///< per sealed slot of the sequence, its logical position (-1: evicted)
};

/// Threads of a `token_scores_kernel` CTA.
inline constexpr int token_score_threads = 256;

namespace detail_scores {
/// The logical position of run row `i` (0 to exact rows held - 1) of the exact rows a sequence
/// with `sealed` sealed slots folds before its tail rows: the inverse of
/// `arena_geometry::exact_run_positions` (host/backend.hpp) for S sink rows and a ring of W
/// window rows. -1 where the run row holds no token.
__device__ __forceinline__ std::int64_t exact_run_position(std::int64_t i, std::int64_t sealed, int sinks, int window) {
  const std::int64_t region = sinks + window;
  const std::int64_t held = sealed < region ? sealed : region;
  const std::int64_t row = i + (region - held);  // its row in the tail head: the window ring, then the sinks
  if (row >= window) return row - window;
  const std::int64_t phase = window - 1 - row;  // the window position t has (t - S) mod W == phase
  const std::int64_t span = sealed - 1 - sinks - phase;
  if (span < 0) return -1;
  return sinks + phase + span / window * window;
}
}  // namespace detail_scores

/// For every row r of the read order of sequence b that the step covered (`decode_params::
/// token_logits`: its pages' rows, then its exact and tail rows) and every KV head: the combine
/// over the group's query heads j of exp(s_j - lse_j), lse_j being the head's log-sum-exp that
/// the merge wrote (`decode_params::lse`), written (or, `cumulative`, added) at the row's logical
/// position in the score buffer of the sequence's slot. A row the step masked (every logit -inf:
/// evicted, or a sealed row attended from its exact copy) keeps its score. Positions: a sealed
/// row's from its slot's `positions`; an exact row's from the format's geometry; tail row t's
/// tail_from[b] + t. `combine_max`: the group's largest probability, else their sum.
/// Grid: (CTAs per (sequence, KV head), num_kv_heads, batch), each striding over the rows.
/// Cost per row and KV head: 4 x Group bytes read, 4 written (8 moved when cumulative), Group exps.
template <int Group>
__global__ void __launch_bounds__(token_score_threads)
    token_scores_kernel(const decode_params p, const score_slot* slots, const std::int64_t* tail_from, bool combine_max,
                        bool cumulative) {
  detail::wait_for_prior_grid();  // the split kernel's logits, the merge's log-sum-exps
  const int head = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  float lse[Group];
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    const float x = p.lse[b * p.lse_strides[0] + (head * Group + g) * p.lse_strides[1]];
    lse[g] = x == -HUGE_VALF ? HUGE_VALF : x;  // no token read: every p is 0
  }
  const score_slot target = slots[p.tail_slots[b]];
  const std::int64_t sealed = static_cast<std::int64_t>(p.sealed_pages[b]) * p.page_size;
  const std::int64_t exact = sealed < p.exact_rows ? sealed : p.exact_rows;
  const std::int64_t rows = sealed + exact + p.tail_rows[b];
  const int window = p.exact_rows - p.sink_rows;
  const std::size_t base = (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots;
  const float* logits = p.token_logits + base * Group;
  float* out = target.scores + static_cast<std::size_t>(head) * target.stride;
  const std::int64_t first_tail = tail_from[b];
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * token_score_threads + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * token_score_threads) {
    std::int64_t position;
    if (r < sealed) {
      if (exact > 0 && (r < p.sink_rows || r >= sealed - window)) continue;  // folded from its exact copy
      position = target.positions[r];
    } else if (r < sealed + exact) {
      position = detail_scores::exact_run_position(r - sealed, sealed, p.sink_rows, window);
    } else {
      position = first_tail + (r - sealed - exact);
    }
    if (position < 0) continue;
    float s[Group];
    if constexpr (Group % 4 == 0) {
#pragma unroll
      for (int g = 0; g < Group; g += 4) {
        const float4 x = *reinterpret_cast<const float4*>(logits + r * Group + g);
        s[g] = x.x, s[g + 1] = x.y, s[g + 2] = x.z, s[g + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int g = 0; g < Group; ++g) s[g] = logits[r * Group + g];
    }
    float combined = 0.0f;
    bool read = false;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      read = read || s[g] != -HUGE_VALF;
      const float probability = s[g] == -HUGE_VALF ? 0.0f : expf(s[g] - lse[g]);
      combined = combine_max ? fmaxf(combined, probability) : combined + probability;
    }
    if (!read) continue;  // masked: evicted, or not this step's to score
    float& score = out[position];
    score = cumulative ? score + combined : combined;
  }
}

/// Threads of the `lowest_scored_kernel` CTA: one per radix bin, four times over.
inline constexpr int rank_threads = 1024;

/// What one eviction ranking reads and writes.
struct rank_params {
  score_slot target;             ///< the sequence's scores and slot positions
  int num_kv_heads;
  std::int64_t slots;            ///< sealed slots of the sequence
  std::int64_t first_evictable;  ///< candidates: live slots whose position is in [first_evictable, before)
  std::int64_t before;
  std::int64_t count;            ///< how many to choose (fewer when there are fewer candidates)
  unsigned long long* keys;      ///< scratch, [slots]
  std::int64_t* chosen;          ///< [count]: the chosen slots, in no particular order
  std::int32_t* chosen_count;    ///< [1]
};

namespace detail_scores {
/// A 64-bit key in the host ranking's order (`detail::lowest_ranked`): the shared score's order
/// bits above (lower first, NaN as +infinity, -0 as +0), the position below (earlier first).
__device__ __forceinline__ unsigned long long rank_key(float score, std::int64_t position) {
  if (score != score) score = HUGE_VALF;
  std::uint32_t u = __float_as_uint(score);
  if (score == 0.0f) u = 0u;
  u = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | static_cast<std::uint32_t>(position);
}
/// A slot that is not a candidate.
inline constexpr unsigned long long not_a_candidate = ~0ull;
}  // namespace detail_scores

/// The eviction ranking of one sequence: the `count` candidate slots with the lowest keys
/// (`rank_key` of the shared score, the sum over the KV heads in head order, as
/// `token_score_buffer::shared` sums on the host), marked evicted in `positions` (-1) and listed
/// in `chosen`. One CTA: a pass computes each slot's key into `keys`; then a radix select, 8 bits
/// at a time from the top, finds the count-th smallest key, stopping as soon as every key left
/// with the digits found so far is taken (keys are distinct: positions are). Cost: one read of the
/// slot positions and of num_kv_heads scores per candidate, 8 bytes per slot written, then up to
/// 8 passes over the keys (L2-resident at the lengths that matter).
template <int Threads = rank_threads>
__global__ void __launch_bounds__(Threads) lowest_scored_kernel(const rank_params p) {
  static_assert(Threads >= 256, "a thread per radix bin");
  __shared__ int histogram[256];
  __shared__ unsigned long long found;  // the digits found so far
  __shared__ int need;                  // how many of the keys with those digits to take
  __shared__ int taken;
  __shared__ int candidates;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) candidates = 0, taken = 0;
  __syncthreads();
  int mine = 0;
  for (std::int64_t r = tid; r < p.slots; r += Threads) {
    const std::int64_t position = p.target.positions[r];
    unsigned long long key = detail_scores::not_a_candidate;
    if (position >= p.first_evictable && position < p.before) {
      float total = 0.0f;
      for (int h = 0; h < p.num_kv_heads; ++h) total += p.target.scores[static_cast<std::size_t>(h) * p.target.stride + position];
      key = detail_scores::rank_key(total, position);
      ++mine;
    }
    p.keys[r] = key;
  }
  atomicAdd(&candidates, mine);
  __syncthreads();
  const int n = candidates;
  const int k = static_cast<int>(p.count < n ? p.count : n);
  if (k <= 0) {
    if (tid == 0) *p.chosen_count = 0;
    return;
  }
  // The threshold: every candidate key <= it is chosen (k of them).
  unsigned long long threshold = detail_scores::not_a_candidate - 1;
  if (k < n) {
    unsigned long long prefix = 0, mask = 0;
    if (tid == 0) need = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
      if (tid < 256) histogram[tid] = 0;
      __syncthreads();
      for (std::int64_t r = tid; r < p.slots; r += Threads) {
        const unsigned long long key = p.keys[r];
        if (key != detail_scores::not_a_candidate && (key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1);
      }
      __syncthreads();
      if (tid == 0) {  // the digit where the count runs out (256 bins: a serial scan is cheap next to the pass)
        int before = 0, digit = 0;
        while (before + histogram[digit] < need) before += histogram[digit++];
        found = static_cast<unsigned long long>(digit) << shift;
        need -= before;
        histogram[0] = histogram[digit];  // the keys with this digit: all taken when need equals it
      }
      __syncthreads();
      prefix |= found;
      mask |= 255ull << shift;
      const bool all_taken = histogram[0] == need;
      __syncthreads();
      if (all_taken) {
        threshold = prefix | ((1ull << shift) - 1);  // shift == 0: the prefix itself
        break;
      }
      threshold = prefix;
    }
  }
  for (std::int64_t r = tid; r < p.slots; r += Threads) {
    const unsigned long long key = p.keys[r];
    if (key != detail_scores::not_a_candidate && key <= threshold) {
      p.chosen[atomicAdd(&taken, 1)] = r;
      p.target.positions[r] = -1;
    }
  }
  __syncthreads();
  if (tid == 0) *p.chosen_count = taken;
}

}  // namespace kvmosaic::cuda::kernel
