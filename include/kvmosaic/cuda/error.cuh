// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// CUDA runtime errors as kvmosaic exceptions: `KVMOSAIC_CUDA_CHECK(cudaMalloc(...))` throws a
/// `kvmosaic::cuda_error` naming the call, the error and where it happened.

#include <cuda_runtime.h>

#include <string>

#include "kvmosaic/core/error.hpp"

namespace kvmosaic {

/// A CUDA runtime call failed. `code()` is the cudaError_t.
class cuda_error : public error {
 public:
  cuda_error(cudaError_t code, const char* call, const char* file, int line)
      : error("cuda", std::string("kvmosaic: CUDA error ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                          ") in " + call + " at " + file + ":" + std::to_string(line)),
        code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {
inline void cuda_check(cudaError_t code, const char* call, const char* file, int line) {
  if (code != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next check reports its own call
    throw cuda_error(code, call, file, line);
  }
}
}  // namespace detail

}  // namespace kvmosaic

/// Throws kvmosaic::cuda_error when a CUDA runtime call does not return cudaSuccess.
#define KVMOSAIC_CUDA_CHECK(call) ::kvmosaic::detail::cuda_check((call), #call, __FILE__, __LINE__)
