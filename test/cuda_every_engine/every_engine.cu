// SPDX-License-Identifier: Apache-2.0
// Every CUDA engine (each format with select::all, each selector over dense, mean_keys and tova
// over packed_bitmap) for one shape, compiled to machine code for every architecture of
// KVMOSAIC_CUDA_EVERY_ENGINE_ARCHITECTURES (sm_75 and sm_90 by default): in a build whose tests and
// examples are PTX only (scripts/test.sh without a GPU), ptxas still assembles every kernel, the
// sm_90 ones and the portable ones, and the sm_75 pass proves that no sm_90-only code escapes its
// guard. Nothing here runs; an engine not instantiated below is not checked.

#include "kvmosaic/cuda/instantiate.cuh"
#include "kvmosaic/kvmosaic.cuh"

namespace kvmosaic::test::every_engine {
using one_shape = backend::cuda_for<kernel_shape<dtype::bf16, 128, 4>>;
using quant4_v_token = format::quant<4, format::value_axis::head_dim>;
}  // namespace kvmosaic::test::every_engine

#define KVMOSAIC_TEST_ENGINE(FORMAT, SELECTOR) \
  KVMOSAIC_CUDA_INSTANTIATE_ENGINE(FORMAT, SELECTOR, kvmosaic::test::every_engine::one_shape)
#define KVMOSAIC_TEST_SELECTION(SELECTOR) \
  KVMOSAIC_CUDA_INSTANTIATE_SELECTION(SELECTOR, kvmosaic::test::every_engine::one_shape)

KVMOSAIC_TEST_SELECTION(kvmosaic::select::all)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::quest)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::sentence_chunks)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::mean_keys)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::streaming)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::tova)
KVMOSAIC_TEST_SELECTION(kvmosaic::select::h2o)
// Every format, reading every page.
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::all)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::bitmap_tiles, kvmosaic::select::all)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::quant2, kvmosaic::select::all)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::quant4, kvmosaic::select::all)
KVMOSAIC_TEST_ENGINE(kvmosaic::test::every_engine::quant4_v_token, kvmosaic::select::all)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::packed_bitmap, kvmosaic::select::all)
// Every selector: over dense, mean_keys over packed_bitmap (its own block keys), and a selector
// that reads token scores over quant2 and over packed_bitmap (their kernels' logits).
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::quest)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::sentence_chunks)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::mean_keys)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::streaming)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::tova)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::dense, kvmosaic::select::h2o)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::packed_bitmap, kvmosaic::select::mean_keys)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::quant2, kvmosaic::select::h2o)
KVMOSAIC_TEST_ENGINE(kvmosaic::format::packed_bitmap, kvmosaic::select::tova)
