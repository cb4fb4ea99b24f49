// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Warp-level dense attention on tensor cores, FlashAttention-2 style, for one GQA group: the
/// group's query heads are the N columns of m16n8k16 tiles (padded to 8), tokens and channels the
/// M rows; K and V rows come from 128-byte-swizzled shared-memory tiles (written by TMA or
/// expanded from a compressed page), q.k and p.v are both MMAs, and the logits never leave
/// registers (the C fragment of q.k, transposed with movmatrix, is the B fragment of p.v).
///
/// Two operand paths (`operand_path`): `fold` reads K and V with ldmatrix from swizzled shared
/// tiles; `fold_chunks` takes them from a row source, each lane loading whole 16-byte chunks of
/// K and V rows straight into its fragments. The channel order inside the MMAs is the reduction's
/// (q.k) or the output's (p.v) to choose, so it is permuted until a lane's fragment registers are
/// whole chunks; the queries are staged, and the output stored, in the matching order.
///
/// Precision: q (scaled) and p are each split into hi + lo halves in the storage type and both
/// halves are multiplied, so they keep about 16 (bf16) or 22 (f16) bits; K and V are exact in
/// their storage type; accumulation is fp32; exp(s - m) is 2^(s log2 e - m log2 e), one FFMA and
/// one SFU `ex2.approx.ftz` (about 2 ulp). Each warp keeps its own online-softmax state for 16
/// tokens per stage; the CTA merges the warps' states at the end of a split.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/collective/row_sources.cuh"
#include "kvmosaic/cuda/detail/mma.cuh"
#include "kvmosaic/cuda/detail/tma.cuh"

namespace kvmosaic::cuda {

/// How K and V reach a `warp_attend_mma`'s fragments; it fixes the channel order of its MMAs.
enum class operand_path {
  /// ldmatrix from 128-byte-swizzled shared tiles (`fold`): channels in natural order.
  shared_tiles,
  /// Lanes load 16-byte row chunks themselves (`fold_chunks`). q.k: lane 4 g + q takes channels
  /// 64 b + 16 q .. 64 b + 16 q + 15 of 64-channel block b for rows g and g + 8, so chunk 8 b +
  /// 2 q + h (h = 0, 1) holds k-steps 4 b + 2 h and 4 b + 2 h + 1. p.v: lane group g takes the
  /// output channels [g D / 8, (g + 1) D / 8), chunk g D / 64 + h (tiles 4 h .. 4 h + 3), of
  /// tokens 2 q, 2 q + 1, 2 q + 8, 2 q + 9.
  row_chunks,
};

/// One warp's share of a split: its running (m, l, o) for the group's heads. Both products are
/// computed transposed, so the tokens and channels are the M rows of the tiles and the heads the N
/// columns (8): S^T = K Q^T (16 tokens x 8 columns per warp) and O^T += V^T P^T (16 channels x 8
/// columns). No row of an MMA is padding, and the C fragment of one product becomes the B
/// fragment of the next by one `movmatrix` transpose per 8x8 block. q and p are each split into
/// hi + lo halves in T: for groups of 4 heads or fewer the halves share the 8 columns (one MMA
/// per 16 channels), for 5-8 heads each half has its own MMA. Lane 4 g + q holds two heads (2 q,
/// 2 q + 1; packed, 2 (q mod 2) and 2 (q mod 2) + 1 of its hi or lo half): their m, a partial l
/// over its tokens g and g + 8 of each fold, and o for rows g and g + 8 of every 16-channel output
/// tile c (channels 16 c + g and 16 c + g + 8 on `shared_tiles`; `output_channel`). The group's
/// queries live in shared memory (`stage_queries`, one copy for the CTA) and are read as B
/// fragments with ldmatrix.
/// Per 16 tokens and head_dim D: D / 8 MMAs (packed; D / 4 otherwise), D / 32 (D / 16) ldmatrix of
/// q, one online-softmax step (6 shuffles; packed, 4 more), o rescaled only when some head's
/// running max moved, and the K and V operands: D / 16 ldmatrix of each (`fold`), or per lane D / 8
/// K chunks and D / 16 V chunks from the row sources (`fold_chunks`).
template <class T, int HeadDim, int Group, int StageTokens, operand_path Path = operand_path::shared_tiles>
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
  /// Groups of 4 heads or fewer put q_hi and q_lo (and p_hi and p_lo) side by side in the 8 N
  /// columns, so each product is one MMA per 16 channels instead of two; the hi and lo halves of
  /// a head (columns h and 4 + h, lanes q and q ^ 2) are summed by a shuffle after q.k (the
  /// logits) and at the end of the split (o).
  static constexpr bool packed = Group <= 4;

