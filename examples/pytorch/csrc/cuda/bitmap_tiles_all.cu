// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: bitmap_tiles / all / none.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(bitmap_tiles, all, none)
