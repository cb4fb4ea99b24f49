// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: bitmap_tiles / streaming / hole_fill.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(bitmap_tiles, streaming, hole_fill)
