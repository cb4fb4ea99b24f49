// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device half of the score-based selectors (`select::tova`, `select::h2o`):
///   - `token_scores_kernel`: a decode step's per-token attention scores (select/token_scores.hpp)
///     from the logits its split kernels wrote (`decode_params::token_logits`), normalized by each
///     query head's log-sum-exp over all the step's splits (written by the merge), filed by
///     logical position into each sequence's device score buffer (written, or added for
///     cumulative scores): no eager attention, no second pass over K, no copy to the host.
///   - `rank_keys_kernel`, `rank_digit_kernel`, `rank_choose_kernel`: the eviction ranking
///     (`detail::lowest_scored` on the host) over those buffers, for a batch of sequences: the
///     lowest shared scores among each sequence's live sealed slots, by a radix select on 64-bit
///     keys (score, position) spread over the whole device, so that only the chosen slots leave
///     the device.

#include <cuda.h>

#include <cub/block/block_scan.cuh>

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

/// One sequence's eviction ranking (`rank_keys_kernel`, `rank_digit_kernel`, `rank_choose_kernel`).
struct rank_request {
  score_slot target;             ///< the sequence's scores and slot positions
  std::int64_t slots;            ///< sealed slots of the sequence
  std::int64_t first_evictable;  ///< candidates: live slots whose position is in [first_evictable, before)
  std::int64_t before;
  std::int64_t count;            ///< how many to choose (fewer when there are fewer candidates)
  std::int64_t keys;             ///< offset of its keys in `rank_params::keys` ([slots])
};

/// Where one ranking's radix select stands between its kernels (zeroed before the first).
struct rank_state {
  unsigned long long lowest_complement;  ///< ~(the lowest candidate key), 0 before any: a choice of one
  unsigned long long prefix;     ///< the digits found so far
  unsigned long long threshold;  ///< once done: every candidate key <= it is chosen
  int need;                      ///< how many of the keys with those digits to take
  int candidates;
  int done;
  unsigned arrivals;             ///< CTAs of the current kernel that have added their histogram
  int histogram[256];            ///< of the current digit, over the keys with the digits so far
};

/// A batch of rankings: per request its state, its keys, and `chosen` [r][1 + chosen_stride]:
/// the number chosen (zeroed by the caller), then the chosen slots.
struct rank_params {
  const rank_request* requests;
  rank_state* states;
  int num_kv_heads;
  unsigned long long* keys;
  std::int64_t* chosen;
  std::int64_t chosen_stride;
};

/// Threads of a ranking kernel's CTA.
inline constexpr int rank_threads = 256;

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

/// Counts `bin` (-1: nothing) in a shared histogram, for a whole warp at once: one atomic when
/// every lane has the same bin (the common case: near-equal scores share their top digits, and
/// 32 lanes adding to one address would replay 32 times), else one per lane. Whole warp.
__device__ __forceinline__ void count_bin(int* histogram, int bin) {
  constexpr unsigned full = 0xffffffffu;
  const int first = __shfl_sync(full, bin, 0);
  if (__all_sync(full, bin == first)) {
    if ((threadIdx.x & 31) == 0 && first >= 0) atomicAdd(&histogram[first], 32);
  } else if (bin >= 0) {
    atomicAdd(&histogram[bin], 1);
  }
}

/// Adds this CTA's histogram to the request's; returns true in the CTA that arrives last, which
/// then sees every CTA's counts (the threadfence reduction pattern). Whole CTA.
template <int Threads>
__device__ __forceinline__ bool add_histogram(rank_state& state, const int* histogram, int& last) {
  for (int i = static_cast<int>(threadIdx.x); i < 256; i += Threads)
    if (histogram[i] != 0) atomicAdd(&state.histogram[i], histogram[i]);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&state.arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();
  return last != 0;
}