  /// P^T as the B fragments of p.v: packed, `hi` holds both halves (lanes q < 2 the hi columns,
  /// q >= 2 the lo ones) and `lo` is unused; else each half has its own pair.
  struct p_fragments {
    std::uint32_t hi[2], lo[2];
  };

  float o[channel_tiles][4];  ///< (channel 16 c + g, heads 2 q, 2 q + 1), (channel 16 c + g + 8, same)
  float m[2];                 ///< heads 2 q, 2 q + 1
  float l[2];                 ///< partial: this lane's tokens only (`total_l` sums the 8 lanes of a head)

  __device__ __forceinline__ static int lane() { return static_cast<int>(threadIdx.x) % 32; }

  /// Every thread of the CTA: writes the group's queries (`q`: [Group][HeadDim] floats), scaled
  /// by `scale` and split into hi + lo halves in T, to the query tiles at `tiles`
  /// (`query_bytes`): packed (Group <= 4), row h holds q_hi and row 4 + h q_lo of head h; else
  /// rows 0-7 hold q_hi and rows 8-15 q_lo. Rows of heads past the group are zero. Channels are
  /// in the path's reduction order (`reduction_position`). A barrier must follow before a fold.
  __device__ __forceinline__ static void stage_queries(const float* q, float scale, std::byte* tiles, int threads) {
    for (int index = static_cast<int>(threadIdx.x); index < 8 * HeadDim; index += threads) {
      const int row = index / HeadDim, channel = index % HeadDim;
      const int head = packed ? row % 4 : row;
      const float x = head < Group ? q[head * HeadDim + channel] * scale : 0.0f;
      const T hi = detail::to_operand<T>(x);
      const T lo = detail::to_operand<T>(x - to_float(hi));
      const int at = reduction_position(channel) * 2;
      if constexpr (packed) {
        *reinterpret_cast<T*>(tiles + row * query_pitch + at) = row < 4 ? hi : lo;
      } else {
        *reinterpret_cast<T*>(tiles + row * query_pitch + at) = hi;
        *reinterpret_cast<T*>(tiles + (8 + row) * query_pitch + at) = lo;
      }
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
  /// the first n tokens of a stage, and-ed with a selection's row mask). With `logits` (a step
  /// that records token scores), the scaled logit of token first + r and head j goes to
  /// logits[r * Group + j] for every r whose bit is set in `covered` (-inf where `rows` masks
  /// it): one store per row and head, none without. Whole-warp: every lane calls it.
  __device__ __forceinline__ void fold(const std::byte* k_tile, const std::byte* v_tile, const std::byte* query_tiles,
                                       int first, std::uint32_t rows, float* logits = nullptr,
                                       std::uint32_t covered = 0) {
    static_assert(Path == operand_path::shared_tiles, "fold reads swizzled tiles: use fold_chunks for row_chunks");
    const int i = lane();
    // S^T = K Q^T: A = K rows (ldmatrix: matrices (tokens 0-7 | 8-15) x (channels 0-7 | 8-15)),
    // B = q rows as columns (ldmatrix: rows = heads, two 8-channel matrices per k16 step).
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int k_token = first + (i % 8) + 8 * ((i / 8) % 2);
#pragma unroll
    for (int k = 0; k < k_steps; k += 2) {
      std::uint32_t a[2][4];
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int chunk = 2 * (k + step) + i / 16;
        detail::ldmatrix_x4(a[step], k_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(k_token, chunk % 8));
      }
      multiply_queries(s, a[0], a[1], query_tiles, k / 2);
    }
    const p_fragments p = online_softmax(s, rows, logits, covered);
    const int v_token = first + (i % 8) + 8 * (i / 16);
#pragma unroll
    for (int c = 0; c < channel_tiles; ++c) {
      std::uint32_t a[4];
      const int chunk = 2 * c + (i / 8) % 2;  // ldmatrix.trans: (channels 0-7 | 8-15) x (tokens 0-7 | 8-15)
      detail::ldmatrix_x4_trans(a, v_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(v_token, chunk % 8));
      accumulate(o[c], a, p);
    }
  }

  /// `fold` with K and V taken from row sources instead of tiles (row_sources.cuh):
  /// `k_rows.pairs(token, chunk, x)` gives channels 8 chunk .. 8 chunk + 15 of K row `token` as
  /// 16-bit pairs, and `v_rows.values(token, chunk, v)` channels 8 chunk .. 8 chunk + 7 of V as 8
  /// registers (one value each, zero-extended). Rows past the data must read as zeros. A V source
  /// that locates two chunks for the price of one (`gathers_value_pairs`) is read with `pairs`
  /// instead, two chunks per call, where head_dim >= 128; a source that locates a row once
  /// (`locates_rows`) is read chunk by chunk from its located rows, and the k-step pairs and
  /// output tiles it says are zero are skipped. `score_chunks` then `accumulate_chunks`.
  /// Per lane and 16 tokens: D / 8 K chunks (tokens g and g + 8) and D / 16 V chunks (tokens
  /// 2 q, 2 q + 1, 2 q + 8, 2 q + 9); no shared tile and no CTA barrier.
  template <class KRows, class VRows>
  __device__ __forceinline__ void fold_chunks(const KRows& k_rows, const VRows& v_rows, const std::byte* query_tiles,
                                              int first, std::uint32_t rows, float* logits = nullptr,
                                              std::uint32_t covered = 0) {
    const p_fragments p = score_chunks(k_rows, query_tiles, first, rows, logits, covered);
    accumulate_chunks(v_rows, first, p);
  }

  /// The first half of `fold_chunks`: q.k over the K rows, the online-softmax step, and P^T for
  /// `accumulate_chunks`. A kernel whose K and V sources are chosen at run time apart calls the
  /// two halves itself (one dispatch each instead of one per pair of sources).
  template <class KRows>
  __device__ __forceinline__ p_fragments score_chunks(const KRows& k_rows, const std::byte* query_tiles, int first,
                                                      std::uint32_t rows, float* logits = nullptr,
                                                      std::uint32_t covered = 0) {
    static_assert(Path == operand_path::row_chunks, "fold_chunks needs the row_chunks channel order");
    const int i = lane(), g = i / 4, q = i % 4;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (locates_rows<KRows>::value) {
      const auto upper = k_rows.locate(first + g), lower = k_rows.locate(first + g + 8);
      const int pairs = k_rows.key_pairs();
#pragma unroll
      for (int pair = 0; pair < k_steps / 2; ++pair) {  // k-steps 2 pair, 2 pair + 1: one chunk per row
        if (pair >= pairs) break;
        const uint4 up = k_rows.chunk(upper, pair), low = k_rows.chunk(lower, pair);
        const std::uint32_t a0[4] = {up.x, low.x, up.y, low.y};
        const std::uint32_t a1[4] = {up.z, low.z, up.w, low.w};
        multiply_queries(s, a0, a1, query_tiles, pair);
      }
    } else {
#pragma unroll
      for (int block = 0; block < HeadDim / 64; ++block) {  // k-steps 4 block .. 4 block + 3: two chunks per row
        uint4 upper[2], lower[2];
        k_rows.pairs(first + g, 8 * block + 2 * q, upper);
        k_rows.pairs(first + g + 8, 8 * block + 2 * q, lower);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const std::uint32_t a0[4] = {upper[half].x, lower[half].x, upper[half].y, lower[half].y};
          const std::uint32_t a1[4] = {upper[half].z, lower[half].z, upper[half].w, lower[half].w};
          multiply_queries(s, a0, a1, query_tiles, 2 * block + half);
        }
      }
    }
    return online_softmax(s, rows, logits, covered);
  }

