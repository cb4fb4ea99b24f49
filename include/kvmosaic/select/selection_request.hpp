// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What one decode step of a read-less selector asks of an engine (`detail::selection_request`):
/// per batch entry, the token budget, the first token read whatever the selection, and the spans
/// to score (the engine's page blocks, or a list of token ranges with their key bounds). A
/// selector's host hooks fill it (`selector_traits::start_request`, `request`); both backends'
/// engines read it.

#include <cstdint>
#include <vector>

#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace detail {

/// Spans of one sequence given as token ranges (`select::sentence_chunks`' final chunks): span i
/// is tokens [starts[i], starts[i+1]), its key bounds at bounds + (i * num_kv_heads + head) * 2 *
/// head_dim (storage dtype bits: the lo row, then the hi row). Read on the host backend only (a
/// device engine keeps these bounds itself).
struct chunk_list {
  const std::int64_t* starts = nullptr;
  std::int32_t count = 0;
  const std::uint16_t* bounds = nullptr;
};

/// What a read-less selector asks of one step (select/selector_traits.hpp): per batch entry, the
/// token budget and the first token of the region read whatever the selection (the open chunk);
/// the spans are the engine's page blocks (`block_tokens` > 0) or the given chunks.
struct selection_request {
  group_combine combine = group_combine::max;
  int block_tokens = 0;
  std::vector<std::int64_t> budget;        ///< [batch] tokens
  std::vector<std::int64_t> always_from;   ///< [batch] tokens from here on are always read
  /// [batch] spans starting here or later are not scored or picked (the format's recent window,
  /// read from its exact rows: set by the cache, not the selector); spans come in token order, so
  /// the candidates are a prefix.
  std::vector<std::int64_t> candidates_before;
  std::vector<chunk_list> chunks;          ///< [batch] (block_tokens == 0)
};

}  // namespace detail
}  // namespace kvmosaic
