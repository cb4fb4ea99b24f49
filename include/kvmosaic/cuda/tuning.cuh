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
  // CTA and three CTAs per SM keep about 190 KB of loads in flight per SM. The tensor-core kernel
  // keeps two 64-token stages in flight per CTA, q in shared memory, and up to 2048 page ids per
  // split (78 KB of shared memory at head_dim 128: two CTAs per SM; 142 KB at 256: one). The
  // measurements behind each number: benchmark/README.md, "Decisions the code cites".
  // Formats that stream compressed pages size their stages at run time (their device parts).
  return decode_tuning{128, group_size > 4 ? 2 : (head_dim >= 256 ? 2 : 4), 8192 / head_dim, 2, 2048, 2};
}

/// Threads of the split-merge kernel: one per output channel.
constexpr int merge_threads(int head_dim) { return head_dim; }

/// Threads of the row-scatter (prefill/append) kernel.
constexpr int extend_threads = 256;

}  // namespace kvmosaic::cuda
