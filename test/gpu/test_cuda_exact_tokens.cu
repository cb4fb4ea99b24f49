// SPDX-License-Identifier: Apache-2.0
// Exact tokens on the CUDA backend against the host backend (docs/architecture.md, "Exact
// tokens"): `sink_tokens` and `recent_tokens` of format::dense, format::bitmap_tiles and
// format::quant2, with select::all, select::quest and select::sentence_chunks. The device writes
// the host's page bytes, copies the sink and window rows into the tail slot as the host does
// (prefill chunks and pages that appends seal), masks their page copies and attends them exactly:
// its outputs equal the host's within the fp32 bounds.

#include <algorithm>
#include <cmath>

#include "../support/feed.hpp"
#include "../support/exact_rows.hpp"
#include "../support/quant_bound.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::as_attended;
using test::gpu_available;
using test::small_config;

namespace {

template <class F>
F with_exact(F f, int sinks, int recent) {
  f.sink_tokens = sinks;
  f.recent_tokens = recent;
  return f;
}


/// GPU against host: quant2 within its twin bound (Eq. 4 on the same codes), the others within
/// twice the fp32 bound over what the host attends; with select::all, the GPU also against the
/// fp64 oracle over it.
template <class F, class S>
void check_exact_twin(test::twin<F, S>& t) {
  const auto step = t.attend_both();
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const int length = static_cast<int>(t.host.length(t.seqs[b]));
    CAPTURE(b, length);
    const auto stored = test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), t.config.storage);
    const std::vector<float> qb(step.q.begin() + static_cast<std::ptrdiff_t>(b * per_seq),
                                step.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    const auto attended = as_attended(t.host, t.seqs[b], stored);
    const auto exact = test::exact(qb, attended, scale);
    std::vector<double> twin_bound(per_seq), exact_bound(per_seq);
    if constexpr (std::is_same<F, format::quant2>::value) {
      const test::quant_bounds bounds = test::quant_attention_bounds(t.host, t.seqs[b], qb, attended, scale);
      twin_bound = bounds.vs_twin;
      exact_bound = bounds.vs_exact;
    } else {
      const auto bound = test::attention_error_bound(qb, attended, t.config.group_size, scale, t.config.storage, t.config.page_size,
                                                     /*exact_storage=*/true, t.q_rounding(), t.p_rounding(),
                                                     std::ceil(length / static_cast<double>(t.config.page_size)) + 2);
      for (std::size_t i = 0; i < per_seq; ++i) {
        twin_bound[i] = 2 * bound.per_element[i];
        exact_bound[i] = bound.per_element[i];
      }
    }
    for (std::size_t i = 0; i < per_seq; ++i) {
      const float g = step.gpu[b * per_seq + i], h = step.host[b * per_seq + i];
      INFO("element " << i << ": gpu " << g << ", host " << h << ", exact " << exact[i]);
      REQUIRE(std::isfinite(g));
      REQUIRE(std::abs(g - h) <= twin_bound[i]);
      if (selector_traits<S>::reads_all_pages) REQUIRE(std::abs(g - exact[i]) <= exact_bound[i]);
    }
  }
}

/// Sequences with no page, one page sealed by the prefill, one sealed by an append, several
/// pages and splits; then appends that seal pages (the window ring rewritten on the device).
template <class F, class S>
void run_lengths(test::twin<F, S>& t) {
  for (int length : {10, 64, 63, 300, 2000}) t.add(length, t.seqs.size());
  t.check_storage();
  check_exact_twin(t);
  for (int step = 0; step < 70; ++step) t.append_step();
  t.check_storage();
  check_exact_twin(t);
}

template <class F>
void every_selector(const F& base) {
  const int sinks = GENERATE(0, 4, 16);
  const int recent = GENERATE(0, 32, 80, 1024);
  const bool portable = GENERATE(false, true);
  CAPTURE(sinks, recent, portable);
  const F f = with_exact(base, sinks, recent);
  const cache_config c = small_config(128, 4, dtype::bf16, 64);
  {
    test::twin<F> t(c, 31, f);
    if (portable) t.device.engine().use_portable_kernel();
    run_lengths(t);
  }
  for (const std::int64_t budget : {std::int64_t{0}, std::int64_t{256}, std::int64_t{1} << 20}) {
    CAPTURE(budget);
    select::quest quest;
    quest.block_tokens = 16;
    quest.budget.tokens = budget;
    test::twin<F, select::quest> q(c, 33, f, quest);
    if (portable) q.device.engine().use_portable_kernel();
    run_lengths(q);
    select::sentence_chunks chunks;
    for (const auto& b : synthetic::boundary_tokens) chunks.boundaries.push_back(select::boundary{b.id, b.weight});
    chunks.budget.tokens = budget;
    test::twin<F, select::sentence_chunks> s(c, 35, f, chunks);
    if (portable) s.device.engine().use_portable_kernel();
    run_lengths(s);
  }
}

