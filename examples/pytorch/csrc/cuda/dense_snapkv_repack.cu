// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: dense / snapkv / repack.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(dense, snapkv, repack)
