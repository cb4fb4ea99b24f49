// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a host cache attends for each position of a sequence when its format keeps exact tokens
// (sinks and a recent window): the rows given (the input rounded to the storage dtype) for the
// sinks, the last W sealed tokens and the tail; every other sealed token as its page decodes.
// Shared by the host and GPU exact-token tests.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// `stored` with every sealed row that is not an exact token replaced by its page's host decode.
template <class Cache>
kvmosaic::synthetic::kv_data as_attended(const Cache& cache, kvmosaic::sequence_id id, kvmosaic::synthetic::kv_data stored) {
  using traits = kvmosaic::format_traits<typename Cache::format_type>;
  const kvmosaic::cache_config& c = cache.config();
  const kvmosaic::page_shape shape{c.page_size, c.head_dim, c.storage};
  const auto& pages = cache.pages(id);
  const std::int64_t sealed = static_cast<std::int64_t>(pages.size()) * c.page_size;
  std::vector<float> rows(static_cast<std::size_t>(c.page_size) * c.head_dim);
  for (std::size_t pg = 0; pg < pages.size(); ++pg)
    for (int h = 0; h < c.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        if (is_v) traits::decode_v(cache.format(), shape, cache.engine().v_page(pages[pg], h), c.page_size, rows.data());
        else traits::decode_k(cache.format(), shape, cache.engine().k_page(pages[pg], h), c.page_size, rows.data());
        for (int r = 0; r < c.page_size; ++r) {
          const std::int64_t t = static_cast<std::int64_t>(pg) * c.page_size + r;
          if (t < kvmosaic::sink_rows(cache.format()) || t >= sealed - kvmosaic::window_rows(cache.format())) continue;
          std::copy_n(rows.data() + static_cast<std::size_t>(r) * c.head_dim, c.head_dim,
                      (is_v ? stored.v : stored.k).data() + (static_cast<std::size_t>(t) * c.num_kv_heads + h) * c.head_dim);
        }
      }
  return stored;
}

}  // namespace kvmosaic::test