format::quant2 stochastic_quant2() {
  format::quant2 f;
  f.mode = format::rounding::stochastic;
  f.seed = 5;
  return f;
}

}  // namespace

TEST_CASE("GPU exact tokens over dense: sinks and the recent window as the host keeps them", "[gpu][exact_tokens][dense]") {
  if (!gpu_available()) return;
  every_selector(format::dense{});
}

TEST_CASE("GPU exact tokens over bitmap_tiles: sinks and the recent window unpruned, as on the host",
          "[gpu][exact_tokens][bitmap_tiles]") {
  if (!gpu_available()) return;
  format::bitmap_tiles f;
  f.s_k = 0.7f;
  f.s_v = 0.5f;
  every_selector(f);
}

TEST_CASE("GPU exact tokens over quant2: sinks and the recent window 16-bit, as on the host", "[gpu][exact_tokens][quant2]") {
  if (!gpu_available()) return;
  every_selector(stochastic_quant2());
}

TEST_CASE("GPU exact tokens: dense sinks survive eviction and compaction as on the host", "[gpu][exact_tokens][eviction]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(128, 4, dtype::bf16, 64);
  cache<format::dense, select::all, compact::repack, backend::host> host(c, with_exact(format::dense{}, 4, 0));
  cache<format::dense, select::all, compact::repack, test::gpu_backend> device(c, with_exact(format::dense{}, 4, 0));
  const synthetic::kv_config gen = test::generator_for(c, 41);
  const int n = 700;
  const auto kv = synthetic::generate_kv(gen, 1, n);
  const sequence_id a = host.add_sequence(), b = device.add_sequence();
  host.prefill(a, test::k_view(kv), test::v_view(kv));
  test::device_array<float> dk(kv.k), dv(kv.v);
  device.prefill(b, tensor_view<const float, 3>(dk.data(), n, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(dv.data(), n, c.num_kv_heads, c.head_dim));
  std::vector<std::int64_t> evicted;
  for (std::int64_t t = 4; t < 400; t += 2) evicted.push_back(t);
  const span<const std::int64_t> positions(evicted.data(), static_cast<std::int64_t>(evicted.size()));
  host.evict(a, positions);
  device.evict(b, positions);
  host.compact(a);
  device.compact(b);
  const auto q = synthetic::generate_query(gen, 1, n);
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> host_out(q.size());
  host.attend(span<const sequence_id>(&a, 1), tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(host_out.data(), 1, hq, d));
  test::device_array<float> dq(q), dout(q.size());
  device.attend(span<const sequence_id>(&b, 1), tensor_view<const float, 3>(dq.data(), 1, hq, d), tensor_view<float, 3>(dout.data(), 1, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const auto gpu_out = dout.to_host(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) REQUIRE(std::abs(gpu_out[i] - host_out[i]) <= 1e-2 * (1 + std::abs(host_out[i])));
}

// A page-granular selection (blocks of a whole page) scores only the pages before the recent
// window: the window's pages are read from their exact rows, so they are no candidates, and the
// budget's pages are the top pages among the others, as on the host. The first step scores a
// longer sequence at batch entry 0, so the scores the device keeps for the second sequence's
// window pages, which its own step does not write, are real scores of other pages: a top-k that
// counted them would take budget from the candidates.
TEST_CASE("GPU page-granular selection leaves the recent window's pages out, as the host does",
          "[gpu][exact_tokens][select]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(128, 4, dtype::bf16, 64);
  const int recent = 1024;
  const std::int64_t budget = GENERATE(std::int64_t{256}, std::int64_t{2048});
  CAPTURE(budget);
  select::quest quest;
  quest.block_tokens = c.page_size;  // a block per page: the page top-k, no row masks
  quest.budget.tokens = budget;
  test::twin<format::dense, select::quest> t(c, 39, with_exact(format::dense{}, 0, recent), quest);
  t.add(4000, 0);  // 62 pages: 46 candidates
  check_exact_twin(t);
  t.host.remove_sequence(t.seqs[0]);
  t.device.remove_sequence(t.seqs[0]);
  t.seqs.clear();
  t.streams.clear();
  t.add(2570, 1);  // 40 pages: 24 candidates, 16 in the window
  check_exact_twin(t);
  for (int step = 0; step < 3; ++step) t.append_step();
  check_exact_twin(t);
}
