// SPDX-License-Identifier: Apache-2.0
// Eviction and compaction on the CUDA backend: after the same evictions, the device attends over
// exactly the host's live tokens (live-row masks staged with each step), for every format; pages
// freed by block-granular reclaim agree. After the same compaction passes (repack, hole fill),
// the device's block tables, positions, pool and page bytes equal the host's, and it attends as
// before; a pass captured in a CUDA graph does the same. Without a GPU every test says so and
// returns.

#include <algorithm>
#include <cstring>
#include <random>

#include "../support/feed.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

/// The one kernel shape of `evicted_twins`' configuration (bf16, head_dim 128, groups of 4): enough
/// for the formats added after the first three, whose kernels would otherwise be compiled for every
/// shape.
using twins_shape = backend::cuda_for<kernel_shape<dtype::bf16, 128, 4>>;

/// A host cache and a device cache of the same type fed the same three sequences (9 pages and a
/// tail each), then the same evictions: none in the first, half of its sealed tokens at random in
/// the second, 90% and one whole page in the third.
template <class Format, class Compactor, class Selector = select::all, class DeviceBackend = test::gpu_backend>
struct evicted_twins {
  evicted_twins(const Format& f, int page_size, const Selector& selector = {})
      : format(f), config(make_config(page_size)), host(config, format, selector), device(config, format, selector) {
    std::mt19937_64 rng(17);
    for (int b = 0; b < 3; ++b) {
      const int tokens = 9 * page_size + 5 + 7 * b;
      const auto kv = synthetic::generate_kv(test::generator_for(config, 30 + b), 0, tokens);
      const sequence_id h = host.add_sequence(), d = device.add_sequence();
      REQUIRE(h == d);
      host.prefill(h, test::k_view(kv), test::v_view(kv));
      device_array<float> k(kv.k), v(kv.v);
      device.prefill(d, tensor_view<const float, 3>(k.data(), tokens, config.num_kv_heads, config.head_dim),
                     tensor_view<const float, 3>(v.data(), tokens, config.num_kv_heads, config.head_dim));
      std::vector<std::int64_t> dead;
      const std::int64_t sealed = static_cast<std::int64_t>(host.pages(h).size()) * page_size;
      for (std::int64_t t = sink_rows(format); t < sealed; ++t)
        if (b > 0 && std::bernoulli_distribution(b == 1 ? 0.5 : 0.9)(rng)) dead.push_back(t);
      for (std::int64_t t = 2 * page_size; t < 3 * page_size && b == 2; ++t)  // and one whole page
        if (std::find(dead.begin(), dead.end(), t) == dead.end()) dead.push_back(t);
      std::sort(dead.begin(), dead.end());
      const span<const std::int64_t> positions(dead.data(), static_cast<std::int64_t>(dead.size()));
      host.evict(h, positions);
      device.evict(d, positions);
      seqs.push_back(h);
    }
    check_bookkeeping();
  }
  static cache_config make_config(int page_size) {
    cache_config c;
    c.num_kv_heads = 2;
    c.group_size = 4;
    c.head_dim = 128;
    c.page_size = page_size;
    c.max_pages = 128;
    c.max_sequences = 3;
    return c;
  }
  /// Block tables, positions and the pool agree.
  void check_bookkeeping() const {
    for (const sequence_id s : seqs) {
      REQUIRE(host.pages(s) == device.pages(s));
      REQUIRE(host.positions(s) == device.positions(s));
    }
    REQUIRE(host.pool().used_pages() == device.pool().used_pages());
  }
  /// The device's page bytes of every sequence equal the host's.
  void check_page_bytes() const {
    const std::size_t slot = host.engine().page_slot_bytes();
    std::vector<std::byte> device_slot(slot);
    for (const sequence_id s : seqs)
      for (const page_id page : host.pages(s)) {
        KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), device.engine().pages_data() + page * slot, slot, cudaMemcpyDeviceToHost));
        INFO("page " << page);
        REQUIRE(std::memcmp(device_slot.data(), host.engine().k_page(page, 0), slot) == 0);
      }
  }
  std::vector<float> queries() const {
    std::vector<float> q(3 * static_cast<std::size_t>(config.num_q_heads()) * config.head_dim);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.05f * static_cast<float>(i)) * 1.5f;
    return q;
  }
  std::vector<float> host_attend() {
    const std::vector<float> q = queries();
    std::vector<float> out(q.size());
    const int hq = config.num_q_heads(), d = config.head_dim;
    host.attend(span<const sequence_id>(seqs.data(), 3), tensor_view<const float, 3>(q.data(), 3, hq, d),
                tensor_view<float, 3>(out.data(), 3, hq, d));
    return out;
  }
  std::vector<float> device_attend() {
    const std::vector<float> q = queries();
    const int hq = config.num_q_heads(), d = config.head_dim;
    device_array<float> dq(q), dout(q.size());
    device.attend(span<const sequence_id>(seqs.data(), 3), tensor_view<const float, 3>(dq.data(), 3, hq, d),
                  tensor_view<float, 3>(dout.data(), 3, hq, d));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    return dout.to_host(q.size());
  }
  /// The formats' own host-device tolerance: a few fp32 ulps of the outputs' scale for dense and
  /// bitmap_tiles (order of summation, q and p split in two 16-bit halves on tensor cores), one
  /// 8-bit rounding step of p for the quantized formats.
  static double tolerance() { return format::is_quant_v<Format> ? 2e-2 : 2e-3; }

  Format format;
  cache_config config;
  cache<Format, Selector, Compactor> host;
  cache<Format, Selector, Compactor, DeviceBackend> device;
  std::vector<sequence_id> seqs;
};

