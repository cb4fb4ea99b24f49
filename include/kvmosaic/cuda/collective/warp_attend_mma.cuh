// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Warp-level dense attention on tensor cores, FlashAttention-2 style, for one GQA group: the
/// group's query heads are the N columns of m16n8k16 tiles (padded to 8), tokens and channels the
/// M rows; K and V rows come from 128-byte-swizzled shared-memory tiles (written by TMA or
/// expanded from a compressed page), q.k and p.v are both MMAs, and the logits never leave
/// registers (the C fragment of q.k, transposed with movmatrix, is the B fragment of p.v).
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

/// One warp's share of a split: its running (m, l, o) for the group's heads. Both products are
/// computed transposed, so the tokens and channels are the M rows of the tiles and the heads the N
/// columns (8, the group padded): S^T = K Q^T (16 tokens x 8 heads per warp, 2 MMAs per 16
/// channels with q split hi + lo) and O^T += V^T P^T (16 channels x 8 heads, 2 MMAs per 16
/// channels). No row of an MMA is padding, and the C fragment of one product becomes the B
/// fragment of the next by one `movmatrix` transpose per 8x8 block. Lane 4 g + q holds heads
/// 2 q, 2 q + 1: their m, a partial l over its tokens g and g + 8 of each fold, and o for channels
/// 16 c + g and 16 c + g + 8 of every 16-channel tile c. The group's queries live in shared memory
/// (`stage_queries`, one copy for the CTA) and are read as B fragments with ldmatrix.
/// Per 16 tokens and head_dim D: D / 4 MMAs, D / 16 + D / 16 + D / 16 ldmatrix (q, K, V), one
/// online-softmax step (6 shuffles), and o rescaled only when some head's running max moved.
template <class T, int HeadDim, int Group, int StageTokens>
struct warp_attend_mma {
  static_assert(Group >= 1 && Group <= 8, "the group's query heads fill the 8 columns of the tile");
  static_assert(HeadDim % 64 == 0, "K and V tiles are 64-channel (128-byte) swizzled blocks");
  static constexpr int tokens_per_warp = 16;
  static constexpr int k_steps = HeadDim / 16;
  static constexpr int channel_tiles = HeadDim / 16;  ///< 16-channel M tiles of O^T
  static constexpr int block_bytes = StageTokens * 128;  ///< one 64-channel block of a stage
  /// Row pitch of the query tiles: 16 bytes of padding puts the 8 rows ldmatrix reads together
  /// in 8 different bank groups.
  static constexpr int query_pitch = HeadDim * 2 + 16;
  /// Shared memory of the query tiles: q_hi and q_lo, 8 rows each.
  static constexpr int query_bytes = 2 * 8 * query_pitch;

