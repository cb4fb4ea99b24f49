// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap` records as row sources of `warp_attend_mma::fold_chunks`
/// (collective/row_sources.cuh): a lane gathers the rotated channels its MMA fragments hold
/// straight from a token's record (its bitmap of one bit per group of g channels, then its
/// retained 16-bit values, packed in channel order), zeros where no bit is set. No dense tile is
/// written.
///
/// The channel orders (the slab layout). The rotated channels are cut into slabs of 32 (slab k:
/// channels 32 k .. 32 k + 31). The kept channels come first, so the truncated ones fill the last
/// slabs (whole, where kept is a multiple of 32). The two sources order channels so that a slab
/// is whole MMA steps for every lane alike, and a slab past the kept channels is skipped by the
/// whole warp, gathers and MMAs:
///   - K (`packed_key_rows`): slab k is k-step pair k of q.k. Rotated channel 32 k + 8 q + j
///     (q < 4, j < 8) is the fold's reduction channel `packed_key_position` = 64 (k / 2) + 16 q +
///     8 (k mod 2) + j, so lane 4 g + q reads 8 adjacent channels of slab k as one chunk.
///   - V (`packed_value_rows`): slab k is output tiles 2 k and 2 k + 1 of p.v. Output position P
///     (< head_dim / 8) of lane group g is rotated channel `packed_value_channel` = 32 (P / 4) +
///     4 g + P mod 4, so lane group g reads 4 adjacent channels of each slab.
/// The kernel stages q' in the K order and takes o' back from the V order.
///
/// Cost per 16 tokens and lane: per token read (2 for K, 4 for V) its live bitmap words and a
/// popcount per word but the last (`locate`); per live slab one masked popcount (the lane's
/// groups are one bit field of one word, at a bit fixed by the lane) and a chunk of 8 (K, 2
/// tokens) or a run of 4 (V, 4 tokens) channels: at g = 1 a predicated 16-bit load per channel,
/// at g = 2 and 4 one predicated 32- or 64-bit load per group (each group's values are adjacent
/// and aligned).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/collective/row_sources.cuh"

namespace kvmosaic::cuda {

/// The reduction channel (`operand_path::row_chunks`) that rotated channel `channel` of a K
/// record takes in `packed_key_rows`' order.
__host__ __device__ constexpr int packed_key_position(int channel) {
  const int slab = channel / 32, q = (channel % 32) / 8, j = channel % 8;
  return 64 * (slab / 2) + 16 * q + 8 * (slab % 2) + j;
}

/// The rotated channel of a V record that output channel `channel` of `warp_attend_mma`'s
/// row-chunk order (lane group channel / (head_dim / 8), position channel mod (head_dim / 8))
/// holds in `packed_value_rows`' order.
template <int HeadDim>
__host__ __device__ constexpr int packed_value_channel(int channel) {
  const int group = channel / (HeadDim / 8), position = channel % (HeadDim / 8);
  return 32 * (position / 4) + 4 * group + position % 4;
}

namespace detail {

/// Whether both slab orders are permutations of [0, HeadDim) (checked below at compile time).
template <int HeadDim>
constexpr bool slab_orders_are_permutations() {
  bool key[HeadDim] = {}, value[HeadDim] = {};
  for (int c = 0; c < HeadDim; ++c) {
    const int k = packed_key_position(c), v = packed_value_channel<HeadDim>(c);
    if (k < 0 || k >= HeadDim || key[k] || v < 0 || v >= HeadDim || value[v]) return false;
    key[k] = value[v] = true;
  }
  return true;
}
static_assert(slab_orders_are_permutations<64>() && slab_orders_are_permutations<128>() &&
                  slab_orders_are_permutations<256>(),
              "the K and V slab orders are permutations of the channels");
static_assert(packed_key_position(32 * 3 + 8 * 2 + 5) == 64 + 16 * 2 + 8 + 5, "slab 3, lane q = 2, channel 5");
static_assert(packed_value_channel<128>(16 * 5 + 9) == 32 * 2 + 4 * 5 + 1, "lane group 5, position 9");

/// The part of a packed_bitmap row source that locates records: token t's bitmap words (`stride`
/// a record) and values (`retained` a record) in the page's slot, from token `first` on, groups
/// of 2^Shift channels. A lane reads `Span` channels of each slab (8 for K, 4 for V), its
/// `lane_group`-th groups on: `Span >> Shift` groups a slab, so a slab's groups are one bit field
/// of one bitmap word and the lane's own field sits at a fixed bit of it.
template <int HeadDim, int Shift, int Span>
struct packed_records {
  static_assert(Shift >= 0 && Shift <= 2, "groups of 1, 2 or 4 channels");
  static_assert(HeadDim % 64 == 0 && HeadDim <= 256, "head_dim 64, 128 or 256: a group count fits a byte");
  static constexpr int max_slabs = HeadDim / 32;
  static constexpr int max_words = (max_slabs + (1 << Shift) - 1) >> Shift;
  static constexpr int span_groups = Span >> Shift;  ///< groups a lane reads in a slab
  static_assert(span_groups >= 1, "a lane reads whole groups");

