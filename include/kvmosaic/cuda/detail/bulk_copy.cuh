// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Hopper (sm_90) bulk copies from global to shared memory completing on an mbarrier: one thread
/// moves a whole contiguous run of a page (kilobytes) with one instruction, and the CTA waits on
/// the barrier's phase. Compiled for every architecture; executed only on sm_90+ (the kernels that
/// use it are launched only there, and trap elsewhere).

#include <cstdint>

namespace kvmosaic::cuda::detail {

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

/// A 16-byte load from shared memory.
__device__ __forceinline__ uint4 load_shared(const void* address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(shared_address(address)));
  return v;
}

/// An asynchronous copy of `Bytes` (4, 8 or 16, both addresses aligned to it) from global to
/// shared memory (sm_80+ `cp.async`: the issuing thread does not wait for it, so a thread's
/// copies are all in flight together); `async_copy_commit` groups the thread's copies and
/// `async_copy_wait` waits for its groups. Before sm_80, a load and a store.
template <int Bytes>
__device__ __forceinline__ void async_copy(void* shared, const void* global) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(shared)), "l"(global) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(shared_address(shared)), "l"(global), "n"(Bytes) : "memory");
#else
  if constexpr (Bytes == 16) *static_cast<uint4*>(shared) = __ldg(static_cast<const uint4*>(global));
  else if constexpr (Bytes == 8) *static_cast<uint2*>(shared) = __ldg(static_cast<const uint2*>(global));
  else *static_cast<unsigned*>(shared) = __ldg(static_cast<const unsigned*>(global));
#endif
}
/// Closes the thread's copies issued since the last commit into one group.
__device__ __forceinline__ void async_copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/// Waits until at most `Pending` of the thread's committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void async_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#  define KVMOSAIC_HAS_BULK_COPY 1
#else
#  define KVMOSAIC_HAS_BULK_COPY 0
#endif

/// Initializes a barrier expecting `arrivals` arrivals per phase, and makes it visible to the
/// bulk-copy engine (call __syncthreads() afterwards).
__device__ __forceinline__ void barrier_init(std::uint64_t* barrier, std::uint32_t arrivals) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  (void)barrier;
  (void)arrivals;
  __trap();
#endif
}

/// Arrives on the barrier and announces `bytes` of bulk copies that complete this phase.
__device__ __forceinline__ void barrier_arrive_expect(std::uint64_t* barrier, std::uint32_t bytes) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#else
  (void)barrier;
  (void)bytes;
  __trap();
#endif
}

/// Arrives on the barrier (release: this thread's prior accesses happen before the phase completes).
__device__ __forceinline__ void barrier_arrive(std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
#else
  (void)barrier;
  __trap();
#endif
}

/// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory;
/// completion is counted on `barrier`.
__device__ __forceinline__ void bulk_copy_to_shared(void* destination, const void* source, std::uint32_t bytes,
                                                    std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(destination)),
      "l"(source), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
#else
  (void)destination;
  (void)source;
  (void)bytes;
  (void)barrier;
  __trap();
#endif
}

/// Waits until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
#else
  (void)barrier;
  (void)parity;
  __trap();
#endif
}

}  // namespace kvmosaic::cuda::detail
