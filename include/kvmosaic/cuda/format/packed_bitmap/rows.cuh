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
/// Cost per 16 tokens and lane: per token read (2 for K, 4 for V) its bitmap words, one popcount
/// each and one per live slab (`locate`); per live slab a chunk of 8 (K, 2 tokens) or a run of 4
/// (V, 4 tokens) channels: at g = 1 a predicated 16-bit load per channel, at g = 2 and 4 one
/// predicated 32- or 64-bit load per group (each group's values are adjacent and aligned).

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

/// Group bits to channel bits: bit i of `groups` becomes bits [i 2^Shift, (i + 1) 2^Shift), for
/// up to 8 output bits (Shift 0, 1, 2: groups of 1, 2, 4 channels).
template <int Shift>
__device__ __forceinline__ std::uint32_t spread_group_bits(std::uint32_t groups) {
  if constexpr (Shift == 0) {
    return groups;
  } else if constexpr (Shift == 1) {
    std::uint32_t x = (groups | (groups << 2)) & 0x33u;
    x = (x | (x << 1)) & 0x55u;
    return x * 3u;
  } else {
    static_assert(Shift == 2, "groups of 1, 2 or 4 channels");
    return ((groups & 1u) * 0xfu) | ((groups >> 1) * 0xf0u);
  }
}

/// The part of a packed_bitmap row source that locates records: token t's bitmap words (`stride`
/// a record) and values (`retained` a record) in the page's slot, from token `first` on, groups
/// of 2^Shift channels. `Span` channels of each slab per lane (8 for K, 4 for V) from bit offset
/// `lane_channel` of the slab.
template <int HeadDim, int Shift, int Span>
struct packed_records {
  static_assert(Shift >= 0 && Shift <= 2, "groups of 1, 2 or 4 channels");
  static_assert(HeadDim % 64 == 0 && HeadDim <= 256, "head_dim 64, 128 or 256: a value index fits a byte");
  static constexpr int max_slabs = HeadDim / 32;
  static constexpr int max_words = (max_slabs + (1 << Shift) - 1) >> Shift;

  const std::uint32_t* bits;         ///< the page's bitmaps
  const std::uint16_t* page_values;  ///< the page's values
  int stride;                        ///< bitmap words per record of the slot
  int retained;                      ///< values per record of the slot
  int slabs;                         ///< slabs that hold kept channels: ceil(kept / 32)
  int first;

  /// One record located for one lane: per slab a 16-bit entry, two a register: the lane's
  /// channel mask (low byte) and the index of its first value (high byte: an index below 256, as
  /// head_dim <= 256).
  struct row {
    const std::uint16_t* values;
    std::uint32_t slab[(max_slabs + 1) / 2];
  };