  const std::uint32_t* bits;         ///< the page's bitmaps
  const std::uint16_t* page_values;  ///< the page's values
  int stride;                        ///< bitmap words per record of the slot
  int retained;                      ///< values per record of the slot
  int slabs;                         ///< slabs that hold kept channels: ceil(kept / 32)
  int first;

  /// One record: its bitmap words (zero past the live slabs), the set groups before each word
  /// (a byte each, word w at byte w mod 4 of before[w / 4]) and its values.
  struct row {
    std::uint32_t word[max_words];
    std::uint32_t before[(max_words + 3) / 4];
    const std::uint16_t* values;
  };

  /// Token `token`'s record: its live words and one popcount per word but the last.
  __device__ __forceinline__ row locate(int token) const {
    const int at = first + token;
    const std::uint32_t* record = bits + static_cast<std::size_t>(at) * stride;
    row r;
#pragma unroll
    for (int w = 0; w < max_words; ++w) r.word[w] = (w << Shift) < slabs ? record[w] : 0u;
    std::uint32_t count = 0;
#pragma unroll
    for (int w = 0; w < (max_words + 3) / 4; ++w) r.before[w] = 0u;
#pragma unroll
    for (int w = 1; w < max_words; ++w) {
      count += __popc(r.word[w - 1]);
      r.before[w / 4] |= count << (8 * (w % 4));
    }
    r.values = page_values + static_cast<std::size_t>(at) * retained;
    return r;
  }

  /// The lane's groups of slab `k` of a located row (bit j: its group j; `lane_group` below
  /// 32 >> Shift, a multiple of span_groups) and, in `first_value`, the first of their values:
  /// one masked popcount.
  __device__ __forceinline__ static std::uint32_t open(const row& r, int k, int lane_group, const std::uint16_t*& first_value) {
    const int w = k >> Shift;
    const int bit = ((32 * k) >> Shift) % 32 + lane_group;  // below 32
    const std::uint32_t x = r.word[w];
    int at = __popc(x & ((1u << bit) - 1u));
    if (w > 0) at += static_cast<int>((r.before[w / 4] >> (8 * (w % 4))) & 0xffu);
    first_value = r.values + (at << Shift);
    return (x >> bit) & ((1u << span_groups) - 1u);
  }

