// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `quant_warp_attend`: the warp collective of `format::quant<Bits, ValueAxis>` decode attention
/// (HACK, Eq. 4), computed on the 2- or 4-bit codes with int8 tensor cores; the cache is never
/// dequantized.
///
/// A warp folds a partition of Pi tokens (K partitioned along tokens per channel; V along tokens
/// per channel, or along head_dim per token) into a running softmax state for every query head of
/// its GQA group:
///  1. q' = q * s_K (the partition's per-channel K scales) is quantized to 8 bits per group of Pi
///     channels, and base = q . m_K (the per-channel K mins) is one number per head;
///  2. S^T = K Q'^T on tensor cores: int8 m16n8k32 products of the codes, unpacked from the page
///     by shift and mask (the page stores them as the A operand), with the quantized q';
///     logit = base + sum over channel groups of (m_q' * code sum of the token + s_q' * dot);
///  3. p = exp(logit - partition max) is quantized to 8 bits over the partition (V per token:
///     p' = p s_V, per group of Pi channels, with base = p . m_V per group: step 1 mirrored);
///  4. O^T = V^T P^T on tensor cores, with Eq. 4's corrections per (channel, head):
///     o += Pi m_p m_v + m_p s_v sum(v codes) + s_p m_v sum(p codes) + s_p s_v dot
///     (V per token: o += base + m_p' sum(v codes) + s_p' dot, the sums along tokens).
/// The quantization of q' and p is the host reference's (`detail::quantize8`) operation for
/// operation, in round-to-nearest fp32 without contraction, so both draw the same 8-bit codes;
/// the logits and outputs then differ by fp32 rounding only, and where that moves a p value
/// across a rounding boundary of its 8-bit grid, by one step of that code.
///
/// Mins and scales are read in the cache's storage dtype (`Storage`: half or bfloat16, as the
/// encoder stores them). NaN: a NaN min or scale (a partition the encoder saw a non-finite value
/// in) or a NaN q makes the outputs that read it NaN, as on the host; every float-to-integer
/// conversion is clamped first (NaN to code 0), so no input is undefined behaviour.
///
/// Thread mapping: lane 4 g + q owns heads 2q and 2q + 1 (the C fragment's columns) and, of the
/// output, channels 16 t + g and 16 t + g + 8 of every 16-channel tile t. Groups of fewer than 8
/// heads leave columns unused: the product costs the same, so the group size is a run-time value
/// (one instantiation serves groups 1-8).
///
/// Cost per partition and warp: (Pi / 16) (D / 32) + (D / 16) (Pi / 32) tensor-core products,
/// four shift-and-mask pairs per 16 codes (from Bits / 2 words), and O(G D / 32 + G Pi / 32) fp32
/// work per lane for the quantization of q' and p and the corrections (V per token: G D / 32 for
/// p' instead of G Pi / 32, and D / Pi 8-bit grids of p per head instead of one).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/detail/mma.cuh"
#include "kvmosaic/format/quant.hpp"

namespace kvmosaic::cuda {

/// Where the parts of one quantized page (K or V of one head) lie, in bytes from its start (see
/// format/quant.hpp: mins, scales, code sums, codes).
struct quant_page_geometry {
  int page_size;
  int partitions;
  int per_channel;  ///< partitions per channel: page_size / Pi
  int sums_at;
  int codes_at;

  __host__ __device__ static quant_page_geometry of(int page_size, int head_dim, int partition, int bits) {
    const int partitions = page_size * head_dim / partition;
    const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, partition);
    return quant_page_geometry{page_size, partitions, page_size / partition, partitions * 4,
                                partitions * (4 + sum_bytes)};
  }
};

/// `Storage`: the cache's 16-bit storage type (kvmosaic::half or kvmosaic::bfloat16), the type
/// of the pages' mins and scales. `Format`: the `format::quant<Bits, ValueAxis>` the pages hold.
template <int HeadDim, int Partition, class Storage, class Format>
class quant_warp_attend {
  static_assert(Partition == 32 || Partition == 64 || Partition == 128,
                "quant_warp_attend: Partition (format::quant::partition) must be 32, 64 or 128");
  static_assert(HeadDim % Partition == 0 && HeadDim % 32 == 0,
                "quant_warp_attend: HeadDim must be a multiple of Partition (K groups channels by Pi)");
  static_assert(sizeof(dtype_traits<Storage>) > 0 && sizeof(Storage) == 2,
                "quant_warp_attend: Storage must be kvmosaic::half or kvmosaic::bfloat16");

