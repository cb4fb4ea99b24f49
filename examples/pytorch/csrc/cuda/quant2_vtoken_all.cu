// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: quant<2, value_axis::head_dim> / all / none.
#include "cuda_layer.cuh"
template std::unique_ptr<kvmosaic::layer_cache> kvmosaic_torch::cuda_layer_maker::operator()<
    kvmosaic::format::quant<2, kvmosaic::format::value_axis::head_dim>, kvmosaic::select::all, kvmosaic::compact::none>(
    const kvmosaic::format::quant<2, kvmosaic::format::value_axis::head_dim>&, const kvmosaic::select::all&, const kvmosaic::compact::none&) const;
