// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Hopper tensor-memory-accelerator (TMA) pieces for the dense decode kernel: 2D tiled copies of
/// rows into shared memory with the 128-byte swizzle, the matching swizzled addressing, and
/// `ldmatrix` (plain and transposed) on such tiles. The swizzle puts 16-byte chunk c of row r at
/// chunk c ^ (r mod 8), so the eight rows an `ldmatrix` reads land in eight different banks.
/// Executed only on sm_90+; compiled everywhere.

#include <cuda.h>

#include <cstdint>

#include "kvmosaic/cuda/detail/bulk_copy.cuh"

namespace kvmosaic::cuda::detail {

/// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled tile whose
/// base is 1024-byte aligned.
__device__ __forceinline__ std::uint32_t swizzled_offset(int row, int chunk) {
  return static_cast<std::uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

/// Copies the box at element coordinates (x, y) of `map` into shared memory at `destination`
/// (1024-byte aligned), completing on `barrier`.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* map, int x, int y,
                                            std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          shared_address(destination)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(shared_address(barrier)), "r"(x), "r"(y)
      : "memory");
#else
  (void)destination;
  (void)map;
  (void)x;
  (void)y;
  (void)barrier;
  __trap();
#endif
}

/// Starts fetching the tensor map `map` (a `__grid_constant__` kernel parameter) into the TMA
/// unit's descriptor cache, so the first copy through it does not wait for that fetch.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
#else
  (void)map;
#endif
}

/// Four 8x8 16-bit matrices; lane i gives the address of row (i % 8) of matrix (i / 8).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
#else
  (void)r;
  (void)row_address;
  __trap();
#endif
}

/// As ldmatrix_x4, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
#else
  (void)r;
  (void)row_address;
  __trap();
#endif
}

}  // namespace kvmosaic::cuda::detail