double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(std::isfinite(a[i]));
    REQUIRE(std::isfinite(b[i]));
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
  }
  return worst;
}

template <class Format, class DeviceBackend = test::gpu_backend>
void check_eviction(const Format& format, int page_size) {
  evicted_twins<Format, compact::repack, select::all, DeviceBackend> t(format, page_size);
  const std::vector<float> host_out = t.host_attend(), gpu_out = t.device_attend();
  // The host reads exactly the live tokens (test_eviction.cpp); the device must agree with it.
  const double worst = largest_difference(gpu_out, host_out);
  INFO("largest |gpu - host| " << worst);
  CHECK(worst <= t.tolerance());
  // And evicted tokens are really skipped: attending with them would differ by far more.
  cache<Format, select::all, compact::repack> unevicted(t.config, format);
  for (int b = 0; b < 3; ++b) {
    const int tokens = 9 * page_size + 5 + 7 * b;
    const auto kv = synthetic::generate_kv(test::generator_for(t.config, 30 + b), 0, tokens);
    unevicted.prefill(unevicted.add_sequence(), test::k_view(kv), test::v_view(kv));
  }
  std::vector<float> all_out(host_out.size());
  const std::vector<float> q = t.queries();
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  unevicted.attend(span<const sequence_id>(t.seqs.data(), 3), tensor_view<const float, 3>(q.data(), 3, hq, d),
                   tensor_view<float, 3>(all_out.data(), 3, hq, d));
  double moved = 0;
  for (std::size_t i = 2 * static_cast<std::size_t>(hq) * d; i < q.size(); ++i)
    moved = std::max(moved, static_cast<double>(std::abs(all_out[i] - host_out[i])));
  CHECK(moved > 10 * worst);
}

