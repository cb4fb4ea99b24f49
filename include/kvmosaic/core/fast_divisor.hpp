// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `detail::fast_divisor`: division of non-negative 31-bit integers by a divisor fixed at run
/// time, as a multiply-high, an add and a shift (Granlund and Montgomery, "Division by Invariant
/// Integers using Multiplication", PLDI 1994, section 4), for kernels that divide every thread's
/// index by a launch parameter: a hardware-free integer division costs about twenty instructions
/// on the GPU.

#include <cstdint>

#include "kvmosaic/core/config.hpp"
#include "kvmosaic/core/error.hpp"

namespace kvmosaic::detail {

/// n / d and n % d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 chosen on the host. With
/// s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s: the
/// cited paper's unsigned division of 32-bit numbers (its Figure 4.1, l = s), whose final add
/// cannot carry out of 32 bits when n < 2^31 (mulhi(n, m) <= n), so its halving step is dropped.
/// Cost: one multiply-high, one add and one shift.
struct fast_divisor {
  std::uint32_t divisor = 1;
  std::uint32_t multiplier = 1;
  std::uint32_t shift = 0;

  fast_divisor() = default;
  explicit fast_divisor(int d) {
    require(d >= 1, "detail::fast_divisor", "d", d, "a divisor in [1, 2^31)");
    divisor = static_cast<std::uint32_t>(d);
    while ((std::uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<std::uint32_t>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << shift) - divisor)) / divisor + 1);
  }

  /// n / d, for 0 <= n < 2^31.
  KVMOSAIC_HOST_DEVICE std::uint32_t divide(std::uint32_t n) const noexcept {
#if defined(__CUDA_ARCH__)
    const std::uint32_t high = __umulhi(n, multiplier);
#else
    const auto high = static_cast<std::uint32_t>((static_cast<std::uint64_t>(n) * multiplier) >> 32);
#endif
    return (high + n) >> shift;
  }
  /// n % d, given q = n / d.
  KVMOSAIC_HOST_DEVICE std::uint32_t remainder(std::uint32_t n, std::uint32_t q) const noexcept { return n - q * divisor; }
};

}  // namespace kvmosaic::detail
