// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Makes one type-erased layer (`kvmosaic::layer_cache`) from a parsed layer spec, on the host or
/// on the GPU. The host maker is defined here; the CUDA maker's call operator is only declared:
/// each supported (format, selector, compactor) has its own translation unit under cuda/ that
/// instantiates it (one configuration per file, so the kernels compile in parallel and a change
/// to one configuration rebuilds one file).

#include <memory>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/model_cache.hpp"
#include "layer_spec.hpp"

namespace kvmosaic_torch {

/// Makes `kvmosaic::cache<F, S, C, backend::host>` layers.
struct host_layer_maker {
  static constexpr bool attend_writes_token_scores = true;  // select::tova, select::h2o
  static constexpr bool per_kv_head_layers = true;          // select::per_kv_head (per_head=1)
  const kvmosaic::cache_config& config;
  template <class F, class S, class C>
  std::unique_ptr<kvmosaic::layer_cache> operator()(const F& format, const S& selector, const C& compactor) const {
    return kvmosaic::make_layer<kvmosaic::cache<F, S, C, kvmosaic::backend::host>>(config, format, selector, compactor);
  }
};

/// Makes `kvmosaic::cache<F, S, C, cuda_backend>` layers (cuda_layer.cuh defines the operator and
/// the kernel shapes).
struct cuda_layer_maker {
  static constexpr bool attend_writes_token_scores = true;  // select::tova, select::h2o (dense and packed_bitmap pages)
  static constexpr bool per_kv_head_layers = false;         // no configuration file compiles them
  const kvmosaic::cache_config& config;
  template <class F, class S, class C>
  std::unique_ptr<kvmosaic::layer_cache> operator()(const F& format, const S& selector, const C& compactor) const;
};

inline std::unique_ptr<kvmosaic::layer_cache> make_host_layer(const layer_spec& spec, const kvmosaic::cache_config& config) {
  return with_layer_policies(spec, host_layer_maker{config});
}

inline std::unique_ptr<kvmosaic::layer_cache> make_cuda_layer(const layer_spec& spec, const kvmosaic::cache_config& config) {
  return with_layer_policies(spec, cuda_layer_maker{config});
}

}  // namespace kvmosaic_torch
