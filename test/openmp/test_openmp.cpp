// SPDX-License-Identifier: Apache-2.0
// The host backend's OpenMP paths (built with OpenMP: test/CMakeLists.txt) against one thread:
// a segment format's plan (detail::plan_segments: the KV heads on OpenMP's threads) and the attend
// step (pairs of sequence and KV head on OpenMP's threads) give the same bits for any thread
// count, as their contracts say.

#include <catch2/catch.hpp>
#include <omp.h>

#include <cstring>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

cache_config config() {
  cache_config c;
  c.num_kv_heads = 4;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 64;
  c.storage = dtype::bf16;
  c.max_pages = 64;
  c.max_sequences = 4;
  return c;
}

/// What a run of the cache on `threads` OpenMP threads gives: every segment of every KV head
/// (bases and strategies) and the attention of each sequence.
struct run_result {
  std::vector<std::vector<float>> bases;
  std::vector<int> strategies;
  std::vector<float> out;
};

run_result run_with(int threads) {
  omp_set_num_threads(threads);
  const cache_config c = config();
  format::packed_bitmap f;
  f.segment_tokens = 256;  // several segments a sequence
  f.mode = format::strategy::search;
  f.loss_threshold = 0.2f;  // segments take differing strategies
  f.sink_tokens = 4;
  cache<format::packed_bitmap> kv(c, f);
  synthetic::kv_config sc;
  sc.num_kv_heads = c.num_kv_heads;
  sc.group_size = c.group_size;
  sc.head_dim = c.head_dim;
  std::vector<sequence_id> seqs;
  for (const int n : {700, 300}) {
    const synthetic::kv_data data = synthetic::generate_kv(sc, 11 + n, n);
    const sequence_id s = kv.add_sequence();
    kv.prefill(s, tensor_view<const float, 3>(data.k.data(), n, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data(), n, c.num_kv_heads, c.head_dim));
    seqs.push_back(s);
  }
  run_result r;
  const int per = format_traits<format::packed_bitmap>::segment_pages(f, page_shape{c.page_size, c.head_dim, c.storage});
  for (const sequence_id s : seqs)
    for (std::int64_t index = 0; index < static_cast<std::int64_t>(kv.pages(s).size()); index += per)
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const auto& seg = kv.engine().segment(kv.slot(s), index, h);
        r.bases.push_back(seg.basis[0]);
        r.bases.push_back(seg.basis[1]);
        for (int which = 0; which < 2; ++which) {
          r.strategies.push_back(seg.strategy[which].retained);
          r.strategies.push_back(seg.strategy[which].group);
        }
      }
  const int hq = c.num_q_heads(), d = c.head_dim;
  const std::vector<float> q = synthetic::generate_query(sc, 5, 700);
  std::vector<float> queries(seqs.size() * static_cast<std::size_t>(hq) * d);
  for (std::size_t i = 0; i < queries.size(); ++i) queries[i] = q[i % q.size()];
  r.out.assign(queries.size(), 0.0f);
  kv.attend(span<const sequence_id>(seqs.data(), seqs.size()),
            tensor_view<const float, 3>(queries.data(), static_cast<std::int64_t>(seqs.size()), hq, d),
            tensor_view<float, 3>(r.out.data(), static_cast<std::int64_t>(seqs.size()), hq, d));
  return r;
}

}  // namespace

TEST_CASE("OpenMP: packed_bitmap's segment plans and the attend step give one thread's bits", "[openmp]") {
  const run_result one = run_with(1);
  REQUIRE(one.bases.size() == 2 * 4 * (3 + 1));  // 700 tokens: 10 pages, 3 segments; 300: 4 pages, 1
  bool searched_differ = false;
  for (std::size_t i = 2; i < one.strategies.size(); i += 2) searched_differ = searched_differ || one.strategies[i] != one.strategies[0];
  CHECK(searched_differ);  // the search ran, not one fixed strategy
  for (const int threads : {2, 4}) {
    INFO("threads " << threads);
    const run_result many = run_with(threads);
    CHECK(many.bases == one.bases);
    CHECK(many.strategies == one.strategies);
    REQUIRE(many.out.size() == one.out.size());
    CHECK(std::memcmp(many.out.data(), one.out.data(), one.out.size() * sizeof(float)) == 0);
  }
}