/// The same compaction pass on both backends: the same reports, block tables, positions, pool and
/// page bytes, and the device attends as the host does (and, for formats that move token records
/// as they are, as it did before the pass). `captured`: the device's passes are captured in a
/// CUDA graph (relaxed mode) and replayed once, after a warm-up pass over a larger sequence has
/// sized the engine's arenas.
template <class Compactor, class Format, class DeviceBackend = test::gpu_backend>
void check_compaction(const Format& format, int page_size, bool captured = false) {
  evicted_twins<Format, Compactor, select::all, DeviceBackend> t(format, page_size);
  const std::vector<float> before = t.device_attend();
  if (captured) {
    REQUIRE(t.host.compact(t.seqs[1]).pages_freed == t.device.compact(t.seqs[1]).pages_freed);  // the warm-up pass
    cudaStream_t stream = nullptr;
    KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream));
    t.device.engine().set_stream(stream);
    cudaGraph_t graph = nullptr;
    KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    const compaction_report d = t.device.compact(t.seqs[2]);
    KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    const compaction_report h = t.host.compact(t.seqs[2]);
    CHECK(d.slot_copies == h.slot_copies);
    CHECK(d.slot_copies > 0);
    cudaGraphExec_t exec = nullptr;
    KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    KVMOSAIC_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    KVMOSAIC_CUDA_CHECK(cudaGraphExecDestroy(exec));
    KVMOSAIC_CUDA_CHECK(cudaGraphDestroy(graph));
    t.device.engine().set_stream(nullptr);
    KVMOSAIC_CUDA_CHECK(cudaStreamDestroy(stream));
  } else {
    const compaction_report h = t.host.compact(), d = t.device.compact();
    CHECK(d.pages_freed == h.pages_freed);
    CHECK(d.slot_copies == h.slot_copies);
    CHECK(d.tokens_evicted == h.tokens_evicted);
    CHECK(d.pages_reencoded == h.pages_reencoded);
    CHECK(h.pages_freed > 0);
  }
  t.check_bookkeeping();
  t.check_page_bytes();
  const std::vector<float> host_out = t.host_attend(), gpu_out = t.device_attend();
  const double worst = largest_difference(gpu_out, host_out);
  INFO("largest |gpu - host| after the pass " << worst);
  CHECK(worst <= t.tolerance());
  if (!detail::reencodes_moved_rows_v<Format>) {
    const double drift = largest_difference(gpu_out, before);
    INFO("largest |after - before| on the device " << drift);
    CHECK(drift <= t.tolerance());
  }
}

}  // namespace

TEST_CASE("GPU eviction: the device attends over the host's live tokens, every format", "[gpu][eviction][sanitize]") {
  if (!gpu_available()) return;
  check_eviction(format::dense{}, 16);
  check_eviction(format::dense{}, 64);
  format::bitmap_tiles b;
  b.s_k = 0.5f;
  b.s_v = 0.5f;
  check_eviction(b, 64);
  format::quant2 q2;
  q2.partition = 32;
  q2.mode = format::rounding::nearest;
  q2.sink_tokens = 0;
  check_eviction(q2, 32);
  format::quant4 q4;
  q4.partition = 32;
  q4.sink_tokens = 0;
  check_eviction<format::quant4, twins_shape>(q4, 32);
  format::quant<4, format::value_axis::head_dim> q4_token;
  q4_token.partition = 32;
  q4_token.sink_tokens = 0;
  check_eviction<decltype(q4_token), twins_shape>(q4_token, 64);
}

TEST_CASE("GPU compaction: repack and hole fill leave the host's tables, pool and page bytes, every format",
          "[gpu][eviction][compaction][sanitize]") {
  if (!gpu_available()) return;
  format::bitmap_tiles b;
  b.s_k = 0.5f;
  b.s_v = 0.7f;
  format::quant2 q2;
  q2.partition = 32;
  q2.mode = format::rounding::stochastic;
  q2.sink_tokens = 0;
  format::quant2 sinks = q2;  // stochastic rounding at seal; sinks kept dense
  sinks.sink_tokens = 4;
  check_compaction<compact::repack>(format::dense{}, 16);
  check_compaction<compact::hole_fill>(format::dense{}, 16);
  check_compaction<compact::repack>(format::dense{}, 64);
  check_compaction<compact::repack>(b, 64);
  check_compaction<compact::hole_fill>(b, 64);
  check_compaction<compact::repack>(q2, 32);
  check_compaction<compact::hole_fill>(q2, 64);
  check_compaction<compact::repack>(sinks, 64);
  format::quant4 q4;  // 4-bit codes through the device's unpack and encode kernels
  q4.partition = 32;
  q4.mode = format::rounding::stochastic;
  check_compaction<compact::repack, format::quant4, twins_shape>(q4, 64);
  format::quant<4, format::value_axis::head_dim> q4_token;
  q4_token.partition = 32;
  q4_token.sink_tokens = 0;
  check_compaction<compact::hole_fill, decltype(q4_token), twins_shape>(q4_token, 32);
}

TEST_CASE("GPU compaction: a pass captured in a CUDA graph", "[gpu][eviction][compaction]") {
  if (!gpu_available()) return;
  check_compaction<compact::repack>(format::dense{}, 16, true);
  format::quant2 q2;
  q2.partition = 64;
  q2.mode = format::rounding::stochastic;
  q2.sink_tokens = 0;
  check_compaction<compact::hole_fill>(q2, 64, true);
}

