// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The votes of an observation window (`cache::window_votes`, `select::snapkv`'s snapshot) on the
/// device, from the logits the decode kernels wrote for a batch of window queries over one
/// sequence (`decode_params::token_logits`): each query's causal log-sum-exp, then each earlier
/// token's probabilities combined over the group and summed over the queries. Source: SnapKV (Li
/// et al., NeurIPS 2024), the observation-window family of the eviction notes. No W x N matrix
/// beyond one batch's logits, and no second pass over K.

#include <cuda.h>

#include <cstddef>
#include <cstdint>

namespace kvmosaic::cuda::kernel {

/// Threads of a window-vote CTA (both kernels).
inline constexpr int window_vote_threads = 256;

/// One batch of window queries, each a copy of the same sequence in a decode step that wrote its
/// rows' logits: batch entry b is window query `first_query + b`, at position `window_start +
/// first_query + b`.
struct window_vote_params {
  const float* logits;            ///< [batch][num_kv_heads][logit_slots][Group] fp32, scaled logits, -inf masked
  std::int64_t logit_slots;       ///< rows per (batch entry, KV head) of `logits`
  const std::int64_t* positions;  ///< [rows]: the logical position of each row of the read order, -1 for none
  std::int64_t rows;              ///< rows of the sequence's read order
  std::int64_t window_start;      ///< position of window query 0
  int first_query;                ///< the window query of batch entry 0
  int queries;                    ///< batch entries
  int num_kv_heads;
  float* lse;                     ///< [queries][num_kv_heads][Group]: each query head's causal log-sum-exp
  float* votes;                   ///< [num_kv_heads][rows]: accumulated over the window's batches
  bool combine_max;               ///< the group's largest probability, else their sum
};

/// lse[b][h][g] = log sum of exp(logit) over the rows whose position is at most query b's own
/// (causal), for query head g of KV head h's group; +inf where no row is (every probability 0).
/// Grid: (queries, num_kv_heads), one CTA reducing all rows. Cost per row: 4 x Group bytes read.
template <int Group>
__global__ void __launch_bounds__(window_vote_threads) window_lse_kernel(const window_vote_params p) {
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const std::int64_t last = p.window_start + p.first_query + b;
  const float* logits = p.logits + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots * Group;
  float m[Group], l[Group];
#pragma unroll
  for (int g = 0; g < Group; ++g) m[g] = -HUGE_VALF, l[g] = 0.0f;
  for (std::int64_t r = threadIdx.x; r < p.rows; r += window_vote_threads) {
    const std::int64_t position = p.positions[r];
    if (position < 0 || position > last) continue;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float s = logits[r * Group + g];
      if (s == -HUGE_VALF) continue;
      if (s > m[g]) l[g] = l[g] * expf(m[g] - s) + 1.0f, m[g] = s;
      else l[g] += expf(s - m[g]);
    }
  }
  __shared__ float shared_m[window_vote_threads / 32][Group], shared_l[window_vote_threads / 32][Group];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_m = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float other_l = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float top = fmaxf(m[g], other_m);
      if (top != -HUGE_VALF) l[g] = l[g] * expf(m[g] - top) + other_l * expf(other_m - top);
      m[g] = top;
    }
    if (lane == 0) shared_m[warp][g] = m[g], shared_l[warp][g] = l[g];
  }
  __syncthreads();
  if (threadIdx.x < Group) {
    const int g = static_cast<int>(threadIdx.x);
    float top = -HUGE_VALF, sum = 0.0f;
    for (int w = 0; w < window_vote_threads / 32; ++w) top = fmaxf(top, shared_m[w][g]);
    if (top != -HUGE_VALF)
      for (int w = 0; w < window_vote_threads / 32; ++w) sum += shared_l[w][g] * expf(shared_m[w][g] - top);
    p.lse[(static_cast<std::size_t>(b) * p.num_kv_heads + head) * Group + g] = sum > 0.0f ? top + logf(sum) : HUGE_VALF;
  }
}

/// votes[h][r] += sum over the batch's queries b of combine over g of exp(logit - lse[b][h][g]),
/// for every row r whose token lies before the window (position in [0, window_start): every
/// window query sees it). Grid: (ceil(rows / threads), num_kv_heads), a thread per row. Cost per
/// row: 4 x Group x queries bytes read, 4 read and written.
template <int Group>
__global__ void __launch_bounds__(window_vote_threads) window_votes_kernel(const window_vote_params p) {
  const int head = static_cast<int>(blockIdx.y);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * window_vote_threads + threadIdx.x;
  if (r >= p.rows) return;
  const std::int64_t position = p.positions[r];
  if (position < 0 || position >= p.window_start) return;
  float vote = 0.0f;
  for (int b = 0; b < p.queries; ++b) {
    const std::size_t base = (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots + static_cast<std::size_t>(r);
    const float* lse = p.lse + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * Group;
    float combined = 0.0f;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float s = p.logits[base * Group + g];
      const float probability = s == -HUGE_VALF ? 0.0f : expf(s - lse[g]);
      combined = p.combine_max ? fmaxf(combined, probability) : combined + probability;
    }
    vote += combined;
  }
  p.votes[static_cast<std::size_t>(head) * p.rows + r] += vote;
}

}  // namespace kvmosaic::cuda::kernel
