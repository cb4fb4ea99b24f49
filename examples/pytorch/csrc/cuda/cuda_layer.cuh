// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CUDA layer maker's definition and the kernel shapes the extension compiles: SmolLM2's
/// attention (head_dim 64, 3 query heads per KV head) with bf16 and f16 storage, and Llama-3-8B's
/// (head_dim 128, group 4) with bf16. A cache of another shape is rejected by its constructor
/// with the list of compiled shapes; add a `kernel_shape` here to serve it (each shape adds to
/// every configuration file's compile time).

#include "../layer_factory.hpp"

#ifdef KVMOSAIC_TORCH_CUDA_LAYER_PROBE
// A host-only link check (examples/CMakeLists.txt, kvmosaic_torch_cuda_layer_probe): every
// configuration file instantiates this stub, and a program that makes CUDA layers from any spec
// links only if each configuration `with_layer_policies` can make has its file.
namespace kvmosaic_torch {
template <class F, class S, class C>
std::unique_ptr<kvmosaic::layer_cache> cuda_layer_maker::operator()(const F&, const S&, const C&) const {
  return nullptr;
}
}  // namespace kvmosaic_torch
#else
#include "kvmosaic/kvmosaic.cuh"

namespace kvmosaic_torch {

using cuda_backend = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 64, 3>,
                                                 kvmosaic::kernel_shape<kvmosaic::dtype::f16, 64, 3>,
                                                 kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;

template <class F, class S, class C>
std::unique_ptr<kvmosaic::layer_cache> cuda_layer_maker::operator()(const F& format, const S& selector,
                                                                     const C& compactor) const {
  return kvmosaic::make_layer<kvmosaic::cache<F, S, C, cuda_backend>>(config, format, selector, compactor);
}

}  // namespace kvmosaic_torch
#endif

/// Instantiates the CUDA maker (and so the kernels) of one configuration.
#define KVMOSAIC_TORCH_CUDA_LAYER(F, S, C)                                                         \
  template std::unique_ptr<kvmosaic::layer_cache> kvmosaic_torch::cuda_layer_maker::operator()<   \
      kvmosaic::format::F, kvmosaic::select::S, kvmosaic::compact::C>(                             \
      const kvmosaic::format::F&, const kvmosaic::select::S&, const kvmosaic::compact::C&) const;
