// SPDX-License-Identifier: Apache-2.0
// kvmosaic in Compiler Explorer, 2 of 3: the CUDA kernels of one cache type, one shape, for sm_90.
//
//   Language:  CUDA C++
//   Compiler:  NVCC 13.0.0 (or newer)
//   Flags:     -std=c++17 -O3 -arch=sm_90 -Xptxas=-v
//   Libraries: Eigen 3.4.0
//   Output:    compile only (no GPU needed). In the compiler pane, Add new... > Device opens the
//              device code: pick "SASS (sm_90)" or "PTX" in its drop-down
//   Header:    the #include below; replace OWNER/REPO with kvmosaic's GitHub path
//              (README.md, "Try it in Compiler Explorer")
//
// A cache type names its kernels' template arguments: the format (dense bf16 pages), the
// selector (select::all: no selection kernels) and, through backend::cuda_for, the kernel shapes
// to compile (here one: bf16 storage, head_dim 128, 4 query heads per KV head).
// KVMOSAIC_CUDA_INSTANTIATE_CACHE compiles every kernel that type can launch, once, for every
// input and output type the API takes; the program's other files see
// KVMOSAIC_CUDA_EXTERN_CACHE instead and compile none.
//
// What to look for (search the device pane for these names, Ctrl+F):
//   decode_partial_tma_kernel   the sm_90 decode split kernel: TMA copies of K and V tiles
//                               (PTX cp.async.bulk.tensor) completing on mbarriers, q.k and p.v on
//                               tensor cores (mma.sync ... bf16); each warp folds 16 tokens of a
//                               64-token stage (collective: warp_attend_mma);
//   decode_partial_bulk_kernel  sm_90 bulk copies, for page sizes the TMA stages cannot tile;
//   decode_partial_kernel       the portable split kernel (collective: page_attend), for GPUs
//                               before sm_90 (chosen at run time, so all three are compiled);
//   merge_splits_kernel         merges the splits' softmax states into the output, per output type;
//   scatter_rows_kernel, move_tail_rows_kernel, gather_queries_kernel: prefill/append, queries.
// Each kernel's size: -Xptxas=-v prints its registers, shared memory and spills (mangled names)
// in the compiler's Output pane; the SASS pane lists its instructions, 16 bytes each.
// The instantiation costs nvcc about 10 CPU-seconds. format::quant2 in place of format::dense
// (2-bit codes on int8 tensor cores) costs about 1.7 times that, close to Compiler Explorer's
// compile time limit.
#include <https://raw.githubusercontent.com/OWNER/REPO/main/single_include/kvmosaic/kvmosaic.cuh>

using one_shape = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
using cache_type =
    kvmosaic::cache<kvmosaic::format::dense, kvmosaic::select::all, kvmosaic::compact::none, one_shape>;

// The one unit of the program that compiles cache_type's kernels.
KVMOSAIC_CUDA_INSTANTIATE_CACHE(kvmosaic::format::dense, kvmosaic::select::all, one_shape)

// An engine's decode step with this cache: q and out are device arrays [batch][32][128] bf16
// (8 KV heads x 4 query heads in the default cache_config). plan() runs on the host (split plan,
// staged metadata); run() launches the kernels on the engine's stream and can be captured in a
// CUDA graph.
void decode_step(cache_type& cache, const kvmosaic::sequence_id* seqs, int batch,
                 const kvmosaic::bfloat16* q, kvmosaic::bfloat16* out) {
  const int q_heads = cache.config().num_q_heads(), head_dim = cache.config().head_dim;
  cache.plan(kvmosaic::span<const kvmosaic::sequence_id>(seqs, batch));
  cache.run(kvmosaic::tensor_view<const kvmosaic::bfloat16, 3>(q, batch, q_heads, head_dim),
            kvmosaic::tensor_view<kvmosaic::bfloat16, 3>(out, batch, q_heads, head_dim));
}