 public:
  static constexpr int max_group = 8;  ///< query heads per KV head: the product's N
  static constexpr int channels_per_lane = HeadDim / 32;           ///< of q' while it is quantized
  static constexpr int lanes_per_channel_group = Partition / channels_per_lane;
  static constexpr int channel_groups = HeadDim / Partition;       ///< 8-bit partitions of q'
  static constexpr int token_tiles = Partition / 16;               ///< M tiles of q.k
  static constexpr int channel_steps = HeadDim / 32;               ///< K steps of q.k
  static constexpr int channel_tiles = HeadDim / 16;               ///< M tiles of p.v
  static constexpr int token_steps = Partition / 32;               ///< K steps of p.v
  static constexpr int bits = Format::bits;
  static constexpr int code_words = bits / 2;  ///< 32-bit words of codes per lane and tile
  static constexpr bool v_per_token = Format::v_axis == format::value_axis::head_dim;
  static constexpr int p_rows = v_per_token ? channel_groups : 1;  ///< 8-bit grids of p per head
  static constexpr int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, Partition);
  // Rows of the operand tables padded by 4 words: lanes g = 0..7 reading column q land in
  // distinct banks.
  static constexpr int q_row_words = HeadDim / 4 + 4;
  static constexpr int p_row_words = Partition / 4 + 4;

  /// Per-warp scratch: the partition's 8-bit q' and p (or p') operands and q's quantization
  /// constants.
  struct temp_storage {
    std::uint32_t q_codes[8][q_row_words];
    std::uint32_t p_codes[8][p_rows][p_row_words];
    float q_min[8][channel_groups];
    float q_scale[8][channel_groups];
    float q_base[8];
  };

  float o[channel_tiles][4];  ///< unnormalized output, C fragment layout: channels x heads
  float m[2];                 ///< running max of heads 2q, 2q + 1
  float l[2];                 ///< running sum of exp(logit - m) over this lane's tokens (rows g, g + 8):
                              ///< the 8 lanes of a column sum theirs once, at the end
  int group;                  ///< query heads per KV head, 1 to 8

  /// Empty state for `group_size` query heads; zeroes the rows of heads past the group in `temp`
  /// (read as zero operands).
  __device__ __forceinline__ void start(int group_size, temp_storage& temp) {
    group = group_size;
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[t][e] = 0.0f;
    m[0] = m[1] = -HUGE_VALF;
    l[0] = l[1] = 0.0f;
    const int lane = lane_id();
    for (int h = group; h < max_group; ++h) {
      for (int i = lane; i < q_row_words; i += 32) temp.q_codes[h][i] = 0u;
      if (lane < channel_groups) {
        temp.q_min[h][lane] = 0.0f;
        temp.q_scale[h][lane] = 0.0f;
      }
      if (lane == 0) temp.q_base[h] = 0.0f;
    }
    __syncwarp();
  }

  /// Folds partition `j` of a page in shared memory (`k_page`, `v_page`: one head's quantized K and
  /// V pages) into the state. `q`: the group's queries times the softmax scale, [group][HeadDim]
  /// in shared memory. The page's first `masked` tokens (sinks, attended as dense rows) get p = 0,
  /// and so do those whose bit in `rows_read` (bit t % 32 of word t / 32; null: all read) is clear.
  /// The partition must hold a token read (the caller skips the others: `reads_partition`, and
  /// `write_masked_logits` for them). With `logits` (a step that records token scores: the page's
  /// row 0 of `decode_params::token_logits`, [row][group]), each token's logit per query head as
  /// the softmax takes it (-inf where masked) is written there.
  __device__ __forceinline__ void fold_partition(const std::byte* k_page, const std::byte* v_page,
                                                 const quant_page_geometry& geometry, int j, const float* q,
                                                 temp_storage& temp, int masked = 0,
                                                 const std::uint32_t* rows_read = nullptr, float* logits = nullptr) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    quantize_folded_query(k_page, geometry, j, q, group, temp);
    __syncwarp();

    // q.k: int8 products per 16-token tile, then the per-group corrections.
    std::uint32_t b_q[channel_steps][2];
    load_b_fragments(temp.q_codes[g], quad, b_q);
    float base[2], q_min[2][channel_groups], q_scale[2][channel_groups];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      base[hh] = temp.q_base[2 * quad + hh];
