// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: packed_bitmap / all / none.
#include "cuda_layer.cuh"
template std::unique_ptr<kvmosaic::layer_cache> kvmosaic_torch::cuda_layer_maker::operator()<
    kvmosaic::format::packed_bitmap, kvmosaic::select::all, kvmosaic::compact::none>(
    const kvmosaic::format::packed_bitmap&, const kvmosaic::select::all&, const kvmosaic::compact::none&) const;
