// SPDX-License-Identifier: Apache-2.0
#pragma once
// Feeding a cache the rows of a synthetic token stream, with token ids for the selectors that read
// them: shared by the host reliability tests and the GPU reliability checks. A `Rows` type has
// k(), v() (tensor views of [tokens][num_kv_heads][head_dim], host or device memory as the cache's
// backend wants) and id_span().

#include <cstdint>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// Token ids of stream positions [first, first + n): a sentence boundary (a comma) every fifth
/// token, distinct ordinary ids elsewhere.
inline std::vector<std::int32_t> stream_ids(int first, int n) {
  std::vector<std::int32_t> ids;
  for (int t = first; t < first + n; ++t) ids.push_back(t % 5 == 4 ? synthetic::comma_token_id : 1000 + t);
  return ids;
}

/// The synthetic generator of a cache's shape.
inline synthetic::kv_config generator_for(const cache_config& c, std::uint64_t seed) {
  synthetic::kv_config g;
  g.num_kv_heads = c.num_kv_heads;
  g.group_size = c.group_size;
  g.head_dim = c.head_dim;
  g.seed = seed;
  return g;
}

/// `cache.prefill` of `rows`, with their ids when the cache's selector reads them.
template <class Cache, class Rows>
void prefill(Cache& cache, sequence_id seq, const Rows& rows) {
  if constexpr (selector_traits<typename Cache::selector_type>::needs_token_ids)
    cache.prefill(seq, rows.k(), rows.v(), rows.id_span());
  else
    cache.prefill(seq, rows.k(), rows.v());
}

/// `cache.append` of one row of `rows` per sequence of `seqs`, with ids when the selector reads them.
template <class Cache, class Rows>
void append(Cache& cache, const std::vector<sequence_id>& seqs, const Rows& rows) {
  const span<const sequence_id> s(seqs.data(), static_cast<std::int64_t>(seqs.size()));
  if constexpr (selector_traits<typename Cache::selector_type>::needs_token_ids)
    cache.append(s, rows.k(), rows.v(), rows.id_span());
  else
    cache.append(s, rows.k(), rows.v());
}

}  // namespace kvmosaic::test
