// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Host fp32 loops in a fixed order of fused multiply-adds (`std::fma`: one rounding a step), the
/// order the CUDA kernels' FFMA chains follow, so that both backends compute the same bits.
///
/// x86 builds that do not target FMA hardware (the default) would call the C library's `fmaf` at
/// each step, several times slower; there a loop is also compiled for FMA hardware
/// (`__attribute__((target("fma")))`) and chosen at run time (`fma_hardware`). Both are exact:
/// the same bits.

#include <algorithm>
#include <cmath>
#include <cstddef>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && !defined(__FMA__) && \
    !defined(__CUDACC__)
#define KVMOSAIC_FMA_DISPATCH 1
#endif

namespace kvmosaic {
namespace detail {

#ifdef KVMOSAIC_FMA_DISPATCH
/// Whether this CPU has FMA instructions (checked once).
inline bool fma_hardware() noexcept {
  static const bool fma = __builtin_cpu_supports("fma") != 0;
  return fma;
}
#endif

namespace fused_detail {
template <int = 0>
inline void rotate(const float* x, int rows, const float* matrix, int cols, float* y) {
  std::fill(y, y + cols, 0.0f);
  for (int c = 0; c < rows; ++c) {
    const float xc = x[c];
    const float* row = matrix + static_cast<std::size_t>(c) * cols;
    for (int j = 0; j < cols; ++j) y[j] = std::fma(xc, row[j], y[j]);
  }
}
#ifdef KVMOSAIC_FMA_DISPATCH
__attribute__((target("fma"))) inline void rotate_fma(const float* x, int rows, const float* matrix, int cols, float* y) {
  rotate(x, rows, matrix, cols, y);  // inlined: std::fma is one instruction under this target
}
#endif
}  // namespace fused_detail

/// y = x M for x [rows] and M [rows][cols] (row-major, fp32): y_j accumulates x_c M_cj over
/// c = 0, 1, ... by fused multiply-adds from 0, the order of a device thread that owns y_j.
/// Cost: rows x cols fused multiply-adds.
inline void fused_rotate(const float* x, int rows, const float* matrix, int cols, float* y) {
#ifdef KVMOSAIC_FMA_DISPATCH
  if (fma_hardware()) {
    fused_detail::rotate_fma(x, rows, matrix, cols, y);
    return;
  }
#endif
  fused_detail::rotate(x, rows, matrix, cols, y);
}

}  // namespace detail
}  // namespace kvmosaic
