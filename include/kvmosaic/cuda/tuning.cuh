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
  // The tensor-core kernel keeps two 64-token stages (32 KB at head_dim 128) in flight per CTA.
  // Measured on H200 at head_dim 128: three stages gave the same times as two; with q in
  // registers (185 registers, two CTAs per SM) capping registers for three CTAs spilled and lost
  // 25%; q in shared memory (126 registers, three CTAs per SM) gave the same times at batch 8-32:
  // occupancy is not what separates this kernel from cuDNN.
  // With q in shared memory (126 registers at head_dim 128) and 2048 page ids, the kernel takes
  // 78 KB of shared memory at head_dim 128 (two CTAs per SM) and 142 KB at 256 (one). 512 page
  // ids would fit three CTAs per SM but cap splits at 512 pages: batch 32 at 128K then needs
  // three waves and lost 2.5%.
  // The bitmap_tiles kernel sizes its stages at run time: see engine::choose_compressed_stages.
  return decode_tuning{128, group_size > 4 ? 2 : (head_dim >= 256 ? 2 : 4), 8192 / head_dim, 2, 2048, 2};
}

/// Threads of the split-merge kernel: one per output channel.
constexpr int merge_threads(int head_dim) { return head_dim; }

/// Threads of the row-scatter (prefill/append) kernel.
constexpr int extend_threads = 256;

}  // namespace kvmosaic::cuda
