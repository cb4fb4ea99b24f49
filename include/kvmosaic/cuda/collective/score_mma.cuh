// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Warp-level logits on tensor cores: q . k for the GQA group's query heads (the M rows of an
/// m16n8k16 tile, padded to 16) against K rows staged in shared memory (the N columns, 8 tokens
/// per tile). Replaces the per-lane dot products and shuffle reductions of the SIMT path, which
/// bound the dense kernel by instruction issue rather than by memory.
///
/// Precision: q (already multiplied by the softmax scale) is split into q_hi + q_lo, both in the
/// storage type, and both halves are multiplied (two MMAs), so q keeps about 16 (bf16) or 22
/// (f16) significant bits; K is exact in its storage type; products accumulate in fp32.
///
/// Shared-memory banks: a warp's 16-byte loads cover two K rows per phase; rows are a multiple of
/// 128 bytes apart, so odd rows read the other 64-byte half of the 128-byte line (they walk the
/// head dimension in swapped pairs of 32-channel steps) and no phase has a conflict. The
/// contraction order does not matter, so each lane's MMA k-slots map to physical channels
/// [32 s + 8 q, 32 s + 8 q + 8) (identically in the A and B operands) to make each load 16 bytes.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/mma.cuh"

namespace kvmosaic::cuda {

template <class T, int HeadDim, int Group, int TokensPerWarp>
struct mma_scorer {
  static_assert(Group >= 1 && Group <= 8, "the group's query heads fill the first 8 rows of the tile");
  static_assert(TokensPerWarp % 8 == 0, "a warp scores whole 8-token tiles");
  static_assert(HeadDim % 64 == 0, "head_dim must be a multiple of 64 (pairs of 32-channel steps)");
  static constexpr int steps = HeadDim / 32;  ///< 32 channels (two k16 MMAs) per step
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));

  std::uint32_t q_hi[steps][2][2];  ///< [step][k16 half][A register 0 or 2]
  std::uint32_t q_lo[steps][2][2];

  /// Loads the group's queries for this KV head (`q`: [Group][HeadDim] floats), scaled.
  __device__ __forceinline__ void load_queries(const float* q, float scale) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, quad = lane % 4;
#pragma unroll
    for (int s = 0; s < steps; ++s) {
      float x[8];
      if (g < Group) {
        const float4 a = *reinterpret_cast<const float4*>(q + g * HeadDim + 32 * s + 8 * quad);
        const float4 b = *reinterpret_cast<const float4*>(q + g * HeadDim + 32 * s + 8 * quad + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = v[i] * scale;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = 0.0f;
      }
      float hi[8], lo[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hi[i] = detail::round_operand<T>(x[i]);
        lo[i] = x[i] - hi[i];
      }
#pragma unroll
      for (int half_step = 0; half_step < 2; ++half_step) {
        q_hi[s][half_step][0] = detail::pack_pair<T>(hi[4 * half_step], hi[4 * half_step + 1]);
        q_hi[s][half_step][1] = detail::pack_pair<T>(hi[4 * half_step + 2], hi[4 * half_step + 3]);
        q_lo[s][half_step][0] = detail::pack_pair<T>(lo[4 * half_step], lo[4 * half_step + 1]);
        q_lo[s][half_step][1] = detail::pack_pair<T>(lo[4 * half_step + 2], lo[4 * half_step + 3]);
      }
    }
  }

  /// logits[g * stride + t] = q_g . k_t for the warp's tokens t in [first, first + TokensPerWarp)
  /// of the K rows at `k` (shared memory). Rows past the valid ones may hold anything: their
  /// columns are independent and the caller never reads them.
  __device__ __forceinline__ void score(const std::byte* k, int first, float* logits, int stride) const {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, quad = lane % 4, odd = g & 1;
#pragma unroll
    for (int tile = 0; tile < TokensPerWarp / 8; ++tile) {
      const std::byte* key = k + static_cast<std::size_t>(first + 8 * tile + g) * row_bytes + 16 * quad;
      uint4 loaded[steps];
#pragma unroll
      for (int s = 0; s < steps; ++s) loaded[s] = detail::load_shared(key + 64 * (s ^ odd));
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < steps; ++s) {
        const uint4 b = odd ? loaded[s ^ 1] : loaded[s];  // step s's channels, wherever they were read
        const std::uint32_t a_hi0[4] = {q_hi[s][0][0], 0u, q_hi[s][0][1], 0u};
        const std::uint32_t a_lo0[4] = {q_lo[s][0][0], 0u, q_lo[s][0][1], 0u};
        const std::uint32_t a_hi1[4] = {q_hi[s][1][0], 0u, q_hi[s][1][1], 0u};
        const std::uint32_t a_lo1[4] = {q_lo[s][1][0], 0u, q_lo[s][1][1], 0u};
        detail::mma_16816<T>(c, a_hi0, b.x, b.y);
        detail::mma_16816<T>(c, a_lo0, b.x, b.y);
        detail::mma_16816<T>(c, a_hi1, b.z, b.w);
        detail::mma_16816<T>(c, a_lo1, b.z, b.w);
      }
      if (g < Group) {
        logits[g * stride + first + 8 * tile + 2 * quad] = c[0];
        logits[g * stride + first + 8 * tile + 2 * quad + 1] = c[1];
      }
    }
  }
};

}  // namespace kvmosaic::cuda