#pragma unroll
      for (int c = 0; c < channel_groups; ++c) {
        q_min[hh][c] = temp.q_min[2 * quad + hh][c];
        q_scale[hh][c] = temp.q_scale[2 * quad + hh][c];
      }
    }
    const auto* k_codes = reinterpret_cast<const std::uint32_t*>(k_page + geometry.codes_at);
    const std::byte* k_sums = k_page + geometry.sums_at;
    float s[token_tiles][4];
#pragma unroll
    for (int t = 0; t < token_tiles; ++t) {
      int dot[channel_groups][4];
#pragma unroll
      for (int c = 0; c < channel_groups; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) dot[c][e] = 0;
      const int tile_row = j * token_tiles + t;
#pragma unroll
      for (int k = 0; k < channel_steps; ++k) {
        std::uint32_t a[4];
        unpack(k_codes, tile_row * channel_steps + k, lane, a);
        detail::mma_u8_16832(dot[k * 32 / Partition], a, b_q[k][0], b_q[k][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = j * Partition + t * 16 + g + 8 * (e / 2), hh = e % 2;
        float logit = base[hh];
#pragma unroll
        for (int c = 0; c < channel_groups; ++c) {
          const float code_sum = load_sum(k_sums, token * channel_groups + c);
          logit += q_min[hh][c] * code_sum + q_scale[hh][c] * small_to_float(dot[c][e]);
        }
        s[t][e] = logit;
      }
    }
    if (masked > 0 || rows_read != nullptr) {  // branches the warp takes together
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = j * Partition + t * 16 + g + 8 * (e / 2);
          if (token < masked || (rows_read != nullptr && ((rows_read[token >> 5] >> (token & 31)) & 1u) == 0))
            s[t][e] = -HUGE_VALF;
        }
    }
    if (logits != nullptr) write_logits(logits, j * Partition, s);

    // Softmax over the partition: p relative to the partition's max (as the host's page-local
    // softmax when a page is one partition), quantized to 8 bits per head.
    float block_max[2] = {-HUGE_VALF, -HUGE_VALF};
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) block_max[e % 2] = fmaxf(block_max[e % 2], s[t][e]);
    float p_lo[2] = {HUGE_VALF, HUGE_VALF}, p_sum[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) block_max[hh] = reduce_max_over_rows(block_max[hh]);
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[t][e] = __expf(s[t][e] - block_max[e % 2]);
        p_lo[e % 2] = fminf(p_lo[e % 2], s[t][e]);
      }
    if constexpr (v_per_token) {
      fold_values_per_token(v_page, geometry, j, s, block_max, temp);
    } else {  // V per channel
      // The largest p is exp(0) = 1 exactly (ex2.approx(0) = 1), as on the host.
      float p_step[2], p_inverse[2], p_bias[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        p_lo[hh] = reduce_min_over_rows(p_lo[hh]);
        p_step[hh] = step_of(p_lo[hh], 1.0f);
        p_inverse[hh] = inverse_of(p_step[hh]);
        p_bias[hh] = bias_of(p_lo[hh], p_inverse[hh]);
        p_sum[hh] = 0.0f;
      }
      int code_sum[2] = {0, 0};
      auto* p_bytes = reinterpret_cast<std::uint8_t*>(&temp.p_codes[0][0][0]);
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e % 2;
          p_sum[hh] += s[t][e];
          const int code = quantize8(s[t][e], p_inverse[hh], p_bias[hh]);
          code_sum[hh] += code;
          p_bytes[(2 * quad + hh) * p_rows * p_row_words * 4 + t * 16 + g + 8 * (e / 2)] = static_cast<std::uint8_t>(code);
        }
      float alpha[2], b_mean[2], b_min[2], b_step[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        code_sum[hh] = reduce_sum_over_rows(code_sum[hh]);
        const float m_new = fmaxf(m[hh], block_max[hh]);
        alpha[hh] = __expf(m[hh] - m_new);
        const float beta = __expf(block_max[hh] - m_new);
        m[hh] = m_new;
        l[hh] = l[hh] * alpha[hh] + beta * p_sum[hh];
        // Eq. 4 regrouped: o += m_v (Pi m_p + s_p sum_p) + s_v (m_p sum_v + s_p dot), all times beta.
        b_mean[hh] = beta * (static_cast<float>(Partition) * p_lo[hh] + p_step[hh] * small_to_float(code_sum[hh]));
        b_min[hh] = beta * p_lo[hh];
        b_step[hh] = beta * p_step[hh];
      }
      __syncwarp();

      // p.v: int8 products per 16-channel tile, Eq. 4's corrections per output.
      std::uint32_t b_p[token_steps][2];
      load_b_fragments(temp.p_codes[g][0], quad, b_p);
      const auto* v_codes = reinterpret_cast<const std::uint32_t*>(v_page + geometry.codes_at);
      const int token_columns = geometry.page_size / 32;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        int dot[4];
        value_tile_dot(v_codes, t * token_columns + j * token_steps, lane, b_p, dot);
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int part = (t * 16 + g + 8 * half_row) * geometry.per_channel + j;
          const float v_min = load_stored(v_page, part);
          const float v_scale = load_stored(v_page + geometry.partitions * 2, part);
          const float v_sum = load_sum(v_page + geometry.sums_at, part);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * half_row + hh;
            const float corrected = b_min[hh] * v_sum + b_step[hh] * small_to_float(dot[e]);
            o[t][e] = o[t][e] * alpha[hh] + v_min * b_mean[hh] + v_scale * corrected;
          }
        }
      }
      __syncwarp();  // temp is rewritten by the next partition
    }
  }

  /// -inf as the logits of partition `j`'s tokens (`logits`: the page's row 0, [row][group]): a
  /// partition the caller skips reads none of its tokens. The whole warp calls it.
  __device__ __forceinline__ void write_masked_logits(float* logits, int j) const {
    for (int i = lane_id(); i < Partition * group; i += 32) logits[static_cast<std::size_t>(j) * Partition * group + i] = -HUGE_VALF;
  }

  /// Whether partition `j` of a page holds a token to fold: past the first `masked` of the page,
  /// and marked in `rows_read` (null: all).
  __device__ __forceinline__ static bool reads_partition(const std::uint32_t* rows_read, int j, int masked) {
    if (rows_read == nullptr) return masked < (j + 1) * Partition;
    std::uint32_t any = 0;
#pragma unroll
    for (int w = 0; w < Partition / 32; ++w) {
      const int base = (j * (Partition / 32) + w) * 32;
      const std::uint32_t past_masked = masked <= base ? ~0u : masked - base >= 32 ? 0u : ~((1u << (masked - base)) - 1u);
      any |= rows_read[base / 32] & past_masked;
    }
    return any != 0;
  }

  /// Folds `n` (1 to 16) dense rows of the tail (16-bit, [n][HeadDim] from `k_rows`, `v_rows` in
  /// global memory) in fp32: exact softmax, as the host folds its tail. With `logits` (the first
  /// row's place in `decode_params::token_logits`, [row][group]), each row's logits go there.
  template <class T>
  __device__ __forceinline__ void fold_dense_rows(const T* k_rows, const T* v_rows, int n, const float* q,
                                                  float* logits = nullptr) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = g + 8 * (e / 2), head = 2 * quad + e % 2;
      float dot = 0.0f;
      if (token < n && head < group) {
        const T* k = k_rows + static_cast<std::size_t>(token) * HeadDim;
        const float* q_h = q + head * HeadDim;
#pragma unroll 8
        for (int c = 0; c < HeadDim; ++c) dot += q_h[c] * to_float(k[c]);
      }
      s[e] = token < n ? dot : -HUGE_VALF;
      if (logits != nullptr && token < n && head < group) logits[static_cast<std::size_t>(token) * group + head] = dot;
    }
    float block_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])}, p_sum[2], alpha[2], beta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) block_max[hh] = reduce_max_over_rows(block_max[hh]);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = __expf(s[e] - block_max[e % 2]);  // 0 past n
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      p_sum[hh] = s[hh] + s[2 + hh];
      const float m_new = fmaxf(m[hh], block_max[hh]);
      alpha[hh] = __expf(m[hh] - m_new);
      beta[hh] = __expf(block_max[hh] - m_new);
      m[hh] = m_new;
      l[hh] = l[hh] * alpha[hh] + beta[hh] * p_sum[hh];
    }
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[t][e] *= alpha[e % 2];
    for (int token = 0; token < n; ++token) {
      // p of (token, heads 2q, 2q + 1) lives in lane 4 (token % 8) + q, elements 2 (token / 8) + hh.
      const int source = 4 * (token % 8) + quad;
      const float p0 = __shfl_sync(0xffffffffu, token < 8 ? s[0] : s[2], source) * beta[0];
      const float p1 = __shfl_sync(0xffffffffu, token < 8 ? s[1] : s[3], source) * beta[1];
      const T* v = v_rows + static_cast<std::size_t>(token) * HeadDim;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        const float v0 = to_float(v[t * 16 + g]), v1 = to_float(v[t * 16 + g + 8]);
        o[t][0] += p0 * v0;
        o[t][1] += p1 * v0;
        o[t][2] += p0 * v1;
        o[t][3] += p1 * v1;
      }
    }
  }

  /// This lane's share of the state for a CTA reduction: calls out(head, channel, o) for its
  /// outputs and, on lanes 0..3, state(head, m, l), for heads of the group.
  template <class Out, class State>
  __device__ __forceinline__ void for_each_output(Out&& out, State&& state) const {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    const float l_total[2] = {reduce_sum_over_rows(l[0]), reduce_sum_over_rows(l[1])};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int head = 2 * quad + hh;
      if (head >= group) continue;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        out(head, t * 16 + g, o[t][hh]);
        out(head, t * 16 + g + 8, o[t][2 + hh]);
      }
      if (g == 0) state(head, m[hh], l_total[hh]);
    }
  }

 private:
  __device__ __forceinline__ static int lane_id() { return static_cast<int>(threadIdx.x) % 32; }
  /// This lane's logits of a partition starting at page row `first` (rows g, g + 8 of each 16-row
  /// tile, heads 2q, 2q + 1) into `logits`, [row][group], heads past the group skipped.
  __device__ __forceinline__ void write_logits(float* logits, int first, const float (&s)[token_tiles][4]) const {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = 2 * quad + e % 2;
        if (head < group) logits[static_cast<std::size_t>(first + t * 16 + g + 8 * (e / 2)) * group + head] = s[t][e];
      }
  }

  /// The B fragments of K steps of 32 from `row` (column g of B: one head's 8-bit codes).
  template <int Steps>
  __device__ __forceinline__ static void load_b_fragments(const std::uint32_t* row, int quad,
                                                          std::uint32_t (&b)[Steps][2]) {
#pragma unroll
    for (int k = 0; k < Steps; ++k) {
      b[k][0] = row[k * 8 + quad];
      b[k][1] = row[k * 8 + 4 + quad];
    }
  }

  /// The A fragment of code tile `tile` (16 x 32 codes) for this lane: register s is, byte-wise,
  /// bits (s % (8 / Bits)) Bits .. of word s / (8 / Bits) of the lane's Bits / 2 words
  /// (`kvmosaic::detail::quant_code_bit`): one 4- or 8-byte load, four shift-and-mask pairs.
  __device__ __forceinline__ static void unpack(const std::uint32_t* codes, int tile, int lane, std::uint32_t (&a)[4]) {
    if constexpr (bits == 2) {
      const std::uint32_t word = codes[tile * 32 + lane];
#pragma unroll
      for (int s = 0; s < 4; ++s) a[s] = (word >> (2 * s)) & 0x03030303u;
    } else {
      const uint2 words = reinterpret_cast<const uint2*>(codes)[tile * 32 + lane];
      a[0] = words.x & 0x0f0f0f0fu;
      a[1] = (words.x >> 4) & 0x0f0f0f0fu;
      a[2] = words.y & 0x0f0f0f0fu;
      a[3] = (words.y >> 4) & 0x0f0f0f0fu;
    }
  }

  /// The integer part of one 16-channel tile of O^T = V^T P^T over a partition: `token_steps`
  /// int8 products of the code tiles from `first_tile` on (along tokens) with the B operand `b_p`.
  __device__ __forceinline__ static void value_tile_dot(const std::uint32_t* v_codes, int first_tile, int lane,
                                                        const std::uint32_t (&b_p)[token_steps][2], int (&dot)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dot[e] = 0;
#pragma unroll
    for (int k = 0; k < token_steps; ++k) {
      std::uint32_t a[4];
      unpack(v_codes, first_tile + k, lane, a);
      detail::mma_u8_16832(dot, a, b_p[k][0], b_p[k][1]);
    }
  }

  /// Steps 3 and 4 for V partitioned per token (`value_axis::head_dim`): for each group c of Pi
  /// channels, p' = p s_V(token, c) is quantized to 8 bits over the partition's tokens and
  /// base = p . m_V(., c) summed; then O^T = V^T P'^T with the group's own B operand per
  /// 16-channel tile, o += base + m_p' sum_t(v codes) + s_p' dot, all times beta. `s`: this lane's
  /// p (exp(logit - block_max)), rows g, g + 8 of each 16-token tile, heads 2q, 2q + 1.
  __device__ __forceinline__ void fold_values_per_token(const std::byte* v_page, const quant_page_geometry& geometry,
                                                        int j, const float (&s)[token_tiles][4],
                                                        const float (&block_max)[2], temp_storage& temp) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    float alpha[2], beta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float p_sum = 0.0f;
