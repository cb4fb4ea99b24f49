// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Addressing of dense K or V tiles in shared memory, as the attention collectives read them:
/// the 128-byte-swizzled layout of the tensor-core collective and plain rows for the SIMT one.
/// Pure index arithmetic; the kernels that fill tiles (a format's expansion, a TMA box) and
/// the row sources that read them (collective/row_sources.cuh) share it.

#include <cstdint>

namespace kvmosaic::cuda {

/// Dense tile addressing: the 128-byte-swizzled layout of the tensor-core collective (64-channel
/// blocks of `Tokens` rows of 128 bytes; 16-byte chunk k of row r at chunk k ^ (r mod 8)).
/// `column(c).at(t)` hoists what is constant along a K tile in the paper's layout (a channel),
/// leaving 2-4 integer operations per element.
template <int Tokens>
struct swizzled_tile {
  struct column_address {
    std::uint32_t base, chunk_key;
    /// Byte offset of (token, this channel): t * 128 + ((t mod 8) ^ chunk) * 16 + base.
    __device__ __forceinline__ std::uint32_t at(std::uint32_t token) const {
      return base + (token << 7) + (((token << 4) & 0x70u) ^ chunk_key);
    }
  };
  __device__ __forceinline__ static column_address column(int channel) {
    return {static_cast<std::uint32_t>((channel / 64) * Tokens * 128 + (channel % 8) * 2),
            static_cast<std::uint32_t>(((channel % 64) / 8) << 4)};
  }
  /// Byte offset of the 16-byte chunk holding channels 8 k .. 8 k + 7 of a token.
  __device__ __forceinline__ static std::uint32_t chunk(int token, int k) {
    return static_cast<std::uint32_t>((k / 8) * Tokens * 128 + token * 128 + (((k % 8) ^ (token & 7)) << 4));
  }
};

/// Dense tile addressing: plain rows of `HeadDim` 16-bit values (the SIMT collective's layout).
template <int HeadDim>
struct row_major_tile {
  struct column_address {
    std::uint32_t base;
    __device__ __forceinline__ std::uint32_t at(std::uint32_t token) const { return base + token * (HeadDim * 2); }
  };
  __device__ __forceinline__ static column_address column(int channel) {
    return {static_cast<std::uint32_t>(channel * 2)};
  }
  __device__ __forceinline__ static std::uint32_t chunk(int token, int k) {
    return static_cast<std::uint32_t>((token * HeadDim + k * 8) * 2);
  }
};

}  // namespace kvmosaic::cuda
