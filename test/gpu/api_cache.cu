// SPDX-License-Identifier: Apache-2.0
// The one unit that compiles the kernels of test_cuda_api.cu's cache type.
#include "api_cache.cuh"

KVMOSAIC_CUDA_INSTANTIATE_CACHE(kvmosaic::format::dense, kvmosaic::select::all, kvmosaic::test::one_shape)
