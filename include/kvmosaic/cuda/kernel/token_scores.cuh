// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device half of the score-based selectors (`select::tova`, `select::h2o`):
///   - `token_scores_kernel`: a decode step's per-token attention scores (select/token_scores.hpp)
///     from the logits its split kernels wrote (`decode_params::token_logits`), normalized by each
///     query head's log-sum-exp over all the step's splits (written by the merge), filed by
///     logical position into each sequence's device score buffer (written, or added for
///     cumulative scores): no eager attention, no second pass over K, no copy to the host.
///   - `rank_keys_kernel`, `lowest_scored_kernel`: the eviction ranking (`detail::lowest_scored`
///     on the host) over those buffers, for a batch of sequences: the lowest shared scores among
///     each sequence's live sealed slots, by a radix select on 64-bit keys (score, position), so
///     that only the chosen slots leave the device.

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

/// One sequence's eviction ranking (`rank_keys_kernel`, `lowest_scored_kernel`).
struct rank_request {
  score_slot target;             ///< the sequence's scores and slot positions
  std::int64_t slots;            ///< sealed slots of the sequence
  std::int64_t first_evictable;  ///< candidates: live slots whose position is in [first_evictable, before)
  std::int64_t before;
  std::int64_t count;            ///< how many to choose (fewer when there are fewer candidates)
  std::int64_t keys;             ///< offset of its keys in `rank_params::keys` ([slots])
};

/// A batch of rankings. Per request r: 256 histogram bins and a candidate count (zeroed by the
/// caller), and `chosen` [r][1 + chosen_stride]: the number chosen, then the chosen slots.
struct rank_params {
  const rank_request* requests;
  int num_kv_heads;
  unsigned long long* keys;
  int* histograms;               ///< [requests][256]: the keys' top digits
  int* candidates;               ///< [requests]
  std::int64_t* chosen;
  std::int64_t chosen_stride;
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

/// Threads of a `rank_keys_kernel` CTA.
inline constexpr int rank_key_threads = 256;

/// Each slot's key (`rank_key` of its shared score, the sum over the KV heads in head order as
/// `token_score_buffer::shared` sums on the host; `not_a_candidate` for a slot that is not one),
/// the candidates counted and their keys' top 8 bits in the request's histogram. Grid: (CTAs per
/// request, requests), each striding over its request's slots. Cost: per slot 8 bytes read, 8
/// written, and num_kv_heads scores read per candidate.
template <int Threads = rank_key_threads>
__global__ void __launch_bounds__(Threads) rank_keys_kernel(const rank_params p) {
  __shared__ int histogram[256];
  __shared__ int candidates;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < 256; i += Threads) histogram[i] = 0;
  if (tid == 0) candidates = 0;
  __syncthreads();
  const rank_request q = p.requests[blockIdx.y];
  unsigned long long* keys = p.keys + q.keys;
  int mine = 0;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * Threads + tid; r < q.slots;
       r += static_cast<std::int64_t>(gridDim.x) * Threads) {
    const std::int64_t position = q.target.positions[r];
    unsigned long long key = detail_scores::not_a_candidate;
    if (position >= q.first_evictable && position < q.before) {
      float total = 0.0f;
      for (int h = 0; h < p.num_kv_heads; ++h) total += q.target.scores[static_cast<std::size_t>(h) * q.target.stride + position];
      key = detail_scores::rank_key(total, position);
      atomicAdd(&histogram[key >> 56], 1);
      ++mine;
    }
    keys[r] = key;
  }
  if (mine > 0) atomicAdd(&candidates, mine);
  __syncthreads();
  int* bins = p.histograms + static_cast<std::size_t>(blockIdx.y) * 256;
  for (int i = tid; i < 256; i += Threads)
    if (histogram[i] != 0) atomicAdd(&bins[i], histogram[i]);
  if (tid == 0 && candidates != 0) atomicAdd(&p.candidates[blockIdx.y], candidates);
}

/// Threads of a `lowest_scored_kernel` CTA: one per radix bin, four times over.
inline constexpr int rank_threads = 1024;

/// The ranking of each request, from the keys `rank_keys_kernel` wrote: the `count` candidate
/// slots with the lowest keys (keys are distinct: positions are), marked evicted in the mirror
/// (-1) and listed in `chosen`. A radix select, 8 bits at a time from the top (the first digit's
/// histogram is the keys kernel's), stops as soon as every key with the digits found so far is
/// taken. Grid: one CTA per request. Cost: up to 7 passes over the request's keys, 8 bytes per
/// slot each (L2-resident at the lengths that matter), then one to list the chosen.
template <int Threads = rank_threads>
__global__ void __launch_bounds__(Threads) lowest_scored_kernel(const rank_params p) {
  static_assert(Threads >= 256, "a thread per radix bin");
  __shared__ int histogram[256];
  __shared__ unsigned long long found;  // the digit found by this pass
  __shared__ int need;                  // how many of the keys with the digits so far to take
  __shared__ int in_bin;                // keys with the digits so far
  __shared__ int taken;
  const int tid = static_cast<int>(threadIdx.x);
  const rank_request q = p.requests[blockIdx.x];
  const unsigned long long* keys = p.keys + q.keys;
  std::int64_t* out = p.chosen + static_cast<std::size_t>(blockIdx.x) * (p.chosen_stride + 1);
  const int n = p.candidates[blockIdx.x];
  const int k = static_cast<int>(q.count < n ? q.count : n);
  if (k <= 0) {
    if (tid == 0) out[0] = 0;
    return;
  }
  if (tid < 256) histogram[tid] = p.histograms[static_cast<std::size_t>(blockIdx.x) * 256 + tid];
  if (tid == 0) need = k, taken = 0;
  __syncthreads();
  // The threshold: every candidate key <= it is chosen (k of them).
  unsigned long long threshold = detail_scores::not_a_candidate - 1;
  if (k < n) {
    unsigned long long prefix = 0, mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
      if (shift < 56) {  // the histogram of the next digit among the keys with the digits so far
        if (tid < 256) histogram[tid] = 0;
        __syncthreads();
        for (std::int64_t r = tid; r < q.slots; r += Threads) {
          const unsigned long long key = keys[r];
          if (key != detail_scores::not_a_candidate && (key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1);
        }
        __syncthreads();
      }
      if (tid == 0) {  // the digit where the count runs out (a serial scan of 256 bins: cheap next to a pass)
        int below = 0, digit = 0;
        while (below + histogram[digit] < need) below += histogram[digit++];
        found = static_cast<unsigned long long>(digit) << shift;
        need -= below;
        in_bin = histogram[digit];
      }
      __syncthreads();
      prefix |= found;
      mask |= 255ull << shift;
      const bool all_taken = in_bin == need;
      __syncthreads();  // `found`, `in_bin` and the histogram are rewritten by the next pass
      if (all_taken) {
        threshold = prefix | ((1ull << shift) - 1);  // shift 0: the prefix itself
        break;
      }
    }
  }
  for (std::int64_t r = tid; r < q.slots; r += Threads) {
    const unsigned long long key = keys[r];
    if (key != detail_scores::not_a_candidate && key <= threshold) {
      out[1 + atomicAdd(&taken, 1)] = r;
      q.target.positions[r] = -1;
    }
  }
  __syncthreads();
  if (tid == 0) out[0] = taken;
}

}  // namespace kvmosaic::cuda::kernel
