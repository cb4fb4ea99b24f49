// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Compiling a cache type's kernels once. A `kvmosaic::cache<Format, Selector, Compactor,
/// Backend>` on a CUDA backend compiles its kernels in every translation unit that uses it (the
/// engine's members that launch them are templates). An inference engine whose files share one
/// cache type compiles them in one `.cu` instead:
///
/// ```cpp
/// // my_cache.cuh, included by every file that uses the cache
/// #include <kvmosaic/kvmosaic.cuh>
/// using my_shapes = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
/// using my_cache = kvmosaic::cache<kvmosaic::format::quant2, kvmosaic::select::quest, kvmosaic::compact::none, my_shapes>;
/// KVMOSAIC_CUDA_EXTERN_CACHE(kvmosaic::format::quant2, kvmosaic::select::quest, my_shapes)
///
/// // my_cache.cu, the one file that compiles the kernels
/// #include "my_cache.cuh"
/// KVMOSAIC_CUDA_INSTANTIATE_CACHE(kvmosaic::format::quant2, kvmosaic::select::quest, my_shapes)
/// ```
///
/// The arguments are the cache's format, selector and backend types (aliases welcome: a macro
/// argument cannot hold an unparenthesized comma). EXTERN is an explicit instantiation
/// declaration of the cache's CUDA engine and selection stage: the engine's members that launch
/// kernels are defined out of line, so a unit that sees it compiles no kernel and no device code
/// for the cache (its host code is inline and cheap). INSTANTIATE, in exactly one unit of the
/// program, is the matching explicit instantiation definition: every kernel of that format,
/// selector and shape list, for every input and output type (float, half, bfloat16) the public
/// API accepts. docs/architecture.md ("What a cache type compiles") gives the costs.

#include "kvmosaic/cuda/backend.cuh"
#include "kvmosaic/cuda/shapes.cuh"

/// In every unit that uses the cache type: its kernels are compiled elsewhere.
#define KVMOSAIC_CUDA_EXTERN_CACHE(FORMAT, SELECTOR, BACKEND)                                            \
  extern template class kvmosaic::cuda::selection_stage<SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>; \
  extern template class kvmosaic::cuda::engine<FORMAT, SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;

/// In exactly one unit: compiles the cache type's kernels (its selection stage and its engine).
#define KVMOSAIC_CUDA_INSTANTIATE_CACHE(FORMAT, SELECTOR, BACKEND) \
  KVMOSAIC_CUDA_INSTANTIATE_SELECTION(SELECTOR, BACKEND)           \
  KVMOSAIC_CUDA_INSTANTIATE_ENGINE(FORMAT, SELECTOR, BACKEND)

/// The two halves of KVMOSAIC_CUDA_INSTANTIATE_CACHE, for a program whose cache types share a
/// selector and backend (say quant2 and dense, both with `select::quest`): the selection stage
/// depends on the selector and backend alone, so it is instantiated in one unit, and each engine
/// in one unit (its own, so that they compile in parallel); KVMOSAIC_CUDA_EXTERN_CACHE as before.
#define KVMOSAIC_CUDA_INSTANTIATE_SELECTION(SELECTOR, BACKEND) \
  template class kvmosaic::cuda::selection_stage<SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;
/// See KVMOSAIC_CUDA_INSTANTIATE_SELECTION.
#define KVMOSAIC_CUDA_INSTANTIATE_ENGINE(FORMAT, SELECTOR, BACKEND) \
  template class kvmosaic::cuda::engine<FORMAT, SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;
