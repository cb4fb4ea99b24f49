// SPDX-License-Identifier: Apache-2.0
//
// Probe (not part of the build): what a pinned host-to-device memcpy node costs ahead of a kernel
// in a CUDA graph, the question behind cuda/detail/pull_from_host.cuh. Each graph is replayed 200
// times, timed with CUDA events around the launch while a spinning kernel keeps the host ahead.
//
//   nvcc -O2 -arch=sm_90 benchmark/probes/graph_copy_cost.cu -o graph_copy_cost && ./graph_copy_cost
//
// H100 output: benchmark/results/h100-2026-11-22g/graph_copy_cost.txt.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    const cudaError_t status = (call);                                                   \
    if (status != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(status));               \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

__global__ void read_first_word(const int* metadata, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = metadata[0];
}

__global__ void spin(int* out, int steps) {
  int x = static_cast<int>(threadIdx.x);
  for (int i = 0; i < steps; ++i) x = x * 3 + 1;
  if (x == 7) out[1] = x;  // never true in practice; keeps the loop
}

int main() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const char* names[] = {"kernel", "copy+kernel", "kernel+kernel", "copy+kernel+kernel"};
  for (const size_t bytes : {256ul, 4096ul, 65536ul, 262144ul}) {
    int *device = nullptr, *out = nullptr;
    void* host = nullptr;
    CHECK(cudaMalloc(&device, bytes));
    CHECK(cudaMalloc(&out, 64));
    CHECK(cudaMallocHost(&host, bytes));
    for (int variant = 0; variant < 4; ++variant) {
      const bool copy = variant == 1 || variant == 3, second_kernel = variant >= 2;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      if (copy) CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
      read_first_word<<<264, 128, 0, stream>>>(device, out);
      if (second_kernel) read_first_word<<<32, 128, 0, stream>>>(device, out);
      CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(exec, stream));
      const int replays = 200;
      float total_ms = 0.0f;
      for (int i = 0; i < replays; ++i) {
        spin<<<1, 32, 0, stream>>>(out, 20000);
        CHECK(cudaEventRecord(start, stream));
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        total_ms += ms;
      }
      std::printf("bytes %7zu  %-20s %7.2f us\n", bytes, names[variant], 1000.0f * total_ms / replays);
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
    }
    CHECK(cudaFree(device));
    CHECK(cudaFree(out));
    CHECK(cudaFreeHost(host));
  }
  return 0;
}
