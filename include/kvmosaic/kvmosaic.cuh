// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// kvmosaic with its CUDA part. Include from a `.cu` file compiled by nvcc; it brings the whole host
/// part (<kvmosaic/kvmosaic.hpp>) and the device-side pieces (the 16-bit types' device conversions,
/// the online-softmax state in device code, the CUDA error check).

#if !defined(__CUDACC__)
#  error "kvmosaic/kvmosaic.cuh needs a CUDA compiler (nvcc); host-only code includes kvmosaic/kvmosaic.hpp"
#endif

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/cuda/collective/page_attend.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"
#include "kvmosaic/cuda/kernel/extend.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/backend.cuh"
// The formats' device parts (cuda/format/device_format.cuh): one line per format.
#include "kvmosaic/cuda/format/dense/device.cuh"
#include "kvmosaic/cuda/format/bitmap_tiles/device.cuh"
#include "kvmosaic/cuda/format/quant/device.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/device.cuh"
// The selectors' device parts (cuda/select/selection_stage.cuh): one line per selector.
#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/cuda/select/quest.cuh"
#include "kvmosaic/cuda/select/mean_keys.cuh"
#include "kvmosaic/cuda/select/sentence_chunks.cuh"
#include "kvmosaic/cuda/select/streaming.cuh"
#include "kvmosaic/cuda/select/snapkv.cuh"
#include "kvmosaic/cuda/select/scored_eviction.cuh"
// Compiling a cache type's kernels in one unit (KVMOSAIC_CUDA_EXTERN_CACHE / _INSTANTIATE_CACHE).
#include "kvmosaic/cuda/instantiate.cuh"