namespace {

/// select::streaming on both backends, fed the same prefill and 200 batched appends: after every
/// write the same evictions, compaction passes, block tables, positions and pool; at the end the
/// same page bytes and outputs within the format's host-device tolerance.
template <class Compactor, class Format>
void check_streaming(const Format& format, int page_size) {
  cache_config c = evicted_twins<Format, Compactor>::make_config(page_size);
  c.max_pages = 64;  // 2 x 500 tokens would need far more without eviction
  c.max_sequences = 2;
  select::streaming s;
  s.sink_tokens = 4;
  s.budget.tokens = 6 * page_size;
  s.compact_every = 48;
  cache<Format, select::streaming, Compactor> host(c, format, s);
  cache<Format, select::streaming, Compactor, test::gpu_backend> device(c, format, s);
  const int prefill = 300, appends = 200, total = prefill + appends;
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  std::vector<synthetic::kv_data> data;
  std::vector<sequence_id> seqs;
  for (int b = 0; b < 2; ++b) {
    data.push_back(synthetic::generate_kv(test::generator_for(c, 50 + b), 0, total));
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    seqs.push_back(h);
    const int n = prefill + 13 * b;
    host.prefill(h, tensor_view<const float, 3>(data[b].k.data(), n, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(data[b].v.data(), n, c.num_kv_heads, c.head_dim));
    device_array<float> k(std::vector<float>(data[b].k.begin(), data[b].k.begin() + n * static_cast<std::ptrdiff_t>(row)));
    device_array<float> v(std::vector<float>(data[b].v.begin(), data[b].v.begin() + n * static_cast<std::ptrdiff_t>(row)));
    device.prefill(d, tensor_view<const float, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
                   tensor_view<const float, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
  }
  const auto check_bookkeeping = [&] {
    for (const sequence_id seq : seqs) {
      REQUIRE(host.pages(seq) == device.pages(seq));
      REQUIRE(host.positions(seq) == device.positions(seq));
      REQUIRE(host.length(seq) == device.length(seq));
    }
    REQUIRE(host.pool().used_pages() == device.pool().used_pages());
  };
  check_bookkeeping();
  for (int t = 0; t < appends - 13; ++t) {
    std::vector<float> k(2 * row), v(2 * row);
    for (int b = 0; b < 2; ++b) {
      const std::size_t at = static_cast<std::size_t>(prefill + 13 * b + t) * row;
      std::copy_n(data[b].k.begin() + static_cast<std::ptrdiff_t>(at), row, k.begin() + static_cast<std::ptrdiff_t>(b * row));
      std::copy_n(data[b].v.begin() + static_cast<std::ptrdiff_t>(at), row, v.begin() + static_cast<std::ptrdiff_t>(b * row));
    }
    const span<const sequence_id> batch(seqs.data(), 2);
    host.append(batch, tensor_view<const float, 3>(k.data(), 2, c.num_kv_heads, c.head_dim),
                tensor_view<const float, 3>(v.data(), 2, c.num_kv_heads, c.head_dim));
    device_array<float> dk(k), dv(v);
    device.append(batch, tensor_view<const float, 3>(dk.data(), 2, c.num_kv_heads, c.head_dim),
                  tensor_view<const float, 3>(dv.data(), 2, c.num_kv_heads, c.head_dim));
    check_bookkeeping();
  }
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  REQUIRE(host.pool().used_pages() <= 2 * (6 + 2));  // the budget's pages, a partly dead one and the tail's next
  const std::size_t slot = host.engine().page_slot_bytes();
  std::vector<std::byte> device_slot(slot);
  for (const sequence_id seq : seqs)
    for (const page_id page : host.pages(seq)) {
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), device.engine().pages_data() + page * slot, slot, cudaMemcpyDeviceToHost));
      INFO("page " << page);
      REQUIRE(std::memcmp(device_slot.data(), host.engine().k_page(page, 0), slot) == 0);
    }
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(2 * static_cast<std::size_t>(hq) * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.07f * static_cast<float>(i)) * 1.5f;
  std::vector<float> host_out(q.size());
  const span<const sequence_id> batch(seqs.data(), 2);
  host.attend(batch, tensor_view<const float, 3>(q.data(), 2, hq, d), tensor_view<float, 3>(host_out.data(), 2, hq, d));
  device_array<float> dq(q), dout(q.size());
  device.attend(batch, tensor_view<const float, 3>(dq.data(), 2, hq, d), tensor_view<float, 3>(dout.data(), 2, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const double worst = largest_difference(dout.to_host(q.size()), host_out);
  INFO("largest |gpu - host| " << worst);
  CHECK(worst <= evicted_twins<Format, Compactor>::tolerance());
}

}  // namespace

TEST_CASE("GPU select::streaming: the host's evictions, compactions, tables and page bytes, every format",
          "[gpu][eviction][streaming][sanitize]") {
  if (!gpu_available()) return;
  check_streaming<compact::repack>(format::dense{}, 16);
  check_streaming<compact::hole_fill>(format::dense{}, 32);
  format::bitmap_tiles b;
  b.s_k = 0.5f;
  b.s_v = 0.7f;
  check_streaming<compact::repack>(b, 64);
  format::quant2 q2;
  q2.partition = 32;
  q2.sink_tokens = 4;
  check_streaming<compact::hole_fill>(q2, 32);
  check_streaming<compact::repack>(q2, 64);
}

namespace {

/// select::quest over a cache with evicted tokens, on both backends: the same outputs (the same
/// pages chosen from the same bounds, their rows ANDed with the live rows: a different choice at
/// a budget of 1/4 moves outputs far past the tolerance); after a compaction pass, which rewrites
/// the bounds of the pages it writes on both, the same again.
template <class Compactor>
void check_quest_eviction(int block_tokens) {
  select::quest quest;
  quest.budget.ratio = 0.25;
  quest.block_tokens = block_tokens;
  evicted_twins<format::dense, Compactor, select::quest> t(format::dense{}, 64, quest);
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<float> host_out = t.host_attend(), gpu_out = t.device_attend();
    const double worst = largest_difference(gpu_out, host_out);
    INFO("pass " << pass << ": largest |gpu - host| " << worst);
    CHECK(worst <= t.tolerance());
    if (pass == 0) {
      const compaction_report h = t.host.compact(), d = t.device.compact();
      CHECK(d.slot_copies == h.slot_copies);
      CHECK(h.pages_freed > 0);
      t.check_bookkeeping();
      t.check_page_bytes();
    }
  }
}

}  // namespace

