// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The tensor-core atoms the decode kernels use: `mma.sync.m16n8k16` with 16-bit operands and fp32
/// accumulators (sm_80+), the packing of float pairs into its 16-bit operand registers, and the
/// integer `m16n8k32` with int8 operands and int32 accumulators (quant2's codes).
/// Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16"), for lane = 4 g + q:
///   A (16x16, row): a[0] = (row g,   k 2q..2q+1)  a[1] = (row g+8, k 2q..2q+1)
///                   a[2] = (row g,   k 2q+8..+9)  a[3] = (row g+8, k 2q+8..+9)
///   B (16x8, col):  b[0] = (k 2q..2q+1, col g)    b[1] = (k 2q+8..+9, col g)
///   C (16x8):       c[0..1] = (row g, cols 2q, 2q+1)   c[2..3] = (row g+8, cols 2q, 2q+1)

#include <cstdint>
#include <type_traits>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::detail {

/// The body of an atom compiled for an architecture without its instruction (the host pass, or
/// a portable build that never calls it): uses the operands and traps.
template <class... Operands>
__device__ __forceinline__ void unsupported_architecture(const Operands&...) {
  __trap();
}

/// `x` as a T operand (nearest even), without the saturation of a stored value (`pack_pair`'s
/// reasoning applies): one hardware conversion. Saturating here costs the folds that stage
/// operands registers they spill (benchmark/README.md, "Decisions the code cites").
template <class T>
__device__ __forceinline__ T to_operand(float x) {
  static_assert(std::is_same<T, half>::value || std::is_same<T, bfloat16>::value,
                "kvmosaic: to_operand converts to half or bfloat16 operands");
  if constexpr (std::is_same<T, half>::value)
    return T::from_bits(__half_as_ushort(__float2half_rn(x)));
  else
    return T::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}

/// Two floats as T operands (`to_operand`) in one 32-bit operand register, `low` first. Two
/// scalar conversions, not the paired one (`__floats2half2_rn`): the paired form made the sm_90
/// bitmap_tiles fold spill more (benchmark/README.md, "Decisions the code cites").
template <class T>
__device__ __forceinline__ std::uint32_t pack_pair(float low, float high) {
  return static_cast<std::uint32_t>(to_operand<T>(low).bits) | (static_cast<std::uint32_t>(to_operand<T>(high).bits) << 16);
}

/// `x` rounded to T (nearest even) and back, without saturation (`to_operand`): the hi part of
/// an operand split into hi + lo 16-bit halves.
template <class T>
__device__ __forceinline__ float round_operand(float x) {
  if constexpr (std::is_same<T, half>::value)
    return __half2float(__float2half_rn(x));
  else
    return __bfloat162float(__float2bfloat16_rn(x));
}

/// The 8x8 16-bit matrix held in fragment layout (lane 4 g + q: row g, columns 2 q, 2 q + 1),
/// transposed, in the same layout: one `movmatrix` (sm_75+). Turns a C fragment packed to 16 bits
/// into a B fragment of the next product.
__device__ __forceinline__ std::uint32_t transpose_8x8(std::uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
#else
  unsupported_architecture(x);
  return x;
#endif
}

/// c += a * b for one m16n8k16 tile with T (half or bfloat16) operands.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<bfloat16>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                    std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

template <>
__device__ __forceinline__ void mma_16816<half>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

/// c += a * b for one m16n8k32 tile of int8 operands (values 0..255 fit as unsigned: u8 x u8,
/// s32 accumulators). Fragments (PTX ISA, "mma.m16n8k32"), lane = 4 g + q, 4 bytes a register:
///   A (16x32, row): a[0] = (row g, k 4q..4q+3)  a[1] = (row g+8, k 4q..)  a[2] = (row g, k 16+4q..)
///                   a[3] = (row g+8, k 16+4q..)
///   B (32x8, col):  b0 = (k 4q..4q+3, col g)    b1 = (k 16+4q.., col g)
///   C (16x8):       c[0..1] = (row g, cols 2q, 2q+1)   c[2..3] = (row g+8, cols 2q, 2q+1)
/// sm_80+ runs it as one instruction; sm_75 as four m8n8k16 products with the same fragments.
__device__ __forceinline__ void mma_u8_16832(int (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  // m8n8k16: A (8x16) a = (row g, k 4q..4q+3), B b = (k 4q.., col g), C = (row g, cols 2q, 2q+1).
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[0]), "+r"(c[1]) : "r"(a[0]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[0]), "+r"(c[1]) : "r"(a[2]), "r"(b1));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[2]), "+r"(c[3]) : "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[2]), "+r"(c[3]) : "r"(a[3]), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

}  // namespace kvmosaic::cuda::detail
