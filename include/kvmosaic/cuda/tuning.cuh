// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Launch shapes of the kernels, in one place (CCCL's "tuning is data"): a constexpr function of
/// the problem shape returns threads per CTA and the unroll depth, instead of literals spread over
/// kernels. Changing a tuning here changes every launch that uses it.

namespace kvmosaic::cuda {

/// Shape of the decode-attention kernel for one head_dim and GQA group size.
struct decode_tuning {
  int threads;  ///< threads per CTA; a CTA reads one split of one (sequence, KV head)
  int unroll;   ///< tokens per thread per loop step (portable kernel: its K and V loads in flight)
  int stage_tokens;          ///< sm_90 kernel: K and V rows per shared-memory stage
  int stages;                ///< sm_90 kernel: stages in flight per CTA
  int max_pages_per_split;   ///< sm_90 kernels: page ids a CTA keeps in shared memory
  int tma_stages;            ///< sm_90 tensor-core kernel: 64-token TMA stages in flight per CTA
};

constexpr decode_tuning decode_tuning_for(int head_dim, int group_size) {
  // Registers per thread grow with the group (q and o held per query head): fewer tokens per
  // step for large groups. A stage is 16 KB of K plus 16 KB of V whatever head_dim; two stages per
  // CTA and three CTAs per SM keep about 190 KB of loads in flight per SM (measured on H200: two
  // 32 KB stages beat four 16 KB ones, 75% vs 70% of HBM at batch 8, 128K).
  // The tensor-core kernel (head_dim 64/128) holds ~185 registers per thread at head_dim 128, so
  // two CTAs per SM, each with two 64-token stages (32 KB) in flight. Measured on H200: three
  // stages gave the same times; capping registers for three CTAs per SM spilled and lost 25%;
  // moving q to shared memory (126 registers, 512 page ids, three CTAs per SM) gave the same
  // times at batch 8-32, so occupancy is not what separates this kernel from cuDNN.
  return decode_tuning{128, group_size > 4 ? 2 : (head_dim >= 256 ? 2 : 4), 8192 / head_dim, 2, 2048, 2};
}

/// Threads of the split-merge kernel: one per output channel.
constexpr int merge_threads(int head_dim) { return head_dim; }

/// Threads of the row-scatter (prefill/append) kernel.
constexpr int extend_threads = 256;

}  // namespace kvmosaic::cuda