#pragma unroll
      for (int t = 0; t < token_tiles; ++t) p_sum += s[t][hh] + s[t][2 + hh];
      const float m_new = fmaxf(m[hh], block_max[hh]);
      alpha[hh] = __expf(m[hh] - m_new);
      beta[hh] = __expf(block_max[hh] - m_new);
      m[hh] = m_new;
      l[hh] = l[hh] * alpha[hh] + beta[hh] * p_sum;
    }
    float v_base[2][channel_groups], v_min[2][channel_groups], v_step[2][channel_groups];
    auto* p_bytes = reinterpret_cast<std::uint8_t*>(&temp.p_codes[0][0][0]);
    const std::byte* v_scales = v_page + geometry.partitions * 2;
#pragma unroll
    for (int c = 0; c < channel_groups; ++c) {
      float folded[token_tiles][4], lo[2] = {HUGE_VALF, HUGE_VALF}, hi[2] = {-HUGE_VALF, -HUGE_VALF}, base[2] = {0.0f, 0.0f};
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int part = (j * Partition + t * 16 + g + 8 * half_row) * channel_groups + c;
          const float v_scale = load_stored(v_scales, part), v_min_value = load_stored(v_page, part);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * half_row + hh;
            folded[t][e] = __fmul_rn(s[t][e], v_scale);
            lo[hh] = fminf(lo[hh], folded[t][e]);
            hi[hh] = fmaxf(hi[hh], folded[t][e]);
            base[hh] += s[t][e] * v_min_value;
          }
        }
      float inverse[2], bias[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        lo[hh] = reduce_min_over_rows(lo[hh]);
        hi[hh] = reduce_max_over_rows(hi[hh]);
        const float step = step_of(lo[hh], hi[hh]);
        inverse[hh] = inverse_of(step);
        bias[hh] = bias_of(lo[hh], inverse[hh]);
        v_base[hh][c] = beta[hh] * reduce_sum_over_rows(base[hh]);
        v_min[hh][c] = beta[hh] * lo[hh];
        v_step[hh][c] = beta[hh] * step;
      }
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e % 2;
          p_bytes[((2 * quad + hh) * p_rows + c) * p_row_words * 4 + t * 16 + g + 8 * (e / 2)] =
              static_cast<std::uint8_t>(quantize8(folded[t][e], inverse[hh], bias[hh]));
        }
    }
    __syncwarp();

    // p'.v: int8 products per 16-channel tile against its channel group's p', then the corrections.
    const auto* v_codes = reinterpret_cast<const std::uint32_t*>(v_page + geometry.codes_at);
    const int token_columns = geometry.page_size / 32;
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t) {
      constexpr int tiles_per_group = Partition / 16;
      const int c = t / tiles_per_group;
      std::uint32_t b_p[token_steps][2];
      load_b_fragments(temp.p_codes[g][c], quad, b_p);
      int dot[4];
      value_tile_dot(v_codes, t * token_columns + j * token_steps, lane, b_p, dot);
#pragma unroll
      for (int half_row = 0; half_row < 2; ++half_row) {
        const float v_sum = load_sum(v_page + geometry.sums_at, (t * 16 + g + 8 * half_row) * geometry.per_channel + j);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int e = 2 * half_row + hh;
          o[t][e] = o[t][e] * alpha[hh] + v_base[hh][c] + v_min[hh][c] * v_sum + v_step[hh][c] * small_to_float(dot[e]);
        }
      }
    }
    __syncwarp();  // temp is rewritten by the next partition
  }

  /// x as a float for 0 <= x < 2^22 (dot products and code sums are): 2^23 + x has x in its
  /// mantissa, so one integer and one float addition replace a quarter-rate I2F conversion.
  __device__ __forceinline__ static float small_to_float(int x) {
    return __int_as_float(0x4b000000 + x) - 8388608.0f;
  }

  /// The step of an 8-bit grid over [lo, hi] and its reciprocal (0 for an empty range, and for a
  /// step below the smallest normal float, whose reciprocal may overflow: `quantize8_inverse`):
  /// the host's quantize8, operation for operation (no division: a multiply and a correctly
  /// rounded reciprocal).
  __device__ __forceinline__ static float step_of(float lo, float hi) {
    return __fmul_rn(__fsub_rn(hi, lo), 1.0f / 255.0f);
  }
  __device__ __forceinline__ static float inverse_of(float step) {
    return step >= 1.17549435e-38f ? __frcp_rn(step) : 0.0f;
  }

  /// The bias of the 8-bit grid (lo, 1 / step): code = floor(x / step + bias).
  __device__ __forceinline__ static float bias_of(float lo, float inverse) { return __fmaf_rn(-lo, inverse, 0.5f); }

  /// 8-bit code of x, round half up: the host's quantize8, rounding for rounding (one fused
  /// multiply-add). floor(y) for |y| < 2^22 is the mantissa of y + 2^23 rounded down, which keeps
  /// the float-to-int conversion off the quarter-rate pipe. For any other y (huge, infinite or
  /// NaN) the bit pattern is still an integer in [0xcb000000, 0x7fffffff] as int32, so the
  /// subtraction cannot overflow and the clamp puts it in [0, 255]: no conversion, no undefined
  /// behaviour. Finite inputs get the host's codes; a NaN gets some code in range where the host's
  /// is 0 (what reads it is NaN either way). Clamping y in float instead cost 2-3% (benchmark/README.md).
  __device__ __forceinline__ static int quantize8(float x, float inverse, float bias) {
    const float y = __fmaf_rn(x, inverse, bias);
    const int code = __float_as_int(__fadd_rd(y, 8388608.0f)) - 0x4b000000;
    return max(min(code, 255), 0);
  }

  /// Min or scale `index` of the array at `base`, in the storage dtype.
  __device__ __forceinline__ static float load_stored(const std::byte* base, int index) {
    return to_float(Storage::from_bits(reinterpret_cast<const std::uint16_t*>(base)[index]));
  }
  __device__ __forceinline__ static float load_sum(const std::byte* sums, int index) {
    if constexpr (sum_bytes == 1)
      return small_to_float(reinterpret_cast<const std::uint8_t*>(sums)[index]);
    else
      return small_to_float(reinterpret_cast<const std::uint16_t*>(sums)[index]);
  }

  // Reductions over the 8 lanes of one column pair (same q, g = 0..7).
  template <class V>
  __device__ __forceinline__ static V reduce_sum_over_rows(V x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
  }
  __device__ __forceinline__ static float reduce_max_over_rows(float x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
  }
  __device__ __forceinline__ static float reduce_min_over_rows(float x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
  }

  /// Step 1: q' = q * s_K of partition j quantized to 8 bits per group of Pi channels (lane owns
  /// channels_per_lane consecutive channels), its min, scale and base = q . m_K, into temp.
  __device__ __forceinline__ static void quantize_folded_query(const std::byte* k_page,
                                                               const quant_page_geometry& geometry, int j,
                                                               const float* q, int group, temp_storage& temp) {
    const int lane = lane_id();
    const int first_channel = lane * channels_per_lane;
    float k_min[channels_per_lane], k_scale[channels_per_lane];
#pragma unroll
    for (int i = 0; i < channels_per_lane; ++i) {
      const int part = (first_channel + i) * geometry.per_channel + j;
      k_min[i] = load_stored(k_page, part);
      k_scale[i] = load_stored(k_page + geometry.partitions * 2, part);
    }
    // Two heads per pass: their shuffle chains interleave (a pass for one head is one long chain).
    for (int first_head = 0; first_head < group; first_head += 2) {
      float folded[2][channels_per_lane], base[2], lo[2], hi[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int h = min(first_head + u, group - 1);  // an odd group repeats its last head, unstored
        base[u] = 0.0f;
        lo[u] = HUGE_VALF;
        hi[u] = -HUGE_VALF;
#pragma unroll
        for (int i = 0; i < channels_per_lane; ++i) {
          const float q_c = q[h * HeadDim + first_channel + i];
          folded[u][i] = __fmul_rn(q_c, k_scale[i]);
          base[u] += q_c * k_min[i];
          lo[u] = fminf(lo[u], folded[u][i]);
          hi[u] = fmaxf(hi[u], folded[u][i]);
        }
      }
#pragma unroll
      for (int offset = 1; offset < lanes_per_channel_group; offset *= 2)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          lo[u] = fminf(lo[u], __shfl_xor_sync(0xffffffffu, lo[u], offset));
          hi[u] = fmaxf(hi[u], __shfl_xor_sync(0xffffffffu, hi[u], offset));
        }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2)