  /// The second half of `fold_chunks`: o += P^T-weighted V rows of the warp's 16 tokens from
  /// `first` (P from `score_chunks` of the same tokens).
  template <class VRows>
  __device__ __forceinline__ void accumulate_chunks(const VRows& v_rows, int first, const p_fragments& p) {
    static_assert(Path == operand_path::row_chunks, "fold_chunks needs the row_chunks channel order");
    const int i = lane(), g = i / 4, q = i % 4;
    constexpr int chunks_per_group = HeadDim / 64;  // output channels of a lane group, in chunks
    if constexpr (locates_rows<VRows>::value) {
      // The lane's 4 rows located once; per chunk, the tiles past `value_tiles` are skipped.
      const auto r0 = v_rows.locate(first + 2 * q), r1 = v_rows.locate(first + 2 * q + 1);
      const auto r8 = v_rows.locate(first + 2 * q + 8), r9 = v_rows.locate(first + 2 * q + 9);
      const int tiles = v_rows.value_tiles();
#pragma unroll
      for (int part = 0; part < chunks_per_group; ++part) {  // channel tiles 4 part .. 4 part + 3
        if (4 * part >= tiles) break;
        std::uint32_t a[4][4];
        const auto gather = [&](const auto& even_row, const auto& odd_row, int half) {
          const uint4 even = v_rows.value_chunk(even_row, part), odd = v_rows.value_chunk(odd_row, part);
          const std::uint32_t ew[4] = {even.x, even.y, even.z, even.w}, ow[4] = {odd.x, odd.y, odd.z, odd.w};
#pragma unroll
          for (int tile = 0; tile < 4; ++tile) {  // row g: channel 2 tile of the chunk; row g + 8: the next
            a[tile][2 * half] = __byte_perm(ew[tile], ow[tile], 0x5410);
            a[tile][2 * half + 1] = __byte_perm(ew[tile], ow[tile], 0x7632);
          }
        };
        gather(r0, r1, 0);  // tokens 2 q, 2 q + 1
        gather(r8, r9, 1);  // tokens 2 q + 8, 2 q + 9
#pragma unroll
        for (int tile = 0; tile < 4; ++tile)
          if (4 * part + tile < tiles) accumulate(o[4 * part + tile], a[tile], p);
      }
    } else if constexpr (gathers_value_pairs<VRows>::value && chunks_per_group % 2 == 0) {
      // Two chunks per call (`pairs`): one locate for 16 channels of a row, 8 output tiles at once.
#pragma unroll
      for (int part = 0; part < chunks_per_group; part += 2) {  // channel tiles 4 part .. 4 part + 7
        const int chunk = g * chunks_per_group + part;
        std::uint32_t a[8][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // tokens (2 q, 2 q + 1), then (2 q + 8, 2 q + 9)
          uint4 even[2], odd[2];
          v_rows.pairs(first + 2 * q + 8 * half, chunk, even);
          v_rows.pairs(first + 2 * q + 8 * half + 1, chunk, odd);
#pragma unroll
          for (int tile = 0; tile < 8; ++tile) {  // word tile % 4 of the pair: channels 2 (tile % 4), + 1
            const uint4& ev = even[tile / 4];
            const uint4& od = odd[tile / 4];
            const std::uint32_t ew = tile % 4 == 0 ? ev.x : tile % 4 == 1 ? ev.y : tile % 4 == 2 ? ev.z : ev.w;
            const std::uint32_t ow = tile % 4 == 0 ? od.x : tile % 4 == 1 ? od.y : tile % 4 == 2 ? od.z : od.w;
            a[tile][2 * half] = __byte_perm(ew, ow, 0x5410);
            a[tile][2 * half + 1] = __byte_perm(ew, ow, 0x7632);
          }
        }
#pragma unroll
        for (int tile = 0; tile < 8; ++tile) accumulate(o[4 * part + tile], a[tile], p);
      }
    } else {
#pragma unroll
      for (int part = 0; part < chunks_per_group; ++part) {  // channel tiles 4 part .. 4 part + 3
        const int chunk = g * chunks_per_group + part;
        std::uint32_t a[4][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // tokens (2 q, 2 q + 1), then (2 q + 8, 2 q + 9)
          std::uint32_t even[8], odd[8];
          v_rows.values(first + 2 * q + 8 * half, chunk, even);
          v_rows.values(first + 2 * q + 8 * half + 1, chunk, odd);
#pragma unroll
          for (int tile = 0; tile < 4; ++tile) {  // row g: channel 2 tile of the chunk; row g + 8: the next
            a[tile][2 * half] = __byte_perm(even[2 * tile], odd[2 * tile], 0x5410);
            a[tile][2 * half + 1] = __byte_perm(even[2 * tile + 1], odd[2 * tile + 1], 0x5410);
          }
        }
#pragma unroll
        for (int tile = 0; tile < 4; ++tile) accumulate(o[4 * part + tile], a[tile], p);
      }
    }
  }
  /// What `fold` writes for a warp whose rows are all masked (and so skips the fold): -inf at
  /// logits[r * Group + j] for every row r in `covered`. Whole-warp.
  __device__ __forceinline__ static void write_masked_logits(float* logits, std::uint32_t covered) {
    for (int index = lane(); index < 16 * Group; index += 32)
      if ((covered >> (index / Group)) & 1u) logits[index] = -HUGE_VALF;
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
      const int head = packed ? 2 * (q % 2) + h : 2 * q + h;
      const bool writes = head < Group && (!packed || q < 2);
#pragma unroll
      for (int c = 0; c < channel_tiles; ++c) {
        float low = o[c][h], high = o[c][2 + h];
        if constexpr (packed) {  // o_hi + o_lo of the head
          low += __shfl_xor_sync(0xffffffffu, low, 2);
          high += __shfl_xor_sync(0xffffffffu, high, 2);
        }
        if (writes) {
          temp.o[warp][head][output_channel(c, g)] = low;
          temp.o[warp][head][output_channel(c, g + 8)] = high;
        }
      }
      if (writes && g == 0) {
        temp.m[warp][head] = m[h];
        temp.l[warp][head] = total;
      }
    }
  }

 private:
  /// Where channel `channel` of q sits in the reduction order of q.k: position 16 s + kk is
  /// k-step s, row kk of the B fragment. Natural for `shared_tiles`; for `row_chunks`, channel
  /// 64 b + 16 q + 8 h + j (j < 8) is step 4 b + 2 h + j / 4, row 2 q + j % 2 (+ 8 for j % 4 >= 2).
  __device__ __forceinline__ static int reduction_position(int channel) {
    if constexpr (Path == operand_path::shared_tiles) {
      return channel;
    } else {
      const int block = channel / 64, q = (channel % 64) / 16, h = (channel % 16) / 8, j = channel % 8;
      return 16 * (4 * block + 2 * h + j / 4) + 2 * q + j % 2 + 8 * ((j / 2) % 2);
    }
  }

  /// The channel of row `row` (0-15) of output tile c (O^T's M rows).
  __device__ __forceinline__ static int output_channel(int c, int row) {
    if constexpr (Path == operand_path::shared_tiles)
      return 16 * c + row;
    else
      return (row % 8) * (HeadDim / 8) + 2 * c + row / 8;
  }

  /// s += the k-steps 2 pair and 2 pair + 1 of K Q^T, given their A fragments: q's B fragments
  /// (hi, and lo unless packed) come from the query tiles with one ldmatrix.x4 each.
  __device__ __forceinline__ static void multiply_queries(float (&s)[4], const std::uint32_t (&a0)[4],
                                                          const std::uint32_t (&a1)[4], const std::byte* query_tiles,
                                                          int pair) {
    const int i = lane(), q_chunk = 4 * pair + i / 8;
    std::uint32_t q_hi[4], q_lo[4];  // b0, b1 of both steps (packed: hi and lo columns)
    detail::ldmatrix_x4(q_hi, query_tiles + (i % 8) * query_pitch + q_chunk * 16);
    detail::mma_16816<T>(s, a0, q_hi[0], q_hi[1]);
    detail::mma_16816<T>(s, a1, q_hi[2], q_hi[3]);
    if constexpr (!packed) {
      detail::ldmatrix_x4(q_lo, query_tiles + (8 + i % 8) * query_pitch + q_chunk * 16);
      detail::mma_16816<T>(s, a0, q_lo[0], q_lo[1]);
      detail::mma_16816<T>(s, a1, q_lo[2], q_lo[3]);
    }
  }

  /// The online-softmax step of a fold: completes the logits `s` (S^T's C fragment; packed, adds
  /// the hi and lo columns), masks the rows not in `rows`, moves m and l, rescales o where a
  /// running max moved, and returns P^T as B fragments (movmatrix of the packed C fragment).
  __device__ __forceinline__ p_fragments online_softmax(float (&s)[4], std::uint32_t rows, float* logits,
                                                        std::uint32_t covered) {
    const int i = lane(), g = i / 4;
    if constexpr (packed)  // q_hi.k + q_lo.k: columns h and 4 + h sit in lanes q and q ^ 2
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] += __shfl_xor_sync(0xffffffffu, s[e], 2);
    // Per head over the 16 tokens: this lane has tokens g (s[0..1]) and g + 8 (s[2..3]) of heads
    // 2 q, 2 q + 1; the 8 lanes of a quad position share the heads.
    if (((rows >> g) & 1u) == 0) s[0] = s[1] = -HUGE_VALF;
    if (((rows >> (g + 8)) & 1u) == 0) s[2] = s[3] = -HUGE_VALF;
    if (logits != nullptr) write_logits(s, logits, covered);
    // exp(x - m_new) as 2^(x log2 e - m_new log2 e): one FFMA and one ex2 per logit. A masked
    // logit (-inf) gives 0; while no token was valid (m_new = -inf) the subtrahend is 0, not inf.
    constexpr float log2e = 1.4426950408889634f;
    float rescale[2], p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(s[h], s[2 + h]);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      const float m_new = fmaxf(m[h], tile_max);
      const bool any = m_new != -HUGE_VALF;  // false only while no token was valid for this warp
      const float m_log2 = any ? m_new * log2e : 0.0f;
      rescale[h] = any ? exp2_approx(fmaf(m[h], log2e, -m_log2)) : 1.0f;
      p[h] = exp2_approx(fmaf(s[h], log2e, -m_log2));
      p[2 + h] = exp2_approx(fmaf(s[2 + h], log2e, -m_log2));
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
    // The C fragment (token rows, head columns) packed to T, each 8x8 block transposed in
    // registers (b0: tokens 0-7, b1: tokens 8-15, column = head g). p = hi + lo.
    float hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) hi[e] = detail::round_operand<T>(p[e]);
    p_fragments f;
    if constexpr (packed) {
      const bool lo_lane = (i % 4) >= 2;
      float half[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) half[e] = lo_lane ? p[e] - hi[e] : hi[e];
      f.hi[0] = detail::transpose_8x8(detail::pack_pair<T>(half[0], half[1]));
      f.hi[1] = detail::transpose_8x8(detail::pack_pair<T>(half[2], half[3]));
      f.lo[0] = f.lo[1] = 0u;
    } else {
      f.hi[0] = detail::transpose_8x8(detail::pack_pair<T>(hi[0], hi[1]));
      f.hi[1] = detail::transpose_8x8(detail::pack_pair<T>(hi[2], hi[3]));
      f.lo[0] = detail::transpose_8x8(detail::pack_pair<T>(p[0] - hi[0], p[1] - hi[1]));
      f.lo[1] = detail::transpose_8x8(detail::pack_pair<T>(p[2] - hi[2], p[3] - hi[3]));
    }
    return f;
  }

  /// 2^x by the SFU (`ex2.approx.ftz`: about 2 ulp; results below 2^-126 flush to 0, as
  /// exp(x - m) below 1e-38 adds nothing to a sum of which exp(0) = 1 is a term). 2^-inf = 0.
  __device__ __forceinline__ static float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }

  /// Stores the logits `s` of this lane (tokens g and g + 8, heads 2 q and 2 q + 1; packed, the
  /// lanes q < 2 hold heads 2 q and 2 q + 1 of the sum) for the rows in `covered`.
  __device__ __forceinline__ static void write_logits(const float (&s)[4], float* logits, std::uint32_t covered) {
    const int i = lane(), g = i / 4, q = i % 4;
    if (packed && q >= 2) return;  // the hi + lo sum is in lanes q and q ^ 2 alike
    const int head = 2 * q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = g + 8 * half;
      if (((covered >> row) & 1u) == 0) continue;
      float* at = logits + row * Group + head;
      if constexpr (Group % 2 == 0) {
        if (head < Group) *reinterpret_cast<float2*>(at) = make_float2(s[2 * half], s[2 * half + 1]);
      } else {
        if (head < Group) at[0] = s[2 * half];
        if (head + 1 < Group) at[1] = s[2 * half + 1];
      }
    }
  }

  /// o_tile += (one 16-channel tile of V^T, as an A fragment) P^T.
  __device__ __forceinline__ static void accumulate(float (&o_tile)[4], const std::uint32_t (&a)[4],
                                                    const p_fragments& p) {
    detail::mma_16816<T>(o_tile, a, p.hi[0], p.hi[1]);
    if constexpr (!packed) detail::mma_16816<T>(o_tile, a, p.lo[0], p.lo[1]);
  }
};

}  // namespace kvmosaic::cuda
