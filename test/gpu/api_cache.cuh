// SPDX-License-Identifier: Apache-2.0
#pragma once
// The cache type of test_cuda_api.cu, compiled once (cuda/instantiate.cuh): every unit that
// includes this sees KVMOSAIC_CUDA_EXTERN_CACHE; api_cache.cu instantiates it.

#include "kvmosaic/kvmosaic.cuh"

namespace kvmosaic::test {
using one_shape = backend::cuda_for<kernel_shape<dtype::bf16, 64, 4>>;
using device_cache = cache<format::dense, select::all, compact::none, one_shape>;
}  // namespace kvmosaic::test

KVMOSAIC_CUDA_EXTERN_CACHE(kvmosaic::format::dense, kvmosaic::select::all, kvmosaic::test::one_shape)
