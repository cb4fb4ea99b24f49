// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: dense / h2o / hole_fill.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(dense, h2o, hole_fill)
