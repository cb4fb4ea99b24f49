// SPDX-License-Identifier: Apache-2.0
#pragma once
// The CUDA backend's contracts under valid but awkward use and under failure, as checks each GPU
// test unit runs for the cache types it already instantiates (so no unit compiles another copy of
// a cache's kernels): chunked prefills of every size into every tail fill equal one-shot prefills
// (device bytes and outputs); every call is all or nothing when any CUDA call inside it fails
// (errors injected with detail::cuda_fault_injection); stale handles, per-sequence key weights, a
// GQA group with one extreme head, and q/out that the device cannot read.

#include "../support/feed.hpp"
#include "twin.hpp"

namespace kvmosaic::test::reliability {

template <class Format>
int page_size_for() {
  if (std::is_same<Format, format::bitmap_tiles>::value) return 64;
  if (std::is_same<Format, format::quant2>::value) return 32;
  return 16;
}

template <class Format>
Format format_for() {
  Format f{};
  if constexpr (std::is_same<Format, format::bitmap_tiles>::value) {
    f.s_k = 0.5f;
    f.s_v = 0.7f;
  }
  if constexpr (std::is_same<Format, format::quant2>::value) {
    f.partition = 32;
    f.sink_tokens = 2;
  }
  return f;
}

template <class Selector>
Selector selector_for() {
  Selector s{};
  if constexpr (std::is_same<Selector, select::quest>::value) s.budget.ratio = 0.25;
  if constexpr (std::is_same<Selector, select::sentence_chunks>::value) {
    s.target_length = 6;
    s.window = 3;
    s.budget.ratio = 0.5;
  }
  return s;
}

inline cache_config config_for(int page) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = page;
  c.max_pages = 64;
  c.max_sequences = 6;
  return c;
}

/// Tokens [first, first + n) of a synthetic stream, on the device, with ids (sentence boundaries
/// every fifth token): `Rows` of test/support/feed.hpp.
struct device_rows {
  device_rows(const cache_config& c, std::uint64_t stream, int first, int n)
      : kv(synthetic::generate_kv(generator_for(c, 19), stream, first, n)), k_(kv.k), v_(kv.v), ids(stream_ids(first, n)) {}
  tensor_view<const float, 3> k() const { return {k_.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim}; }
  tensor_view<const float, 3> v() const { return {v_.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim}; }
  span<const std::int32_t> id_span() const { return {ids.data(), static_cast<std::int64_t>(ids.size())}; }
  synthetic::kv_data kv;
  device_array<float> k_, v_;
  std::vector<std::int32_t> ids;
};

/// What a caller can observe: gauge, lengths, block tables, the device bytes of every page in
/// them, and the outputs of fixed queries (bitwise).
struct observation {
  memory_stats memory;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<page_id>> pages;
  std::vector<std::byte> page_bytes;
  std::vector<float> out;

  template <class Cache>
  static observation of(Cache& cache, const std::vector<sequence_id>& seqs) {
    observation o;
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    o.memory = cache.memory();
    const cache_config& c = cache.config();
    const std::size_t slot = cache.engine().page_slot_bytes();
    std::vector<sequence_id> attended;
    for (const sequence_id s : seqs) {
      o.lengths.push_back(cache.length(s));
      o.pages.emplace_back(cache.pages(s).begin(), cache.pages(s).end());
      for (const page_id page : cache.pages(s)) {
        const std::size_t at = o.page_bytes.size();
        o.page_bytes.resize(at + slot);
        KVMOSAIC_CUDA_CHECK(cudaMemcpy(o.page_bytes.data() + at, cache.engine().pages_data() + page * slot, slot,
                                       cudaMemcpyDeviceToHost));
      }
      if (cache.length(s) > 0) attended.push_back(s);
    }
    if (attended.empty()) return o;
    const auto batch = static_cast<std::int64_t>(attended.size());
    std::vector<float> q(static_cast<std::size_t>(batch * c.num_q_heads() * c.head_dim));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i)) * 2.0f;
    device_array<float> dq(q), dout(q.size());
    cache.attend(span<const sequence_id>(attended.data(), batch),
                 tensor_view<const float, 3>(dq.data(), batch, c.num_q_heads(), c.head_dim),
                 tensor_view<float, 3>(dout.data(), batch, c.num_q_heads(), c.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    o.out = dout.to_host(q.size());
    return o;
  }
};

