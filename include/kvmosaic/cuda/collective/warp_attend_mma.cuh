// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Warp-level dense attention on tensor cores, FlashAttention-2 style, for one GQA group: the
/// group's query heads are the M rows of m16n8k16 tiles (padded to 16), K and V rows come from
/// 128-byte-swizzled shared-memory tiles (written by TMA), q.k and p.v are both MMAs, and the
/// logits never leave registers (the C fragment of q.k is the A fragment of p.v).
///
/// Precision: q (scaled) and p are each split into hi + lo halves in the storage type and both
/// halves are multiplied, so they keep about 16 (bf16) or 22 (f16) bits; K and V are exact in
/// their storage type; accumulation is fp32. Each warp keeps its own online-softmax state for 16
/// tokens per stage; the CTA merges the warps' states at the end of a split.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/detail/mma.cuh"
#include "kvmosaic/cuda/detail/tma.cuh"

namespace kvmosaic::cuda {

/// One warp's share of a split: its running (m, l, o). Lane 4 g + q holds head g (rows g + 8 are
/// padding): m, a partial l over its own columns, and o for channels 8 c + 2 q, 8 c + 2 q + 1 of
/// every 8-channel tile c. The group's queries live in shared memory (`stage_queries`, one copy
/// for the CTA) and are read as A fragments with ldmatrix, which keeps ~60 registers per thread
/// free at head_dim 128 and makes head_dim 256 fit.
template <class T, int HeadDim, int Group, int StageTokens>
struct warp_attend_mma {
  static_assert(Group >= 1 && Group <= 8, "the group's query heads fill the first 8 rows of the tile");
  static_assert(HeadDim % 64 == 0, "K and V tiles are 64-channel (128-byte) swizzled blocks");
  static constexpr int tokens_per_warp = 16;
  static constexpr int k_steps = HeadDim / 16;
  static constexpr int channel_tiles = HeadDim / 8;
  static constexpr int block_bytes = StageTokens * 128;  ///< one 64-channel block of a stage
  /// Row pitch of the query tiles: 16 bytes of padding puts the 8 rows ldmatrix reads together
  /// in 8 different bank groups.
  static constexpr int query_pitch = HeadDim * 2 + 16;
  /// Shared memory of the query tiles: q_hi and q_lo, 8 rows each.
  static constexpr int query_bytes = 2 * 8 * query_pitch;

  float o[channel_tiles][2];
  float m;
  float l;

  __device__ __forceinline__ static int lane() { return static_cast<int>(threadIdx.x) % 32; }

  /// Every thread of the CTA: writes the group's queries (`q`: [Group][HeadDim] floats), scaled
  /// by `scale` and split into hi + lo halves in T, to the query tiles at `tiles`
  /// (`query_bytes`); rows past the group are zero. A barrier must follow before `fold`.
  __device__ __forceinline__ static void stage_queries(const float* q, float scale, std::byte* tiles, int threads) {
    for (int index = static_cast<int>(threadIdx.x); index < 8 * HeadDim; index += threads) {
      const int row = index / HeadDim, channel = index % HeadDim;
      const float x = row < Group ? q[row * HeadDim + channel] * scale : 0.0f;
      const T hi(x);
      const T lo(x - to_float(hi));
      *reinterpret_cast<T*>(tiles + row * query_pitch + channel * 2) = hi;
      *reinterpret_cast<T*>(tiles + (8 + row) * query_pitch + channel * 2) = lo;
    }
  }

