// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Per-sequence block tables: logical page i of a sequence lives in pool slot `pages[i]`.
/// A token at logical position t is in page t / page_size at row t % page_size, or in the dense
/// tail when t >= pages.size() * page_size. Kernels receive the tables of a batch packed into one
/// int32 matrix by `pack_block_tables`.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvmosaic/memory/page_pool.hpp"

namespace kvmosaic {

/// The ordered page ids of one sequence.
using block_table = std::vector<page_id>;

/// Packs the tables of a batch into a row-major [batch][max_pages] int32 matrix padded with -1
/// (the layout paged-attention kernels index as `table[b * stride + i]`). Returns the row stride.
inline std::int32_t pack_block_tables(const std::vector<const block_table*>& tables, std::vector<std::int32_t>& out) {
  std::size_t stride = 1;
  for (const block_table* t : tables) stride = std::max(stride, t->size());
  out.assign(tables.size() * stride, -1);
  for (std::size_t b = 0; b < tables.size(); ++b) std::copy(tables[b]->begin(), tables[b]->end(), out.begin() + b * stride);
  return static_cast<std::int32_t>(stride);
}

}  // namespace kvmosaic