#pragma unroll
        for (int u = 0; u < 2; ++u) base[u] += __shfl_xor_sync(0xffffffffu, base[u], offset);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int h = first_head + u;
        if (h >= group) break;
        const float step = step_of(lo[u], hi[u]);
        const float inverse = inverse_of(step);
        store_codes(temp.q_codes[h], first_channel, folded[u], inverse, bias_of(lo[u], inverse));
        if (lane % lanes_per_channel_group == 0) {
          temp.q_min[h][lane / lanes_per_channel_group] = lo[u];
          temp.q_scale[h][lane / lanes_per_channel_group] = step;
        }
        if (lane == 0) temp.q_base[h] = base[u];
      }
    }
  }

  /// The 8-bit codes of x[0 .. channels_per_lane) into row bytes [first, ...), 4 per store.
  __device__ __forceinline__ static void store_codes(std::uint32_t* row, int first, const float (&x)[channels_per_lane],
                                                     float inverse, float bias) {
    if constexpr (channels_per_lane % 4 == 0) {
#pragma unroll
      for (int w = 0; w < channels_per_lane / 4; ++w) {
        std::uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) word |= static_cast<std::uint32_t>(quantize8(x[4 * w + b], inverse, bias)) << (8 * b);
        row[first / 4 + w] = word;
      }
    } else {
      auto* bytes = reinterpret_cast<std::uint8_t*>(row) + first;
#pragma unroll
      for (int i = 0; i < channels_per_lane; ++i) bytes[i] = static_cast<std::uint8_t>(quantize8(x[i], inverse, bias));
    }
  }
};

}  // namespace kvmosaic::cuda