  /// Empty state.
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int c = 0; c < channel_tiles; ++c) o[c][0] = o[c][1] = 0.0f;
    m = -HUGE_VALF;
    l = 0.0f;
  }

  /// The 16-row mask of a warp's rows [first, first + 16) when a stage holds `n` tokens.
  __device__ __forceinline__ static std::uint32_t rows_before(int first, int n) {
    const int rows = n - first;
    return rows >= 16 ? 0xffffu : rows <= 0 ? 0u : (1u << rows) - 1u;
  }

  /// Folds the warp's 16 tokens [first, first + 16) of a stage (K and V tiles in shared memory)
  /// into the state: those whose bit in `rows` is set (bit r: token first + r; `rows_before` for
  /// the first n tokens of a stage, and-ed with a selection's row mask). Whole-warp: every lane
  /// calls it.
  __device__ __forceinline__ void fold(const std::byte* k_tile, const std::byte* v_tile, const std::byte* query_tiles,
                                       int first, std::uint32_t rows) {
    const int quad = lane() % 4, i = lane();
    float s[2][4];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) s[tile][0] = s[tile][1] = s[tile][2] = s[tile][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < k_steps; k += 2) {
      const int chunk = 2 * k + i / 8;  // 8-channel chunk of this lane's ldmatrix row
      // A fragments of steps k and k + 1 (rows 0-7; rows 8-15 are zero): a0, a2, a0', a2'.
      std::uint32_t q_hi[4], q_lo[4];
      detail::ldmatrix_x4(q_hi, query_tiles + (i % 8) * query_pitch + chunk * 16);
      detail::ldmatrix_x4(q_lo, query_tiles + (8 + i % 8) * query_pitch + chunk * 16);
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const int token = first + 8 * tile + (i % 8);
        std::uint32_t b[4];
        detail::ldmatrix_x4(b, k_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(token, chunk % 8));
        mma(s[tile], {q_hi[0], q_hi[1]}, b[0], b[1]);
        mma(s[tile], {q_lo[0], q_lo[1]}, b[0], b[1]);
        mma(s[tile], {q_hi[2], q_hi[3]}, b[2], b[3]);
        mma(s[tile], {q_lo[2], q_lo[3]}, b[2], b[3]);
      }
    }
    // Online softmax for head g over this warp's 16 tokens (4 per lane, the quad shares a head).
    const std::uint32_t lane_rows = rows >> (2 * quad);  // bit 8 tile + e: this lane's token
    float tile_max = -HUGE_VALF;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (((lane_rows >> (8 * tile + e)) & 1u) == 0) s[tile][e] = -HUGE_VALF;
        tile_max = fmaxf(tile_max, s[tile][e]);
      }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const bool any = m_new != -HUGE_VALF;  // false only while no token was valid for this warp
    const float rescale = any ? __expf(m - m_new) : 1.0f;
    float p[2][2];
    float p_sum = 0.0f;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[tile][e] = s[tile][e] == -HUGE_VALF ? 0.0f : __expf(s[tile][e] - m_new);
        p_sum += p[tile][e];
      }
    l = l * rescale + p_sum;
    if (any) m = m_new;
    // p as A fragments: C of q.k tiles 0 and 1 = columns k 0..7 and 8..15 of p.v.
    const float h00 = to_float(T(p[0][0])), h01 = to_float(T(p[0][1]));
    const float h10 = to_float(T(p[1][0])), h11 = to_float(T(p[1][1]));
    const std::uint32_t p_hi[2] = {detail::pack_pair<T>(h00, h01), detail::pack_pair<T>(h10, h11)};
    const std::uint32_t p_lo[2] = {detail::pack_pair<T>(p[0][0] - h00, p[0][1] - h01),
                                   detail::pack_pair<T>(p[1][0] - h10, p[1][1] - h11)};
    const int v_token = first + (i % 8) + 8 * ((i / 8) % 2);
#pragma unroll
    for (int c = 0; c < channel_tiles; c += 2) {
      const int chunk = c + i / 16;
      std::uint32_t b[4];
      detail::ldmatrix_x4_trans(b, v_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(v_token, chunk % 8));
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        o[c + t][0] *= rescale;
        o[c + t][1] *= rescale;
        accumulate(o[c + t], p_hi, b[2 * t], b[2 * t + 1]);
        accumulate(o[c + t], p_lo, b[2 * t], b[2 * t + 1]);
      }
    }
  }

  /// The warp's l for head g, summed over the quad (call once, at the end of the split).
  __device__ __forceinline__ float total_l() const {
    float sum = l + __shfl_xor_sync(0xffffffffu, l, 1);
    return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
  }

 private:
  /// c[0..1] (row g) += A(rows g: a0, a2; rows g + 8: zero) * B.
  __device__ __forceinline__ static void mma(float (&c)[4], const std::uint32_t (&a)[2], std::uint32_t b0,
                                             std::uint32_t b1) {
    const std::uint32_t fragment[4] = {a[0], 0u, a[1], 0u};
    detail::mma_16816<T>(c, fragment, b0, b1);
  }
  __device__ __forceinline__ static void accumulate(float (&acc)[2], const std::uint32_t (&a)[2], std::uint32_t b0,
                                                    std::uint32_t b1) {
    float c[4] = {acc[0], acc[1], 0.0f, 0.0f};
    mma(c, a, b0, b1);
    acc[0] = c[0];
    acc[1] = c[1];
  }
};

}  // namespace kvmosaic::cuda