  /// The lane's `Span` channels of a slab as `Span / 2` words of 16-bit pairs (the lower channel
  /// in the low half): a set group's values from `first` on, zeros where its bit is clear. Per
  /// group a predicated load and step: 16-bit per channel (g = 1), one 32-bit (g = 2) or 64-bit
  /// (g = 4) load per group. Whole-group loads need each record's values aligned to a group, so
  /// r_slot a multiple of g (`packed_candidates` and `plan_segment` guarantee it).
  __device__ __forceinline__ static void load_span(std::uint32_t groups, const std::uint16_t* first,
                                                   std::uint32_t (&w)[Span / 2]) {
    if constexpr (Shift == 0) {
      std::uint32_t v[Span];
      load_chunk_values(groups, cursor{first}, v);
#pragma unroll
      for (int j = 0; j < Span / 2; ++j) w[j] = __byte_perm(v[2 * j], v[2 * j + 1], 0x5410);
    } else if constexpr (Shift == 1) {
      const auto* at = reinterpret_cast<const std::uint32_t*>(first);
#pragma unroll
      for (int j = 0; j < span_groups; ++j) {
        const bool set = (groups >> j) & 1u;
        w[j] = set ? *at : 0u;
        at += set;
      }
    } else {
      const auto* at = reinterpret_cast<const uint2*>(first);
#pragma unroll
      for (int j = 0; j < span_groups; ++j) {
        const bool set = (groups >> j) & 1u;
        const uint2 x = set ? *at : make_uint2(0u, 0u);
        at += set;
        w[2 * j] = x.x;
        w[2 * j + 1] = x.y;
      }
    }
  }

 private:
  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint32_t next() { return *value++; }
  };
};

}  // namespace detail

/// One head's K records of a packed_bitmap page as a row source of `fold_chunks`, in the K
/// slab order (file comment): lane 4 g + q's chunk of k-step pair k (fold chunk 8 (k / 2) + 2 q
/// + k mod 2) is channels 32 k + 8 q .. + 7. Groups of 2^Shift channels. Only k-step pairs below
/// `slabs` are read.
template <int HeadDim, int Shift>
struct packed_key_rows : detail::packed_records<HeadDim, Shift, 8> {
  using base = detail::packed_records<HeadDim, Shift, 8>;
  using typename base::row;

  /// The k-step pairs that may hold kept channels.
  __device__ __forceinline__ int key_pairs() const { return this->slabs; }
  /// The lane's chunk of k-step pair `pair` (slab `pair`) of a located row: 8 channels as
  /// 16-bit pairs (lane 4 g + q: channels 8 q .. 8 q + 7 of the slab).
  __device__ __forceinline__ uint4 chunk(const row& r, int pair) const {
    const std::uint16_t* first;
    const std::uint32_t groups = base::open(r, pair, (8 * (static_cast<int>(threadIdx.x) % 4)) >> Shift, first);
    std::uint32_t w[4];
    base::load_span(groups, first, w);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

/// One head's V records of a packed_bitmap page as a row source of `fold_chunks`, in the V slab
/// order (file comment): lane group g's chunk `part` (fold chunk g head_dim / 64 + part) is
/// channels 4 g .. 4 g + 3 of slabs 2 part and 2 part + 1. Groups of 2^Shift channels. Only
/// output tiles below 2 `slabs` are read.
template <int HeadDim, int Shift>
struct packed_value_rows : detail::packed_records<HeadDim, Shift, 4> {
  using base = detail::packed_records<HeadDim, Shift, 4>;
  using typename base::row;

  /// The output tiles that may hold kept channels.
  __device__ __forceinline__ int value_tiles() const { return 2 * this->slabs; }
  /// The lane's chunk `part` (< head_dim / 64; slabs 2 part, 2 part + 1) of a located row: 8
  /// channels as 16-bit pairs, zeros for a slab past `slabs`.
  __device__ __forceinline__ uint4 value_chunk(const row& r, int part) const {
    std::uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = 2 * part + half;
      if (k < this->slabs) {
        const std::uint16_t* first;
        const std::uint32_t groups = base::open(r, k, (4 * (static_cast<int>(threadIdx.x) % 32 / 4)) >> Shift, first);
        std::uint32_t run[2];
        base::load_span(groups, first, run);
        w[2 * half] = run[0];
        w[2 * half + 1] = run[1];
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

}  // namespace kvmosaic::cuda
