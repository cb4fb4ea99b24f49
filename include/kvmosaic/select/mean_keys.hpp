// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::mean_keys`: MosaicKV's stage-2 dynamic sequence compression (Qiang et al.,
/// "MosaicKV", sections 4.2 and 5.3): blocks of a page scored by the query against the block's
/// mean key, the top blocks read within a token budget.

#include "kvmosaic/select/quest.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// Reads, per (sequence, KV head) and step, the blocks of sealed pages whose mean key scores
/// highest against the query, within a token budget, plus the dense tail and the exact rows
/// (sinks, recent window) that every selector reads.
///
/// What it computes: each block of `block_tokens` tokens of a page keeps the mean of its keys
/// (one row, in the storage dtype; per channel an fp32 sum in token order divided by the count),
/// written when the page is sealed from its exact rows, before the format encodes them. A step
/// scores every block with q . mean (`span_score` with lo = hi = mean: both backends round alike),
/// combines the group's query heads (`combine`, as `select::quest`), and reads the top
/// floor(budget / block_tokens) blocks (higher score first, ties to the earlier block).
///
/// Against `select::quest`: half its metadata (one row per block instead of two) and a score that
/// estimates the block's logits instead of bounding them; MosaicKV pairs it with its packed
/// format. Differences from the paper (docs/selectors.md): the mean row is 16-bit and dense for
/// every format (the paper packs it with the keys of its format), and the block size is the
/// selector's parameter, not the segment strategy's (`format::packed_bitmap` computes the
/// strategy's block size per segment; using it here is future work).
///
/// Cost: head_dim 16-bit values per block and KV head of memory (1/block_tokens of the dense K
/// bytes; counted in `memory_stats`); per step, reading those rows and a top-k per (sequence, KV
/// head). Memory is not freed: a read-less selector.
struct mean_keys {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int block_tokens = 16;                      ///< tokens per block (MosaicKV: 4, 8 or 16): 0 = the
                                              ///< page size, or a multiple of 8 dividing it
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head

  /// The block size for pages of `page_size` tokens.
  int block_for(int page_size) const noexcept { return block_tokens == 0 ? page_size : block_tokens; }
};

}  // namespace select

namespace detail {
inline constexpr char mean_keys_name[] = "mean_keys";
}  // namespace detail

/// The mean rows live with each page, in the engine.
template <>
struct selector_traits<select::mean_keys>
    : detail::page_block_selector_traits<select::mean_keys, detail::mean_keys_name, block_summary::mean> {};

}  // namespace kvmosaic
