// SPDX-License-Identifier: Apache-2.0
#pragma once

// Probe (not part of the library or its build): a per-CTA timeline of a decode step, for devices
// without Nsight Systems. `instrument.py` copies include/ and benchmark/ into a build directory,
// copies this header in as kvmosaic/cuda/detail/timeline.cuh and makes every kernel open a
// `tl_scope` and the programmatic-dependent-launch calls stamp their events. Each CTA's thread 0
// claims a record with one atomic at entry and stamps %globaltimer (ns, the same clock on every
// SM) into it: event 0 at entry, 1 before and 2 after `griddepcontrol.wait`, 3 at
// `griddepcontrol.launch_dependents`, 9 at exit; events 4-8 and 10-15 are free for stamps added by
// hand (`kvmosaic::cuda::detail::tl_mark(event)`). A stamp is a store (no atomic), so it costs the
// kernel a few cycles; the claim at entry costs thread 0 one atomic's round trip.

#include <cstdint>

namespace kvmosaic::cuda::detail {

/// One CTA: where it ran, its grid, and its events' times (0: not stamped).
struct tl_record {
  unsigned smid, grid_x, grid_yz, block, threads, pad[3];
  unsigned long long t[16];
};
constexpr unsigned tl_capacity = 1u << 15;
__device__ tl_record tl_log[tl_capacity];
__device__ unsigned tl_count;  ///< records claimed; the host zeroes it before the step it records

__device__ __forceinline__ unsigned& tl_slot() {
  __shared__ unsigned slot;
  return slot;
}
__device__ __forceinline__ bool tl_leader() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }
__device__ __forceinline__ unsigned long long tl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Stamps event `event` (0-15) of this CTA (thread 0; a later stamp of one event overwrites).
__device__ __forceinline__ void tl_mark(unsigned event) {
  if (tl_leader() && tl_slot() < tl_capacity) tl_log[tl_slot()].t[event] = tl_now();
}

/// Claims the CTA's record and stamps its entry; stamps its exit when the kernel returns.
struct tl_scope {
  __device__ tl_scope() {
    if (!tl_leader()) return;
    const unsigned long long t = tl_now();
    const unsigned i = atomicAdd(&tl_count, 1u);
    tl_slot() = i;
    if (i >= tl_capacity) return;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    tl_record& r = tl_log[i];
    r.smid = smid;
    r.grid_x = gridDim.x;
    r.grid_yz = gridDim.y * gridDim.z;
    r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    r.threads = blockDim.x * blockDim.y * blockDim.z;
    for (int k = 1; k < 16; ++k) r.t[k] = 0;
    r.t[0] = t;
  }
  __device__ ~tl_scope() { tl_mark(9); }
};

}  // namespace kvmosaic::cuda::detail