inline void require_same(const observation& a, const observation& b) {
  REQUIRE(a.memory.tokens == b.memory.tokens);
  REQUIRE(a.memory.stored_bytes == b.memory.stored_bytes);
  REQUIRE(a.memory.pages_free == b.memory.pages_free);
  REQUIRE(a.lengths == b.lengths);
  REQUIRE(a.pages == b.pages);
  REQUIRE(a.page_bytes == b.page_bytes);
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    INFO("output element " << i);
    REQUIRE(std::isfinite(a.out[i]));
    REQUIRE(std::memcmp(&a.out[i], &b.out[i], sizeof(float)) == 0);
  }
}

template <class Format>
void check_chunked_prefill(const std::vector<int>& fills) {
  const cache_config c = config_for(page_size_for<Format>());
  const int p = c.page_size;
  using Cache = cache<Format, select::all, compact::none, test::gpu_backend>;
  const std::vector<std::vector<int>> patterns = {
      {1}, {p - 1}, {p}, {p + 1}, {2 * p + 3}, {1, 1, p - 1}, {p + 1, 1, 2 * p + 3}, {p - 1, p, p + 1}};
  for (const int fill : fills) {
    for (const std::vector<int>& pattern : patterns) {
      int total = fill;
      for (const int n : pattern) total += n;
      INFO(format_traits<Format>::describe(format_for<Format>()) << ": tail fill " << fill << ", " << pattern.size()
                                                                 << " chunks, first " << pattern[0]);
      Cache one_shot(c, format_for<Format>()), chunked(c, format_for<Format>());
      const sequence_id a = one_shot.add_sequence(), b = chunked.add_sequence();
      prefill(one_shot, a, device_rows(c, 3, 0, total));
      int at = 0;
      for (int step = -1; step < static_cast<int>(pattern.size()); ++step) {
        const int n = step < 0 ? fill : pattern[static_cast<std::size_t>(step)];
        if (n == 0) continue;
        prefill(chunked, b, device_rows(c, 3, at, n));
        at += n;
      }
      require_same(observation::of(one_shot, {a}), observation::of(chunked, {b}));
    }
  }
}

// --- All or nothing under injected CUDA errors -----------------------------------------------------

/// Arms cuda_fault_injection for the scope.
struct fail_cuda_call {
  explicit fail_cuda_call(long n) { detail::cuda_fault_injection::arm(n); }
  ~fail_cuda_call() { detail::cuda_fault_injection::disarm(); }
};

template <class Format, class Selector, class Setup, class Op>
long check_all_or_nothing(const Setup& setup, const Op& op) {
  using Cache = cache<Format, Selector, compact::none, test::gpu_backend>;
  const cache_config c = config_for(page_size_for<Format>());
  long n = 0;
  for (;; ++n) {
    Cache failing(c, format_for<Format>(), selector_for<Selector>()), reference(c, format_for<Format>(), selector_for<Selector>());
    std::vector<sequence_id> seqs = setup(failing, c);
    REQUIRE(setup(reference, c) == seqs);
    seqs.reserve(seqs.size() + 4);
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    bool threw = false;
    {
      fail_cuda_call arm(n);
      try {
        op(failing, seqs, c);
      } catch (const cuda_error&) {
        threw = true;
      }
    }
    INFO("CUDA call " << n << " failed: " << threw);
    if (!threw) {
      op(reference, seqs, c);
      require_same(observation::of(failing, seqs), observation::of(reference, seqs));
      return n;
    }
    require_same(observation::of(failing, seqs), observation::of(reference, seqs));
    const device_rows more(c, 11, 500, static_cast<int>(seqs.size()));
    append(failing, seqs, more);
    append(reference, seqs, more);
    require_same(observation::of(failing, seqs), observation::of(reference, seqs));
  }
}

