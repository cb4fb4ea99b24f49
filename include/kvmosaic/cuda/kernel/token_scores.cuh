// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `token_scores_kernel`: the per-token attention scores of a decode step (select/token_scores.hpp)
/// from the logits its split kernels wrote (`decode_params::token_logits`), normalized by each
/// query head's log-sum-exp over all the step's splits (written by the merge): what `select::tova` and `select::h2o`
/// rank by, computed without eager attention and without a second pass over K.

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// Threads of a `token_scores_kernel` CTA.
inline constexpr int token_score_threads = 256;

/// scores[b][h][r] = combine over the group's query heads j of exp(s_j - lse_j), for every row r
/// of the read order of sequence b that the step covered (`decode_params::token_logits`: its
/// pages' rows, then its exact and tail rows), lse_j being the head's log-sum-exp that the merge
/// wrote (`decode_params::lse`). A row the step masked (logit -inf) scores 0, and so does every
/// row of a head that read no token. `combine_max`: the group's largest probability, else their
/// sum. Grid: (CTAs per (sequence, KV head), num_kv_heads, batch), each striding over the rows.
/// Cost per row and KV head: 4 x Group bytes read, 4 written, Group exps.
template <int Group>
__global__ void __launch_bounds__(token_score_threads) token_scores_kernel(const decode_params p, float* scores,
                                                                           bool combine_max) {
  detail::wait_for_prior_grid();  // the split kernel's logits, the merge's log-sum-exps
  const int head = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  float lse[Group];
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    const float x = p.lse[b * p.lse_strides[0] + (head * Group + g) * p.lse_strides[1]];
    lse[g] = x == -HUGE_VALF ? HUGE_VALF : x;  // no token read: every p is 0
  }
  const std::int64_t sealed = static_cast<std::int64_t>(p.sealed_pages[b]) * p.page_size;
  const std::int64_t exact = sealed < p.exact_rows ? sealed : p.exact_rows;
  const std::int64_t rows = sealed + exact + p.tail_rows[b];
  const std::size_t base = (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots;
  const float* logits = p.token_logits + base * Group;
  float* out = scores + base;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * token_score_threads + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * token_score_threads) {
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
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float probability = s[g] == -HUGE_VALF ? 0.0f : expf(s[g] - lse[g]);
      combined = combine_max ? fmaxf(combined, probability) : combined + probability;
    }
    out[r] = combined;
  }
}

}  // namespace kvmosaic::cuda::kernel
