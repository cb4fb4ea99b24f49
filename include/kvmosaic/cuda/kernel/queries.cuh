// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A step's queries as the split kernels read them: contiguous float [batch][num_q_heads]
/// [head_dim]. Queries already in that form are read in place; others (f16, bf16, or strided)
/// are converted by `gather_queries_kernel` first: one extra launch of batch x num_q_heads x
/// head_dim element copies, part of the step (and of a captured graph).

#include <cstdint>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::kernel {

/// Where a step's queries are: `q` with element strides per batch entry, query head, channel.
template <class Q>
struct query_source {
  const Q* q;
  std::int64_t strides[3];
  int batch;
  int heads;
  int head_dim;
};

/// out[(b * heads + h) * head_dim + c] = float(q(b, h, c)). Grid-stride over every element.
template <class Q>
__global__ void gather_queries_kernel(const query_source<Q> source, float* out) {
  const std::int64_t total = static_cast<std::int64_t>(source.batch) * source.heads * source.head_dim;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % source.head_dim, row = i / source.head_dim;
    const std::int64_t h = row % source.heads, b = row / source.heads;
    out[i] = to_float(source.q[b * source.strides[0] + h * source.strides[1] + c * source.strides[2]]);
  }
}

}  // namespace kvmosaic::cuda::kernel
