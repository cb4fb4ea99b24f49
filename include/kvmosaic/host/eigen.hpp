// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The one place kvmosaic configures and includes Eigen's core (format/packed_bitmap.hpp adds
/// Eigen/Eigenvalues after this header). The host backend runs Eigen on the CPU only, so when this
/// header is compiled by nvcc it asks Eigen not to annotate its functions for the device
/// (`EIGEN_NO_CUDA`): that keeps `.cu` files that include kvmosaic free of Eigen's device warnings.
/// Include kvmosaic before Eigen in a `.cu` file, or define `EIGEN_NO_CUDA` yourself.

#if defined(__CUDACC__) && !defined(EIGEN_NO_CUDA) && !defined(EIGEN_CORE_H)
#  define EIGEN_NO_CUDA
#endif
#include <Eigen/Core>

namespace kvmosaic::host {
/// Row-major float matrix views used by the host primitives.
using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_matrix_map = Eigen::Map<row_matrix>;
using const_row_matrix_map = Eigen::Map<const row_matrix>;
}  // namespace kvmosaic::host
