// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: dense / mean_keys / none.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(dense, mean_keys, none)