template <class Format, class Selector>
void check_every_operation_all_or_nothing() {
  using Cache = cache<Format, Selector, compact::none, test::gpu_backend>;
  INFO(format_traits<Format>::describe(format_for<Format>()) << " / " << selector_traits<Selector>::describe(selector_for<Selector>()));
  const auto setup = [](Cache& cache, const cache_config& c) {
    const sequence_id a = cache.add_sequence();
    prefill(cache, a, device_rows(c, 1, 0, 2 * c.page_size + 5));
    const sequence_id b = cache.fork_sequence(a);
    append(cache, {b}, device_rows(c, 2, 2 * c.page_size + 5, 1));
    return std::vector<sequence_id>{a, b};
  };
  // A prefill that seals pages and wraps the tail over its old rows.
  const long points = check_all_or_nothing<Format, Selector>(setup, [](Cache& cache, std::vector<sequence_id>& seqs, const cache_config& c) {
    prefill(cache, seqs[0], device_rows(c, 1, 2 * c.page_size + 5, 3 * c.page_size + 2));
  });
  CHECK(points >= 3);
  // An append that seals a page in one sequence of the batch.
  check_all_or_nothing<Format, Selector>(
      [&](Cache& cache, const cache_config& c) {
        std::vector<sequence_id> seqs = setup(cache, c);
        prefill(cache, seqs[0], device_rows(c, 1, 2 * c.page_size + 5, c.page_size - 6));
        return seqs;
      },
      [](Cache& cache, std::vector<sequence_id>& seqs, const cache_config& c) { append(cache, seqs, device_rows(c, 5, 900, 2)); });
  // A fork.
  check_all_or_nothing<Format, Selector>(setup, [](Cache& cache, std::vector<sequence_id>& seqs, const cache_config&) {
    seqs.push_back(cache.fork_sequence(seqs[0]));
  });
}

// --- Handles, per-sequence state, numerics, arguments ---------------------------------------------

/// bitmap_tiles: a removed sequence's handle is rejected, and its key weights do not prune the
/// sequence that reuses its slot.
inline void check_key_weights_end_with_sequence() {
  using Cache = cache<format::bitmap_tiles, select::all, compact::none, test::gpu_backend>;
  const cache_config c = config_for(64);
  const format::bitmap_tiles f = format_for<format::bitmap_tiles>();
  const device_rows r(c, 4, 0, 3 * c.page_size + 3);
  Cache fresh(c, f), reused(c, f);
  const sequence_id expected = fresh.add_sequence();
  prefill(fresh, expected, r);
  const sequence_id first = reused.add_sequence();
  std::vector<float> weights(static_cast<std::size_t>(c.num_kv_heads * c.head_dim));
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = i % 3 == 0 ? 100.0f : 0.01f;
  reused.set_key_weights(first, tensor_view<const float, 2>(weights.data(), c.num_kv_heads, c.head_dim));
  reused.remove_sequence(first);
  const sequence_id second = reused.add_sequence();
  CHECK_THROWS_AS(prefill(reused, first, r), invalid_argument);
  prefill(reused, second, r);
  require_same(observation::of(fresh, {expected}), observation::of(reused, {second}));
}