TEST_CASE("GPU eviction with select::quest: live rows ANDed into the selection, bounds rewritten by compaction",
          "[gpu][eviction][select][sanitize]") {
  if (!gpu_available()) return;
  check_quest_eviction<compact::repack>(0);
  check_quest_eviction<compact::hole_fill>(16);
}

namespace {

/// A fork under compaction on both backends: the child shares its parent's pages, both evict
/// (the parent a whole leading page too), then both compact: the same tables, positions, pool and
/// page bytes, and each attends as the host does.
template <class Format>
void check_fork_compaction(const Format& format, int page_size) {
  cache_config c = evicted_twins<Format, compact::repack>::make_config(page_size);
  c.max_sequences = 2;
  cache<Format, select::all, compact::repack> host(c, format);
  cache<Format, select::all, compact::repack, test::gpu_backend> device(c, format);
  const int tokens = 10 * page_size + 3;
  const auto kv = synthetic::generate_kv(test::generator_for(c, 61), 0, tokens);
  const sequence_id parent = host.add_sequence();
  REQUIRE(device.add_sequence() == parent);
  host.prefill(parent, test::k_view(kv), test::v_view(kv));
  device_array<float> k(kv.k), v(kv.v);
  device.prefill(parent, tensor_view<const float, 3>(k.data(), tokens, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(v.data(), tokens, c.num_kv_heads, c.head_dim));
  const sequence_id child = host.fork_sequence(parent);
  REQUIRE(device.fork_sequence(parent) == child);
  std::vector<std::int64_t> child_dead, parent_dead;
  for (std::int64_t t = sink_rows(format); t < 10 * page_size; ++t)
    if (t % 3 != 0) child_dead.push_back(t);
  for (std::int64_t t = page_size; t < 2 * page_size; ++t) parent_dead.push_back(t);  // a whole page
  for (std::int64_t t = 5 * page_size + 1; t < 10 * page_size; t += 2) parent_dead.push_back(t);
  const auto evict_both = [&](sequence_id seq, const std::vector<std::int64_t>& dead) {
    const span<const std::int64_t> positions(dead.data(), static_cast<std::int64_t>(dead.size()));
    host.evict(seq, positions);
    device.evict(seq, positions);
  };
  evict_both(child, child_dead);
  evict_both(parent, parent_dead);  // the whole page leaves the parent: the child holds it alone
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(2 * static_cast<std::size_t>(hq) * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.09f * static_cast<float>(i));
  const auto parent_output = [&] {
    std::vector<float> out(q.size() / 2);
    host.attend(span<const sequence_id>(&parent, 1), tensor_view<const float, 3>(q.data(), 1, hq, d),
                tensor_view<float, 3>(out.data(), 1, hq, d));
    return out;
  };
  const std::vector<float> parent_before = parent_output();
  for (const sequence_id seq : {child, parent}) {
    const compaction_report h = host.compact(seq), r = device.compact(seq);
    CHECK(r.slot_copies == h.slot_copies);
    CHECK(r.pages_freed == h.pages_freed);
    if (seq == child) CHECK(parent_output() == parent_before);  // nothing the parent reads was written
  }
  const std::size_t slot = host.engine().page_slot_bytes();
  std::vector<std::byte> device_slot(slot);
  for (const sequence_id seq : {parent, child}) {
    REQUIRE(host.pages(seq) == device.pages(seq));
    REQUIRE(host.positions(seq) == device.positions(seq));
    for (const page_id page : host.pages(seq)) {
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), device.engine().pages_data() + page * slot, slot, cudaMemcpyDeviceToHost));
      REQUIRE(std::memcmp(device_slot.data(), host.engine().k_page(page, 0), slot) == 0);
    }
  }
  REQUIRE(host.pool().used_pages() == device.pool().used_pages());
  const sequence_id both[] = {parent, child};
  std::vector<float> host_out(q.size());
  host.attend(span<const sequence_id>(both, 2), tensor_view<const float, 3>(q.data(), 2, hq, d), tensor_view<float, 3>(host_out.data(), 2, hq, d));
  device_array<float> dq(q), dout(q.size());
  device.attend(span<const sequence_id>(both, 2), tensor_view<const float, 3>(dq.data(), 2, hq, d), tensor_view<float, 3>(dout.data(), 2, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const double worst = largest_difference(dout.to_host(q.size()), host_out);
  INFO("largest |gpu - host| " << worst);
  CHECK(worst <= evicted_twins<Format, compact::repack>::tolerance());
}

}  // namespace

