// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: bitmap_tiles / streaming / repack.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(bitmap_tiles, streaming, repack)