/// format::dense: a query head with -1e38 queries leaves the other heads of its group unchanged.
inline void check_heads_independent() {
  cache_config c = config_for(16);
  c.group_size = 4;
  using Cache = cache<format::dense, select::all, compact::none, test::gpu_backend>;
  Cache cache(c);
  const sequence_id seq = cache.add_sequence();
  prefill(cache, seq, device_rows(c, 5, 0, 2 * c.page_size + 7));
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads() * c.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  const auto run = [&](const std::vector<float>& query) {
    device_array<float> dq(query), dout(query.size());
    cache.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(dq.data(), 1, c.num_q_heads(), c.head_dim),
                 tensor_view<float, 3>(dout.data(), 1, c.num_q_heads(), c.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    return dout.to_host(query.size());
  };
  const std::vector<float> normal = run(q);
  const int odd_head = 1;
  for (int ch = 0; ch < c.head_dim; ++ch) q[static_cast<std::size_t>(odd_head * c.head_dim + ch)] = -1e38f;
  const std::vector<float> extreme = run(q);
  for (int head = 0; head < c.num_q_heads(); ++head) {
    if (head == odd_head) continue;
    for (int ch = 0; ch < c.head_dim; ++ch) {
      INFO("query head " << head << ", channel " << ch);
      const std::size_t i = static_cast<std::size_t>(head * c.head_dim + ch);
      REQUIRE(std::isfinite(extreme[i]));
      REQUIRE(extreme[i] == normal[i]);
    }
  }
}

/// format::dense: q, out, k and v the device cannot read are rejected by name; strided q and out
/// are honoured.
inline void check_device_arrays() {
  const cache_config c = config_for(16);
  using Cache = cache<format::dense, select::all, compact::none, test::gpu_backend>;
  Cache cache(c);
  const sequence_id seq = cache.add_sequence();
  const device_rows r(c, 6, 0, 9);
  prefill(cache, seq, r);
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> host_q(static_cast<std::size_t>(hq * d)), host_out(host_q.size());
  for (std::size_t i = 0; i < host_q.size(); ++i) host_q[i] = std::sin(0.3f * static_cast<float>(i));
  device_array<float> q(host_q), out(host_q.size());
  const span<const sequence_id> one(&seq, 1);
  CHECK_THROWS_WITH(cache.attend(one, tensor_view<const float, 3>(host_q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d)),
                    Catch::Contains("q = host memory"));
  CHECK_THROWS_WITH(cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(host_out.data(), 1, hq, d)),
                    Catch::Contains("out = host memory"));
  CHECK_THROWS_WITH(cache.prefill(seq, tensor_view<const float, 3>(r.kv.k.data(), 9, c.num_kv_heads, d), r.v()),
                    Catch::Contains("k = host memory"));
  // Strided q and out (every other head of a wider array) are honoured: the same outputs as packed.
  cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d));
  device_array<float> wide(static_cast<std::size_t>(2 * hq * d)), wide_out(static_cast<std::size_t>(2 * hq * d));
  std::vector<float> spread(static_cast<std::size_t>(2 * hq * d), 0.0f);
  for (int j = 0; j < hq; ++j)
    for (int ch = 0; ch < d; ++ch) spread[static_cast<std::size_t>(2 * j * d + ch)] = host_q[static_cast<std::size_t>(j * d + ch)];
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(wide.data(), spread.data(), spread.size() * sizeof(float), cudaMemcpyHostToDevice));
  const auto strided_q = tensor_view<const float, 3>::strided(wide.data(), {1, hq, d}, {2 * hq * d, 2 * d, 1});
  const auto strided_out = tensor_view<float, 3>::strided(wide_out.data(), {1, hq, d}, {2 * hq * d, 2 * d, 1});
  cache.attend(one, strided_q, strided_out);
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> packed = out.to_host(static_cast<std::size_t>(hq * d));
  const std::vector<float> strided = wide_out.to_host(static_cast<std::size_t>(2 * hq * d));
  for (int j = 0; j < hq; ++j)
    for (int ch = 0; ch < d; ++ch)
      REQUIRE(strided[static_cast<std::size_t>(2 * j * d + ch)] == packed[static_cast<std::size_t>(j * d + ch)]);
  CHECK(cache.length(seq) == 9);
}

}  // namespace kvmosaic::test::reliability
