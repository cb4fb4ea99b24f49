// SPDX-License-Identifier: Apache-2.0
// The README's usage example: a cache for one layer, a prefill, a decode step.
#include <kvmosaic/kvmosaic.hpp>

#include <cstdio>
#include <vector>

int main() {
  using Cache = kvmosaic::cache<kvmosaic::format::dense,   // how a page is stored
                                kvmosaic::select::all,     // which pages a query reads
                                kvmosaic::compact::none>;  // how evicted tokens free pages
  kvmosaic::cache_config config;  // 8 KV heads, 4 query heads each, head_dim 128, pages of 64, bf16
  config.max_pages = 64;
  Cache cache(config);

  // Prefill 100 tokens of K and V, laid out [token][kv_head][channel] (float, half or bfloat16).
  const int tokens = 100, kv_heads = 8, head_dim = 128, q_heads = 32;
  std::vector<float> k(tokens * kv_heads * head_dim, 0.01f), v(k.size(), 1.0f);
  const kvmosaic::sequence_id seq = cache.add_sequence();
  cache.prefill(seq, kvmosaic::tensor_view<const float, 3>(k.data(), tokens, kv_heads, head_dim),
                kvmosaic::tensor_view<const float, 3>(v.data(), tokens, kv_heads, head_dim));

  // One decode step for a batch of one sequence: q and out are [batch][q_heads][head_dim].
  std::vector<float> q(q_heads * head_dim, 0.1f), out(q.size());
  cache.attend(kvmosaic::span<const kvmosaic::sequence_id>(&seq, 1),
               kvmosaic::tensor_view<const float, 3>(q.data(), 1, q_heads, head_dim),
               kvmosaic::tensor_view<float, 3>(out.data(), 1, q_heads, head_dim));

  const kvmosaic::memory_stats m = cache.sequence_memory(seq);
  std::printf("%lld tokens, %.0f bytes/token, compression %.2f, out[0] = %.3f\n",
              static_cast<long long>(m.tokens), m.bytes_per_token(), m.compression_ratio(), out[0]);
  return out[0] == 1.0f ? 0 : 1;  // V is all ones, so attention returns ones
}