/// In the last CTA (whole CTA, a thread per bin): the digit at `shift` where the count of `need`
/// keys runs out, found by a block scan of the request's histogram; the state moved past it and
/// the histogram cleared for the next kernel. Done when every key with the digits so far is
/// taken (keys are distinct: positions are), and at the last digit.
template <int Threads>
__device__ __forceinline__ void take_digit(rank_state& state, int shift, int need,
                                           typename cub::BlockScan<int, Threads>::TempStorage& scan) {
  static_assert(Threads == 256, "a thread per radix bin");
  const int tid = static_cast<int>(threadIdx.x);
  volatile int* bins = state.histogram;
  const int count = bins[tid];
  int inclusive = 0;
  cub::BlockScan<int, Threads>(scan).InclusiveSum(count, inclusive);
  if (inclusive >= need && inclusive - count < need) {  // exactly one bin
    const int left = need - (inclusive - count);
    const unsigned long long prefix = state.prefix | (static_cast<unsigned long long>(tid) << shift);
    state.need = left;
    state.prefix = prefix;
    if (count == left || shift == 0) {
      state.done = 1;
      state.threshold = prefix | ((1ull << shift) - 1);
    }
  }
  bins[tid] = 0;
  if (tid == 0) state.arrivals = 0;
}
}  // namespace detail_scores

/// Each slot's key (`rank_key` of its shared score, the sum over the KV heads in head order as
/// `token_score_buffer::shared` sums on the host; `not_a_candidate` for a slot that is not one),
/// the candidates counted, the lowest candidate key, and the radix select's first digit (bits
/// 56-63); a request that chooses one key is done here. Grid: (CTAs per request, requests), each
/// striding over its request's slots. Cost: per slot 8 bytes read and
/// 8 written, and num_kv_heads scores read per candidate.
template <int Threads = rank_threads>
__global__ void __launch_bounds__(Threads) rank_keys_kernel(const rank_params p) {
  __shared__ int histogram[256];
  __shared__ int candidates;
  __shared__ unsigned long long lowest_complement;
  __shared__ int last;
  __shared__ typename cub::BlockScan<int, Threads>::TempStorage scan;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < 256; i += Threads) histogram[i] = 0;
  if (tid == 0) {
    candidates = 0;
    lowest_complement = 0;
  }
  __syncthreads();
  const rank_request q = p.requests[blockIdx.y];
  rank_state& state = p.states[blockIdx.y];
  unsigned long long* keys = p.keys + q.keys;
  int mine = 0;
  unsigned long long lowest = detail_scores::not_a_candidate;
  // Warp-uniform trips (count_bin needs every lane).
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * Threads + (tid & ~31); first < q.slots;
       first += static_cast<std::int64_t>(gridDim.x) * Threads) {
    const std::int64_t r = first + (tid & 31);
    const std::int64_t position = r < q.slots ? q.target.positions[r] : -1;
    unsigned long long key = detail_scores::not_a_candidate;
    if (position >= q.first_evictable && position < q.before) {
      float total = 0.0f;
      for (int h = 0; h < p.num_kv_heads; ++h) total += q.target.scores[static_cast<std::size_t>(h) * q.target.stride + position];
      key = detail_scores::rank_key(total, position);
      lowest = key < lowest ? key : lowest;
      ++mine;
    }
    detail_scores::count_bin(histogram, key == detail_scores::not_a_candidate ? -1 : static_cast<int>(key >> 56));
    if (r < q.slots) keys[r] = key;
  }
  if (mine > 0) {
    atomicAdd(&candidates, mine);
    atomicMax(&lowest_complement, ~lowest);
  }
  __syncthreads();
  if (tid == 0 && candidates != 0) {
    atomicAdd(&state.candidates, candidates);
    atomicMax(&state.lowest_complement, lowest_complement);
  }
  if (!detail_scores::add_histogram<Threads>(state, histogram, last)) return;
  const int n = *static_cast<volatile int*>(&state.candidates);
  const int k = static_cast<int>(q.count < n ? q.count : n);
  // Decided without digit passes: nothing to choose, every candidate, or the lowest key alone
  // (keys are distinct).
  if (k <= 1 || k == n) {
    if (tid == 0) {
      state.done = 1;
      state.threshold = k <= 0   ? 0ull
                        : k == n ? detail_scores::not_a_candidate - 1
                                 : ~*static_cast<volatile unsigned long long*>(&state.lowest_complement);
      state.arrivals = 0;
    }
    static_cast<volatile int*>(state.histogram)[tid] = 0;
    return;
  }
  detail_scores::take_digit<Threads>(state, 56, k, scan);
}

