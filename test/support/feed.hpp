// SPDX-License-Identifier: Apache-2.0
#pragma once
// Feeding a cache the rows of a synthetic token stream, with token ids for the selectors that read
// them: shared by the host reliability tests and the GPU reliability checks. A `Rows` type has
// k(), v() (tensor views of [tokens][num_kv_heads][head_dim], host or device memory as the cache's
// backend wants) and id_span().

#include <cmath>
#include <cstddef>
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

/// A small two-head shape for the keep-less selector tests: 2 KV heads, groups of 2, head_dim 64,
/// pages of 16, two sequences, `max_pages` pages.
inline cache_config two_head_config(int max_pages = 64) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = max_pages;
  c.max_sequences = 2;
  return c;
}

/// A query per step ([num_q_heads][head_dim]): different directions at different steps.
inline std::vector<float> step_query(const cache_config& c, int step) {
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 1.5f * std::cos(0.11f * static_cast<float>(i) + 0.7f * static_cast<float>(step));
  return q;
}

/// `cache.attend` of one sequence and query (host memory); the output.
template <class Cache>
std::vector<float> attend_one(Cache& cache, sequence_id seq, const std::vector<float>& q) {
  const cache_config& c = cache.config();
  std::vector<float> out(q.size());
  const sequence_id one[] = {seq};
  cache.attend(span<const sequence_id>(one, 1), tensor_view<const float, 3>(q.data(), 1, c.num_q_heads(), c.head_dim),
               tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim));
  return out;
}

/// `cache.prefill` of the first `tokens` tokens of `data`.
template <class Cache>
void prefill_tokens(Cache& cache, sequence_id seq, const synthetic::kv_data& data, int tokens) {
  const cache_config& c = cache.config();
  cache.prefill(seq, tensor_view<const float, 3>(data.k.data(), tokens, c.num_kv_heads, c.head_dim),
                tensor_view<const float, 3>(data.v.data(), tokens, c.num_kv_heads, c.head_dim));
}

/// `cache.append` of token `t` of `data` to one sequence.
template <class Cache>
void append_token(Cache& cache, sequence_id seq, const synthetic::kv_data& data, int t) {
  const cache_config& c = cache.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const sequence_id one[] = {seq};
  cache.append(span<const sequence_id>(one, 1),
               tensor_view<const float, 3>(data.k.data() + static_cast<std::size_t>(t) * row, 1, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data() + static_cast<std::size_t>(t) * row, 1, c.num_kv_heads, c.head_dim));
}

}  // namespace kvmosaic::test
