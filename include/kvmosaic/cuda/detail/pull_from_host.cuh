// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `pull_from_host`: the per-step host-to-device copy of staged metadata, done by a kernel that
/// reads the page-locked staging over the bus instead of by a memcpy. Why: in a CUDA graph, a
/// host-to-device memcpy node of a few KB costs the copy engine's round trip, several times a
/// small kernel's launch plus one bus round trip, and at batch 1 that is most of a step's fixed
/// cost (benchmark/README.md, "Decisions the code cites": "metadata pull").

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"

namespace kvmosaic::cuda::detail {

/// Threads per CTA of the copy; each moves 16 bytes per step.
inline constexpr int pull_threads = 256;

/// to[i] = from[i] for i < words; `from` is mapped host memory, read uncached (`__ldcv`) so that
/// a replayed graph sees what the host staged for this step. Launched as an ordinary kernel (it
/// overwrites metadata the previous step's kernels read); the kernel after it may overlap it.
template <int Threads>
__global__ void __launch_bounds__(Threads) pull_from_host_kernel(const uint4* __restrict__ from, uint4* __restrict__ to,
                                                                 std::size_t words) {
  allow_dependent_grids();  // the split kernel may start its set-up; it waits for this grid's copy
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * Threads + threadIdx.x; i < words; i += stride)
    to[i] = __ldcv(from + i);
}

/// Enqueues on `stream` the copy of the first `bytes` (a multiple of 16) of `staging` into
/// `device` (16-byte aligned). Capturable in a CUDA graph; the caller keeps the staging unchanged
/// until the copy has run, as for cudaMemcpyAsync. Cost: one small kernel, reads of 16 bytes
/// per thread with all of them in flight (64 KB: 16 CTAs).
inline void pull_from_host(const pinned_buffer& staging, void* device, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  const std::size_t words = bytes / 16;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((words + pull_threads - 1) / pull_threads, 1024));
  pull_from_host_kernel<pull_threads><<<blocks, pull_threads, 0, stream>>>(
      static_cast<const uint4*>(staging.device_address()), static_cast<uint4*>(device), words);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvmosaic::cuda::detail