  /// Locates the lane's `Span` channels from `lane_channel` (a multiple of Span, below 32) in
  /// every live slab of `token`'s record: its words, one popcount each, and a masked popcount per
  /// slab. Slabs from `slabs` on read as empty.
  __device__ __forceinline__ row locate(int token, int lane_channel) const {
    const int at = first + token;
    const std::uint32_t* record = bits + static_cast<std::size_t>(at) * stride;
    std::uint32_t word[max_words];
#pragma unroll
    for (int w = 0; w < max_words; ++w) word[w] = (w << Shift) < slabs ? record[w] : 0u;
    row r;
    r.values = page_values + static_cast<std::size_t>(at) * retained;
    const int lane_bit = lane_channel >> Shift;
    int before = 0;
#pragma unroll
    for (int k = 0; k < (max_slabs + 1) / 2; ++k) r.slab[k] = 0u;
#pragma unroll
    for (int k = 0; k < max_slabs; ++k) {
      const int w = k >> Shift;
      if (k > 0 && (k & ((1 << Shift) - 1)) == 0) before += __popc(word[w - 1]);
      const int shift = ((32 * k) >> Shift) % 32 + lane_bit;
      const std::uint32_t x = word[w];
      const std::uint32_t groups = (x >> shift) & ((1u << (Span >> Shift)) - 1u);
      const int at_value = before + __popc(x & ((1u << shift) - 1u));
      const std::uint32_t entry = static_cast<std::uint32_t>(at_value << Shift) << 8 | spread_group_bits<Shift>(groups);
      r.slab[k / 2] |= entry << (16 * (k % 2));
    }
    return r;
  }

  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint32_t next() { return *value++; }
  };

  /// Groups of 2 or 4 channels (Shift 1, 2) as whole loads: the `Words` 16-bit pairs of the
  /// 2 Words channels under channel mask `mask` (`open`'s), a group's values from `first` on
  /// where its bit is set (one 32-bit load for g = 2, one 64-bit load for g = 4), zeros where
  /// not. Needs each record's values aligned to a group, so r_slot a multiple of g
  /// (`packed_candidates` and `plan_segment` guarantee it). Per group a predicated load and step.
  template <int Words>
  __device__ __forceinline__ static void load_group_words(std::uint32_t mask, const std::uint16_t* first,
                                                          std::uint32_t (&w)[Words]) {
    static_assert(Shift == 1 || Shift == 2, "whole-group loads are for groups of 2 or 4 channels");
    if constexpr (Shift == 1) {
      const auto* at = reinterpret_cast<const std::uint32_t*>(first);
#pragma unroll
      for (int j = 0; j < Words; ++j) {
        const bool set = (mask >> (2 * j)) & 1u;
        w[j] = set ? *at : 0u;
        at += set;
      }
    } else {
      static_assert(Words % 2 == 0, "a group of 4 channels is 2 words");
      const auto* at = reinterpret_cast<const uint2*>(first);
#pragma unroll
      for (int j = 0; j < Words / 2; ++j) {
        const bool set = (mask >> (4 * j)) & 1u;
        const uint2 x = set ? *at : make_uint2(0u, 0u);
        at += set;
        w[2 * j] = x.x;
        w[2 * j + 1] = x.y;
      }
    }
  }
  /// The lane's channel mask in slab k and a cursor at its first value.
  __device__ __forceinline__ static std::uint32_t open(const row& r, int k, cursor& at) {
    const std::uint32_t entry = r.slab[k / 2] >> (16 * (k % 2));
    at.value = r.values + ((entry >> 8) & 0xffu);
    return entry & 0xffu;
  }
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

  /// Token `token`'s record, located for this lane's chunks (lane 4 g + q: channels 8 q .. 8 q
  /// + 7 of each slab).
  __device__ __forceinline__ row locate(int token) const {
    return base::locate(token, 8 * (static_cast<int>(threadIdx.x) % 4));
  }
  /// The k-step pairs that may hold kept channels.
  __device__ __forceinline__ int key_pairs() const { return this->slabs; }
  /// The lane's chunk of k-step pair `pair` (slab `pair`) of a located row: 8 channels as
  /// 16-bit pairs.
  __device__ __forceinline__ uint4 chunk(const row& r, int pair) const {
    typename base::cursor at;
    const std::uint32_t mask = base::open(r, pair, at);
    if constexpr (Shift == 0) {
      std::uint32_t v[8];
      load_chunk_values(mask, at, v);
      return pack_pairs(v);
    } else {
      std::uint32_t w[4];
      base::load_group_words(mask, at.value, w);
      return make_uint4(w[0], w[1], w[2], w[3]);
    }
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

  /// Token `token`'s record, located for this lane's runs (lane group g: channels 4 g .. 4 g + 3
  /// of each slab).
  __device__ __forceinline__ row locate(int token) const {
    return base::locate(token, 4 * (static_cast<int>(threadIdx.x) % 32 / 4));
  }
  /// The output tiles that may hold kept channels.
  __device__ __forceinline__ int value_tiles() const { return 2 * this->slabs; }
  /// The lane's chunk `part` (< head_dim / 64; slabs 2 part, 2 part + 1) of a located row: 8
  /// channels, one value in the low half of each register (the high half is zero at g = 1 and
  /// may hold the next channel at g = 2, 4).
  __device__ __forceinline__ void values(const row& r, int part, std::uint32_t (&v)[8]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = 2 * part + half;
      std::uint32_t run[4] = {0u, 0u, 0u, 0u};
      if (k < this->slabs) {
        typename base::cursor at;
        const std::uint32_t mask = base::open(r, k, at);
        if constexpr (Shift == 0) {
          load_chunk_values(mask, at, run);
        } else {  // two 16-bit pairs; the high half of a low channel's register is the next value
          std::uint32_t w[2];
          base::load_group_words(mask, at.value, w);
          run[0] = w[0];
          run[1] = w[0] >> 16;
          run[2] = w[1];
          run[3] = w[1] >> 16;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) v[4 * half + j] = run[j];
    }
  }
};

}  // namespace kvmosaic::cuda
