// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: dense / tova / hole_fill.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(dense, tova, hole_fill)
