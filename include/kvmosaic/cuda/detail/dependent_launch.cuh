// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Programmatic dependent launch (sm_90 and later): a kernel launched with `overlap_prior` set
/// may be scheduled while the kernel before it in the stream still runs. Its CTAs start, set up
/// what does not depend on the earlier kernel, and block in `wait_for_prior_grid()` until that
/// kernel has completed and its writes are visible. Why: a decode step is three kernels (the
/// metadata pull, the split kernel, the merge), and each boundary otherwise costs a full launch
/// (the grid drains, then the next one is scheduled from scratch): a few microseconds, which at
/// batch 1 and short contexts is a tenth of the step. Captured launches keep the overlap in a
/// CUDA graph (a programmatic edge).
///
/// The contract a kernel launched this way must keep: nothing it reads that an earlier kernel in
/// the stream writes, and nothing it writes that an earlier kernel reads, before
/// `wait_for_prior_grid()`. A kernel calls `allow_dependent_grids()` as early as it likes: the
/// dependent kernel still waits for this one to complete before it touches memory. Both are no-ops
/// when compiled for an architecture before sm_90, and `wait_for_prior_grid()` returns at once in
/// a kernel launched without the attribute.

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "kvmosaic/cuda/error.cuh"

namespace kvmosaic::cuda::detail {

/// Blocks until every grid this one was launched to overlap has completed and its memory
/// operations are visible (PTX `griddepcontrol.wait`). Every thread that reads or writes memory
/// shared with the earlier kernel must have passed it (or a barrier after it).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the next kernel of the stream, if launched with `overlap_prior`, be scheduled once every
/// CTA of this grid has called this or exited (PTX `griddepcontrol.launch_dependents`).
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Launches `kernel<<<grid, block, shared_bytes, stream>>>(args...)`; with `overlap_prior`, as a
/// programmatic dependent of the stream's previous kernel (the caller passes true only on sm_90
/// and later devices, and only for kernels that keep the contract above). Cost: that of a launch.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   bool overlap_prior, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = overlap_prior ? &attribute : nullptr;
  config.numAttrs = overlap_prior ? 1 : 0;
  KVMOSAIC_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kvmosaic::cuda::detail
