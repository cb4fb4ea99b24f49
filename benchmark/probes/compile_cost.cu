// SPDX-License-Identifier: Apache-2.0
// Compile-cost probe (docs/architecture.md, "What a cache type compiles"): one translation unit
// that prefills, appends, attends, forks and removes through one cache type, for one kernel
// shape or (-DALL_SHAPES) every supported one. -DEXTERN: the unit sees KVMOSAIC_CUDA_EXTERN_CACHE
// (its kernels compiled elsewhere); -DINSTANTIATE: the unit is only KVMOSAIC_CUDA_INSTANTIATE_CACHE
// (the one that compiles them). Not part of the build:
//   nvcc -std=c++17 -O3 -arch=sm_90 -I include -isystem /usr/include/eigen3 \
//        -DFORMAT=quant2 -DSELECTOR=quest -c benchmark/probes/compile_cost.cu -o /tmp/probe.o
#include <kvmosaic/kvmosaic.cuh>
#ifndef FORMAT
#define FORMAT dense
#endif
#ifndef SELECTOR
#define SELECTOR all
#endif
#ifdef ALL_SHAPES
using backend_type = kvmosaic::backend::cuda;
#else
using backend_type = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
#endif
using cache_type = kvmosaic::cache<kvmosaic::format::FORMAT, kvmosaic::select::SELECTOR, kvmosaic::compact::none, backend_type>;
#if defined(EXTERN)
KVMOSAIC_CUDA_EXTERN_CACHE(kvmosaic::format::FORMAT, kvmosaic::select::SELECTOR, backend_type)
#elif defined(INSTANTIATE)
KVMOSAIC_CUDA_INSTANTIATE_CACHE(kvmosaic::format::FORMAT, kvmosaic::select::SELECTOR, backend_type)
#endif
#ifndef INSTANTIATE

void run(cache_type& c, kvmosaic::sequence_id s, const float* k, const float* v, const float* q, float* out) {
  c.prefill(s, kvmosaic::tensor_view<const float, 3>(k, 10, 8, 128), kvmosaic::tensor_view<const float, 3>(v, 10, 8, 128));
  c.append(kvmosaic::span<const kvmosaic::sequence_id>(&s, 1), kvmosaic::tensor_view<const float, 3>(k, 1, 8, 128),
           kvmosaic::tensor_view<const float, 3>(v, 1, 8, 128));
  c.attend(kvmosaic::span<const kvmosaic::sequence_id>(&s, 1), kvmosaic::tensor_view<const float, 3>(q, 1, 32, 128),
           kvmosaic::tensor_view<float, 3>(out, 1, 32, 128));
  c.remove_sequence(c.fork_sequence(s));
}
#endif