  float o[channel_tiles][4];  ///< (channel 16 c + g, heads 2 q, 2 q + 1), (channel 16 c + g + 8, same)
  float m[2];                 ///< heads 2 q, 2 q + 1
  float l[2];                 ///< partial: this lane's tokens only (`total_l` sums the 8 lanes of a head)

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
    for (int c = 0; c < channel_tiles; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
    m[0] = m[1] = -HUGE_VALF;
    l[0] = l[1] = 0.0f;
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
    const int i = lane(), g = i / 4;
    // S^T = K Q^T: A = K rows (ldmatrix: matrices (tokens 0-7 | 8-15) x (channels 0-7 | 8-15)),
    // B = q rows as columns (ldmatrix: rows = heads, two 8-channel matrices per k16 step).
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int k_token = first + (i % 8) + 8 * ((i / 8) % 2);
#pragma unroll
    for (int k = 0; k < k_steps; k += 2) {
      std::uint32_t q_hi[4], q_lo[4];  // b0, b1 of steps k and k + 1
      const int q_chunk = 2 * k + i / 8;
      detail::ldmatrix_x4(q_hi, query_tiles + (i % 8) * query_pitch + q_chunk * 16);
      detail::ldmatrix_x4(q_lo, query_tiles + (8 + i % 8) * query_pitch + q_chunk * 16);
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int chunk = 2 * (k + step) + i / 16;
        std::uint32_t a[4];
        detail::ldmatrix_x4(a, k_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(k_token, chunk % 8));
        detail::mma_16816<T>(s, a, q_hi[2 * step], q_hi[2 * step + 1]);
        detail::mma_16816<T>(s, a, q_lo[2 * step], q_lo[2 * step + 1]);
      }
    }
    // Online softmax per head over the 16 tokens: this lane has tokens g (s[0..1]) and g + 8
    // (s[2..3]) of heads 2 q, 2 q + 1; the 8 lanes of a quad position share the heads.
    if (((rows >> g) & 1u) == 0) s[0] = s[1] = -HUGE_VALF;
    if (((rows >> (g + 8)) & 1u) == 0) s[2] = s[3] = -HUGE_VALF;
    float rescale[2], p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(s[h], s[2 + h]);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      const float m_new = fmaxf(m[h], tile_max);
      const bool any = m_new != -HUGE_VALF;  // false only while no token was valid for this warp
      rescale[h] = any ? __expf(m[h] - m_new) : 1.0f;
      p[h] = s[h] == -HUGE_VALF ? 0.0f : __expf(s[h] - m_new);
      p[2 + h] = s[2 + h] == -HUGE_VALF ? 0.0f : __expf(s[2 + h] - m_new);
      l[h] = l[h] * rescale[h] + (p[h] + p[2 + h]);
      if (any) m[h] = m_new;
    }
    // Rescaling is needed only where a running max moved: after the first folds, rarely.
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int c = 0; c < channel_tiles; ++c) {
        o[c][0] *= rescale[0];
        o[c][1] *= rescale[1];
        o[c][2] *= rescale[0];
        o[c][3] *= rescale[1];
      }
    }
    // P^T as B fragments: the C fragment (token rows, head columns) packed to T, each 8x8 block
    // transposed in registers (b0: tokens 0-7, b1: tokens 8-15, column = head g). p = hi + lo.
    const float hi0 = to_float(T(p[0])), hi1 = to_float(T(p[1]));
    const float hi2 = to_float(T(p[2])), hi3 = to_float(T(p[3]));
    const std::uint32_t p_hi0 = detail::transpose_8x8(detail::pack_pair<T>(hi0, hi1));
    const std::uint32_t p_hi1 = detail::transpose_8x8(detail::pack_pair<T>(hi2, hi3));
    const std::uint32_t p_lo0 = detail::transpose_8x8(detail::pack_pair<T>(p[0] - hi0, p[1] - hi1));
    const std::uint32_t p_lo1 = detail::transpose_8x8(detail::pack_pair<T>(p[2] - hi2, p[3] - hi3));
    // O^T += V^T P^T: A = V^T (ldmatrix.trans of the V rows: matrices (channels 0-7 | 8-15) x
    // (tokens 0-7 | 8-15)).
    const int v_token = first + (i % 8) + 8 * (i / 16);
#pragma unroll
    for (int c = 0; c < channel_tiles; ++c) {
      const int chunk = 2 * c + (i / 8) % 2;
      std::uint32_t a[4];
      detail::ldmatrix_x4_trans(a, v_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(v_token, chunk % 8));
      detail::mma_16816<T>(o[c], a, p_hi0, p_hi1);
      detail::mma_16816<T>(o[c], a, p_lo0, p_lo1);
    }
  }

  /// The warp's state to `temp` (`o[warp][head][channel]`, `m[warp][head]`, `l[warp][head]`, heads
  /// below Group): whole-warp, once at the end of a split.
  template <class Temp>
  __device__ __forceinline__ void store(Temp& temp, int warp) const {
    const int i = lane(), g = i / 4, q = i % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = l[h];
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
      const int head = 2 * q + h;
      if (head < Group) {
#pragma unroll
        for (int c = 0; c < channel_tiles; ++c) {
          temp.o[warp][head][16 * c + g] = o[c][h];
          temp.o[warp][head][16 * c + g + 8] = o[c][2 + h];
        }
        if (g == 0) {
          temp.m[warp][head] = m[h];
          temp.l[warp][head] = total;
        }
      }
    }
  }
};

}  // namespace kvmosaic::cuda
