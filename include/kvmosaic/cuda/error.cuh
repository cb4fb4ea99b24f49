// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// CUDA runtime errors as kvmosaic exceptions: `KVMOSAIC_CUDA_CHECK(cudaMalloc(...))` throws a
/// `kvmosaic::cuda_error` naming the call, the error and where it happened.

#include <cuda_runtime.h>

#include <atomic>
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

/// Fault injection for tests of the all-or-nothing contract: when armed with `n` >= 0, the
/// (n+1)-th `KVMOSAIC_CUDA_CHECK` from then on does not make its call and fails as if it had
/// returned cudaErrorMemoryAllocation; the checks after it run normally. Disarmed (-1) by
/// default; cost when disarmed: one relaxed atomic load per checked call. Not for production.
struct cuda_fault_injection {
  static std::atomic<long>& countdown() noexcept {
    static std::atomic<long> value{-1};
    return value;
  }
  static void arm(long n) noexcept { countdown().store(n, std::memory_order_relaxed); }
  static void disarm() noexcept { countdown().store(-1, std::memory_order_relaxed); }
  /// Whether the armed fault has not fired yet.
  static bool armed() noexcept { return countdown().load(std::memory_order_relaxed) >= 0; }
  /// Counts one checked call; true for the one that fails.
  static bool fire() noexcept {
    if (countdown().load(std::memory_order_relaxed) < 0) return false;
    return countdown().fetch_sub(1, std::memory_order_relaxed) == 0;
  }
};

inline void cuda_check(cudaError_t code, const char* call, const char* file, int line) {
  if (code != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next check reports its own call
    throw cuda_error(code, call, file, line);
  }
}
}  // namespace detail

}  // namespace kvmosaic

/// Throws kvmosaic::cuda_error when a CUDA runtime call does not return cudaSuccess.
#define KVMOSAIC_CUDA_CHECK(call)                                                                          \
  ::kvmosaic::detail::cuda_check(                                                                          \
      ::kvmosaic::detail::cuda_fault_injection::fire() ? cudaErrorMemoryAllocation : (call), #call, __FILE__, \
      __LINE__)
