// Package test: kvmosaic included from a CUDA translation unit of a consumer with CUDA enabled.
// The program never calls the CUDA runtime, so it runs on machines without a GPU.
// SPDX-License-Identifier: Apache-2.0
#if __has_include(<kvmosaic/kvmosaic.cuh>)
#  include <kvmosaic/kvmosaic.cuh>  // the CUDA umbrella header, when the library has one
#else
#  include <kvmosaic/kvmosaic.hpp>
#endif

#include <cstdio>
#include <cstring>

__global__ void kvmosaic_consumer_kernel(int* out) { *out = 1; }  // compiled, never launched

int host_thrust_version();  // host_cccl.cpp

int main() {
  const char* version = kvmosaic::version_string();
  std::printf("kvmosaic %s (CUDA consumer, Thrust %d)\n", version, host_thrust_version());
  return std::strcmp(version, EXPECTED_VERSION) == 0 ? 0 : 1;
}
