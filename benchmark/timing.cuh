// SPDX-License-Identifier: Apache-2.0
#pragma once
// What every CUDA benchmark here times with: CUDA events, L2 evicted before each timed launch, a
// busy-wait ahead of it so the events time the GPU and not the host's launches, medians.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"

namespace kvmosaic_bench {

/// Fills `count` 16-bit values with a deterministic pseudo-random pattern in [-2, 2).
template <class T>
__global__ void fill_kernel(T* data, std::size_t count, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9e3779b9u ^ seed;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    data[i] = T(static_cast<float>(h & 0xffffu) / 16384.0f - 2.0f);
  }
}

/// Keeps the GPU busy for about `ns` nanoseconds, so the host enqueues the timed step before the
/// GPU reaches it: the events then time the GPU's work, not the host's launch latency. (Each
/// benchmark program is one translation unit.)
__global__ void busy_wait_kernel(unsigned long long ns) {
  const unsigned long long start = clock64();
  while (clock64() - start < ns * 2) {
  }
}

/// Evicts L2 between timed steps: writes a buffer twice the L2 size.
struct l2_flusher {
  l2_flusher() {
    int device = 0, l2 = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    bytes = 2 * static_cast<std::size_t>(l2);
    buffer = kvmosaic::cuda::device_buffer(bytes);
  }
  void flush(cudaStream_t stream) { KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0, bytes, stream)); }
  std::size_t bytes;
  kvmosaic::cuda::device_buffer buffer;
};

struct event_timer {
  event_timer() {
    KVMOSAIC_CUDA_CHECK(cudaEventCreate(&start));
    KVMOSAIC_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~event_timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  double seconds() const {
    float ms = 0;
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(stop));
    KVMOSAIC_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
  cudaEvent_t start, stop;
};

/// Seconds of one replay of `graph` on `stream`, timed cold: L2 flushed first, then a busy-wait of
/// about 50 us so the host has enqueued the replay before the GPU reaches it, then CUDA events
/// around the replay alone.
inline double timed_replay(cudaGraphExec_t graph, cudaStream_t stream, l2_flusher& flusher, event_timer& timer) {
  flusher.flush(stream);
  busy_wait_kernel<<<1, 1, 0, stream>>>(50000);
  KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.start, stream));
  KVMOSAIC_CUDA_CHECK(cudaGraphLaunch(graph, stream));
  KVMOSAIC_CUDA_CHECK(cudaEventRecord(timer.stop, stream));
  return timer.seconds();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace kvmosaic_bench