TEST_CASE("GPU compaction of forked sequences: shared pages stay, both backends agree", "[gpu][eviction][compaction]") {
  if (!gpu_available()) return;
  check_fork_compaction(format::dense{}, 16);
  format::quant2 q2;
  q2.partition = 32;
  q2.mode = format::rounding::stochastic;
  q2.sink_tokens = 0;
  check_fork_compaction(q2, 32);
}

TEST_CASE("GPU compaction of bitmap_tiles with K weights changed since the seal: the host's bytes, every value kept",
          "[gpu][eviction][compaction][bitmap_tiles]") {
  if (!gpu_available()) return;
  format::bitmap_tiles b;
  b.s_k = 0.5f;
  b.s_v = 0.5f;
  evicted_twins<format::bitmap_tiles, compact::repack> t(b, 64);
  const std::vector<float> before = t.device_attend();
  // Weights 0 for half the channels: pruning the moved rows with them would drop kept values.
  std::vector<float> w(static_cast<std::size_t>(t.config.num_kv_heads) * t.config.head_dim, 1.0f);
  for (std::size_t i = 0; i < w.size(); ++i)
    if (i % static_cast<std::size_t>(t.config.head_dim) >= static_cast<std::size_t>(t.config.head_dim / 2)) w[i] = 0.0f;
  for (const sequence_id s : t.seqs) {
    t.host.set_key_weights(s, tensor_view<const float, 2>(w.data(), t.config.num_kv_heads, t.config.head_dim));
    t.device.set_key_weights(s, tensor_view<const float, 2>(w.data(), t.config.num_kv_heads, t.config.head_dim));
  }
  const compaction_report h = t.host.compact(), d = t.device.compact();
  CHECK(d.slot_copies == h.slot_copies);
  CHECK(h.slot_copies > 0);
  t.check_bookkeeping();
  t.check_page_bytes();
  const double drift = largest_difference(t.device_attend(), before);  // the same values, moved
  INFO("largest |after - before| on the device " << drift);
  CHECK(drift <= t.tolerance());
}
