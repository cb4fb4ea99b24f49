// SPDX-License-Identifier: Apache-2.0
// One configuration of the CUDA layers: packed_bitmap / h2o / repack.
#include "cuda_layer.cuh"
KVMOSAIC_TORCH_CUDA_LAYER(packed_bitmap, h2o, repack)
