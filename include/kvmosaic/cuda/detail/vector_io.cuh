// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Bit-level helpers of the kernels: 16-byte loads that bypass L1 (KV is streamed once), and the
/// widening of 8 packed 16-bit values to float. One place for both, so every format's collective
/// loads and converts the same way.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::detail {

/// 8 elements of 16 bits: the unit of every vector load (16 bytes).
constexpr int vector_elements = 8;

/// Streaming 16-byte load through the read-only path, not allocated in L1.
__device__ __forceinline__ uint4 load_streaming(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

/// Widens 8 packed 16-bit values of type T to float.
template <class T>
__device__ __forceinline__ void widen(const uint4& raw, float (&out)[vector_elements]);

template <>
__device__ __forceinline__ void widen<bfloat16>(const uint4& raw, float (&out)[vector_elements]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);          // bf16 -> f32 is a shift
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void widen<half>(const uint4& raw, float (&out)[vector_elements]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h2;
    *reinterpret_cast<std::uint32_t*>(&h2) = words[i];
    const float2 f = __half22float2(h2);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

}  // namespace kvmosaic::cuda::detail