/// One more digit (bits shift to shift + 7) of each unfinished ranking: the histogram of the keys
/// that carry the digits found so far. Grid: (CTAs per request, requests). Cost: a read of the
/// request's keys (L2-resident at the lengths that matter), nothing once it is done.
template <int Threads = rank_threads>
__global__ void __launch_bounds__(Threads) rank_digit_kernel(const rank_params p, int shift) {
  __shared__ int histogram[256];
  __shared__ int last;
  __shared__ typename cub::BlockScan<int, Threads>::TempStorage scan;
  rank_state& state = p.states[blockIdx.y];
  if (state.done) return;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < 256; i += Threads) histogram[i] = 0;
  __syncthreads();
  const rank_request q = p.requests[blockIdx.y];
  const unsigned long long* keys = p.keys + q.keys;
  const unsigned long long prefix = state.prefix, mask = ~0ull << (shift + 8);
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * Threads + (tid & ~31); first < q.slots;
       first += static_cast<std::int64_t>(gridDim.x) * Threads) {
    const std::int64_t r = first + (tid & 31);
    const unsigned long long key = r < q.slots ? keys[r] : detail_scores::not_a_candidate;
    const bool counted = (key & mask) == prefix && key != detail_scores::not_a_candidate;
    detail_scores::count_bin(histogram, counted ? static_cast<int>((key >> shift) & 255u) : -1);
  }
  __syncthreads();
  if (detail_scores::add_histogram<Threads>(state, histogram, last)) detail_scores::take_digit<Threads>(state, shift, state.need, scan);
}

/// Lists each ranking's chosen slots (candidate keys <= its threshold) and marks them evicted in
/// the mirror (-1). Grid: (CTAs per request, requests). Cost: a read of the keys.
template <int Threads = rank_threads>
__global__ void __launch_bounds__(Threads) rank_choose_kernel(const rank_params p) {
  const rank_request q = p.requests[blockIdx.y];
  const unsigned long long threshold = p.states[blockIdx.y].threshold;
  const unsigned long long* keys = p.keys + q.keys;
  std::int64_t* out = p.chosen + static_cast<std::size_t>(blockIdx.y) * (p.chosen_stride + 1);
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * Threads + threadIdx.x; r < q.slots;
       r += static_cast<std::int64_t>(gridDim.x) * Threads) {
    const unsigned long long key = keys[r];
    if (key != detail_scores::not_a_candidate && key <= threshold) {
      out[1 + atomicAdd(reinterpret_cast<unsigned long long*>(out), 1ull)] = r;
      q.target.positions[r] = -1;
    }
  }
}

/// Enqueues a batch of rankings on `stream`: the keys, up to seven more digits, the choice. The
/// caller zeroes `p.states` and the chosen counts first; `ctas` CTAs per request. When no request
/// chooses more than one key (`largest_count` <= 1: an eviction step's common case), the keys
/// kernel finds each lowest key itself and no digit kernel is launched. A template so that only
/// the translation units that rank compile the three kernels.
template <int Threads = rank_threads>
void launch_ranking(const rank_params& p, int requests, int ctas, std::int64_t largest_count, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(requests));
  rank_keys_kernel<Threads><<<grid, Threads, 0, stream>>>(p);
  if (largest_count > 1)
    for (int shift = 48; shift >= 0; shift -= 8)  // a kernel whose rankings are all done returns at once
      rank_digit_kernel<Threads><<<grid, Threads, 0, stream>>>(p, shift);
  rank_choose_kernel<Threads><<<grid, Threads, 0, stream>>>(p);
}

}  // namespace kvmosaic::cuda::kernel
