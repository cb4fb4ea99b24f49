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

/// The same copy, run beside the kernel before it (launched as its programmatic dependent): each
/// CTA copies, fences its writes, lets the kernel after it be scheduled (which may then read
/// these bytes before it waits: they are written and visible device-wide first), and only then
/// waits for the kernel before it, so that this grid completes after that one. A kernel after it
/// that waits for this grid has thereby waited for both.
template <int Threads>
__global__ void __launch_bounds__(Threads) pull_from_host_beside_kernel(const uint4* __restrict__ from, uint4* __restrict__ to,
                                                                        std::size_t words) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * Threads + threadIdx.x; i < words; i += stride)
    to[i] = __ldcv(from + i);
  __threadfence();
  allow_dependent_grids();
  wait_for_prior_grid();
}

/// Enqueues on `stream` the copy of bytes [from, from + bytes) of `staging` (both multiples of
/// 16) to the same offsets of `device` (16-byte aligned). Capturable in a CUDA graph; the caller
/// keeps the staging unchanged until the copy has run, as for cudaMemcpyAsync. With `beside`
/// (sm_90, the caller's choice), the copy runs while the stream's previous kernel still does
/// (`pull_from_host_beside_kernel`); else as an ordinary kernel. Cost: one small kernel, reads of
/// 16 bytes per thread with all of them in flight (64 KB: 16 CTAs).
inline void pull_from_host(const pinned_buffer& staging, void* device, std::size_t bytes, cudaStream_t stream,
                           std::size_t from = 0, bool beside = false) {
  if (bytes == 0) return;
  const std::size_t words = bytes / 16;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((words + pull_threads - 1) / pull_threads, 1024));
  const auto* source = static_cast<const uint4*>(staging.device_address()) + from / 16;
  auto* destination = static_cast<uint4*>(device) + from / 16;
  if (beside)
    launch_kernel(pull_from_host_beside_kernel<pull_threads>, dim3(blocks), dim3(pull_threads), 0, stream, true, source, destination,
                  words);
  else
    launch_kernel(pull_from_host_kernel<pull_threads>, dim3(blocks), dim3(pull_threads), 0, stream, false, source, destination,
                  words);
}

}  // namespace kvmosaic::cuda::detail
