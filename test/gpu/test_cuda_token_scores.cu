// SPDX-License-Identifier: Apache-2.0
// Token scores on the CUDA backend (select::tova, select::h2o over format::dense,
// format::bitmap_tiles, format::quant2 and format::quant4): the same prompt, appends and queries on a host cache and a device cache. Each
// step's scores, which the device computes from the logits its split kernels write (normalized
// after the merge), equal the host attend path's; the evictions they drive keep the same tokens,
// pages and (dense) outputs. Every kernel path: the sm_90 kernels and the portable ones, dense's
// packed (group <= 4) and not, with and without exact rows (sinks). Without a GPU the test says
// so and returns.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../support/feed.hpp"
#include "kvmosaic/cuda/kernel/token_scores.cuh"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

/// Two kernel shapes: a group the tensor-core kernel packs (3) and one it does not (6).
using score_shapes = backend::cuda_for<kernel_shape<dtype::bf16, 64, 3>, kernel_shape<dtype::bf16, 64, 6>>;

using test::step_query;

/// Appends token lengths[b] + step of data[b] to sequence b of `batch` on both caches (the
/// device's from device memory).
template <class Host, class Device>
void append_next(Host& host, Device& device, span<const sequence_id> batch, const std::vector<synthetic::kv_data>& data,
                 const int* lengths, int step) {
  const cache_config& c = host.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto n = static_cast<std::size_t>(batch.size());
  std::vector<float> next_k(n * row), next_v(n * row);
  for (std::size_t b = 0; b < n; ++b) {
    const std::size_t at = static_cast<std::size_t>(lengths[b] + step) * row;
    std::copy(data[b].k.begin() + at, data[b].k.begin() + at + row, next_k.begin() + b * row);
    std::copy(data[b].v.begin() + at, data[b].v.begin() + at + row, next_v.begin() + b * row);
  }
  host.append(batch, tensor_view<const float, 3>(next_k.data(), batch.size(), c.num_kv_heads, c.head_dim),
              tensor_view<const float, 3>(next_v.data(), batch.size(), c.num_kv_heads, c.head_dim));
  device_array<float> dk(next_k), dv(next_v);
  device.append(batch, tensor_view<const float, 3>(dk.data(), batch.size(), c.num_kv_heads, c.head_dim),
                tensor_view<const float, 3>(dv.data(), batch.size(), c.num_kv_heads, c.head_dim));
}

/// Attends both caches with step `step`'s queries (sequence b: step_query(c, step + 100 b));
/// returns the largest |gpu - host| output.
template <class Host, class Device>
double attend_both(Host& host, Device& device, span<const sequence_id> batch, int step) {
  const cache_config& c = host.config();
  const int hq = c.num_q_heads(), dim = c.head_dim;
  std::vector<float> q;
  for (std::int64_t b = 0; b < batch.size(); ++b) {
    const std::vector<float> one = step_query(c, step + 100 * static_cast<int>(b));
    q.insert(q.end(), one.begin(), one.end());
  }
  std::vector<float> host_out(q.size());
  host.attend(batch, tensor_view<const float, 3>(q.data(), batch.size(), hq, dim),
              tensor_view<float, 3>(host_out.data(), batch.size(), hq, dim));
  device_array<float> dq(q), dout(q.size());
  device.attend(batch, tensor_view<const float, 3>(dq.data(), batch.size(), hq, dim),
                tensor_view<float, 3>(dout.data(), batch.size(), hq, dim));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> gpu_out = dout.to_host(q.size());
  double worst = 0;
  for (std::size_t i = 0; i < q.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(gpu_out[i] - host_out[i])));
  return worst;
}

template <class Format = format::dense>
struct twin_settings {
  int group = 3;
  bool portable = false;       ///< the device runs its portable (sm_75) kernel
  Format format{};
  int page_size = 16;
  std::int64_t budget = 1 << 20;
  int compact_every = 4;
};

/// The twins' shape: 2 KV heads of head_dim 64, `t`'s group and page size, 64 pages, 2 sequences.
template <class Format>
cache_config twin_config(const twin_settings<Format>& t) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = t.group;
  c.head_dim = 64;
  c.page_size = t.page_size;
  c.max_pages = 64;
  c.max_sequences = 2;
  return c;
}

/// Two sequences on both caches, sequence b prefilled with lengths[b] tokens of synthetic data
/// (seed + b) that has `steps` more for the appends; the data in `data`, the ids returned.
template <class Host, class Device>
std::vector<sequence_id> prefill_both(Host& host, Device& device, const int* lengths, std::uint64_t seed, int steps,
                                      std::vector<synthetic::kv_data>& data) {
  const cache_config& c = host.config();
  std::vector<sequence_id> seqs;
  for (int b = 0; b < 2; ++b) {
    const int n = lengths[b];
    data.push_back(synthetic::generate_kv(test::generator_for(c, seed + static_cast<std::uint64_t>(b)), 0, n + steps));
    const device_array<float> k(data.back().k), v(data.back().v);
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    seqs.push_back(h);
    host.prefill(h, tensor_view<const float, 3>(data[b].k.data(), n, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(data[b].v.data(), n, c.num_kv_heads, c.head_dim));
    device.prefill(d, tensor_view<const float, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
                   tensor_view<const float, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());  // the rows are read before k and v are freed
  }
  return seqs;
}

/// Runs `steps` decode steps (append, then attend) of a batch of two sequences of different
/// lengths on twin caches and checks the scores after each, then the positions, pages and
/// outputs. Returns the largest relative score difference.
template <class Format, class Selector, class Compactor = compact::repack>
double check_score_twins(const twin_settings<Format>& t, Selector selector, int steps, Compactor compactor = {}) {
  const cache_config c = twin_config(t);
  selector.budget.tokens = t.budget;
  selector.compact_every = t.compact_every;
  cache<Format, Selector, Compactor> host(c, t.format, selector, compactor);
  cache<Format, Selector, Compactor, score_shapes> device(c, t.format, selector, compactor);
  if (t.portable) device.engine().use_portable_kernel();
  const int lengths[2] = {5 * c.page_size + 13, 3 * c.page_size + 2};  // one in a split of its own, one not
  std::vector<synthetic::kv_data> data;
  const std::vector<sequence_id> seqs = prefill_both(host, device, lengths, 17, steps, data);
  const span<const sequence_id> batch(seqs.data(), 2);
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {  // the next token: the eviction it triggers ranks by the previous step's scores
      append_next(host, device, batch, data, lengths, step);
      for (const sequence_id seq : seqs) {
        INFO("step " << step << ", sequence " << seq);
        REQUIRE(host.positions(seq) == device.positions(seq));
        REQUIRE(host.pages(seq) == device.pages(seq));
      }
    }
    const double worst_out = attend_both(host, device, batch, step);
    INFO("step " << step << ", largest |gpu - host| output " << worst_out);
    if constexpr (!format::is_quant_v<Format>)
      CHECK(worst_out <= 2e-5);  // quant's outputs, with their derived bounds: test_cuda_quant2.cu, _quant_widths.cu
    for (const sequence_id seq : seqs) {
      const std::vector<float> hs = host.token_scores(seq), ds = device.token_scores(seq);
      REQUIRE(hs.size() == ds.size());
      std::size_t scored = 0;
      for (std::size_t i = 0; i < hs.size(); ++i) {
        // The tensor-core kernel multiplies q split into two bf16 halves (about 16 bits): a logit
        // differs from the host's fp32 one by about 2^-16 of sum |q k|, a probability by as much
        // relatively; the portable kernel is fp32 throughout. quant2's logits come from the same
        // 8-bit q' codes on both (the corrections summed in another order: fp32 rounding).
        const double difference = std::abs(static_cast<double>(ds[i]) - hs[i]);
        if (hs[i] > 1e-6f) worst = std::max(worst, difference / static_cast<double>(hs[i]));
        INFO("step " << step << ", sequence " << seq << ", score " << i << ": host " << hs[i] << ", device " << ds[i]);
        REQUIRE(difference <= 2e-4 * hs[i] + 1e-9);
        scored += hs[i] > 0.0f;
      }
      CHECK(scored > 0);
    }
  }
  return worst;
}

/// `check_score_twins` for a cache of `select::per_kv_head<Selector>`: twin caches, host and
/// device, whose two KV heads keep `budgets` tokens each; after each step the heads' positions,
/// scores and the outputs agree, and the heads kept different tokens. Returns the pool's head
/// pages in use at the end (the same on both).
template <class Format, class Selector>
std::int32_t check_per_head_twins(const twin_settings<Format>& t, Selector selector, std::int64_t budget0, std::int64_t budget1,
                                  int steps) {
  const cache_config c = twin_config(t);
  select::per_kv_head<Selector> s;
  s.selector = selector;
  s.selector.compact_every = t.compact_every;
  s.budgets = {select::token_budget{0, budget0}, select::token_budget{0, budget1}};
  cache<Format, select::per_kv_head<Selector>, compact::repack> host(c, t.format, s);
  cache<Format, select::per_kv_head<Selector>, compact::repack, score_shapes> device(c, t.format, s);
  if (t.portable) device.lanes().engine().use_portable_kernel();
  const int lengths[2] = {5 * c.page_size + 13, 3 * c.page_size + 2};
  std::vector<synthetic::kv_data> data;
  const std::vector<sequence_id> seqs = prefill_both(host, device, lengths, 41, steps, data);
  const span<const sequence_id> batch(seqs.data(), 2);
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {
      append_next(host, device, batch, data, lengths, step);
      for (const sequence_id seq : seqs)
        for (int head = 0; head < 2; ++head) {
          INFO("step " << step << ", sequence " << seq << ", head " << head);
          REQUIRE(host.positions(seq, head) == device.positions(seq, head));
          REQUIRE(host.stored_tokens(seq, head) == device.stored_tokens(seq, head));
        }
    }
    const double worst_out = attend_both(host, device, batch, step);
    INFO("step " << step << ", largest |gpu - host| output " << worst_out);
    if constexpr (!format::is_quant_v<Format>) CHECK(worst_out <= 2e-5);
    for (const sequence_id seq : seqs)
      for (int head = 0; head < 2; ++head) {
        const std::vector<float> hs = host.token_scores(seq, head), ds = device.token_scores(seq, head);
        REQUIRE(hs.size() == ds.size());
        for (std::size_t i = 0; i < hs.size(); ++i) {
          INFO("step " << step << ", sequence " << seq << ", head " << head << ", score " << i);
          REQUIRE(std::abs(static_cast<double>(ds[i]) - hs[i]) <= 2e-4 * hs[i] + 1e-9);  // as check_score_twins
        }
      }
  }
  for (const sequence_id seq : seqs) CHECK(host.positions(seq, 0) != host.positions(seq, 1));
  CHECK(host.pool().used_pages() == device.pool().used_pages());
  return device.pool().used_pages();
}

}  // namespace

TEST_CASE("GPU token scores: the host attend path's, on every kernel path", "[gpu][token_scores]") {
  if (!gpu_available()) return;
  for (const int group : {3, 6})
    for (const bool portable : {false, true}) {
      twin_settings<> t;
      t.group = group;
      t.portable = portable;
      INFO("group " << group << (portable ? ", portable kernel" : ", sm_90 kernel where there is one"));
      {
        const double worst = check_score_twins(t, select::tova{}, 4);
        INFO("tova: largest relative score difference " << worst);
        CHECK(worst <= 2e-4);
      }
      {
        select::h2o s;
        s.combine = group_combine::max;
        check_score_twins(t, s, 4);
      }
      {
        twin_settings<> exact = t;  // sinks: exact rows in the read order (an evicting cache keeps no
        exact.format.sink_tokens = 4;  // exact recent window)
        check_score_twins(exact, select::h2o{}, 3);
      }
    }
}

/// A compressed format on both kernel paths, groups 3 and 6: TOVA's scores without eviction, then
/// H2O (group max) evicting down to `budget`.
template <class Format>
void check_format_scores(twin_settings<Format> t, std::int64_t budget) {
  for (const int group : {3, 6})
    for (const bool portable : {false, true}) {
      t.group = group;
      t.portable = portable;
      t.budget = 1 << 20;
      INFO("group " << group << (portable ? ", portable kernel" : ", sm_90 kernel"));
      const double worst = check_score_twins(t, select::tova{}, 4);
      INFO("tova: largest relative score difference " << worst);
      CHECK(worst <= 2e-4);
      t.budget = budget;  // evictions: the same tokens kept
      select::h2o s;
      s.combine = group_combine::max;
      check_score_twins(t, s, 8);
    }
}

TEST_CASE("GPU token scores over quant2: the host attend path's, both kernel paths", "[gpu][token_scores][quant2]") {
  if (!gpu_available()) return;
  twin_settings<format::quant2> t;
  t.page_size = 32;
  t.format.partition = 32;  // 4 sinks (quant2's default): exact rows in the read order, page 0 masked
  check_format_scores(t, 96);
}

TEST_CASE("GPU token scores over quant4: the host attend path's, both kernel paths", "[gpu][token_scores][quant4]") {
  if (!gpu_available()) return;
  twin_settings<format::quant4> t;  // 4-bit codes through the same kernel template as quant2's
  t.page_size = 32;
  t.format.partition = 32;
  check_format_scores(t, 96);
}

TEST_CASE("GPU token scores over bitmap_tiles: the host attend path's, both kernel paths", "[gpu][token_scores][bitmap]") {
  if (!gpu_available()) return;
  twin_settings<format::bitmap_tiles> t;
  t.page_size = 64;
  t.format.sink_tokens = 4;  // exact rows in the read order, page 0's sinks masked by row masks
  check_format_scores(t, 200);
}

TEST_CASE("GPU token scores: evictions by them keep the host's tokens", "[gpu][token_scores]") {
  if (!gpu_available()) return;
  twin_settings<> t;
  t.budget = 48;
  SECTION("tova") { check_score_twins(t, select::tova{}, 8); }
  SECTION("h2o") { check_score_twins(t, select::h2o{}, 8); }
  SECTION("h2o, portable kernel, group 6, sinks") {
    t.portable = true;
    t.group = 6;
    t.format.sink_tokens = 4;
    check_score_twins(t, select::h2o{}, 8);
  }
}

TEST_CASE("GPU token scores: evictions ranked on the device keep the host's tokens under hole filling and any budget",
          "[gpu][token_scores][eviction]") {
  if (!gpu_available()) return;
  for (const bool portable : {false, true}) {
    INFO((portable ? "portable kernel" : "sm_90 kernel where there is one"));
    twin_settings<> t;
    t.portable = portable;
    t.compact_every = 3;  // hole filling moves the last rows into holes: slots no longer in position order
    t.budget = 40;
    check_score_twins(t, select::tova{}, 8, compact::hole_fill{});
    select::h2o h;
    h.recent_share = 0.25;
    check_score_twins(t, h, 8, compact::hole_fill{});
    t.budget = 0;  // everything evictable goes: the tail and what no step has read stay
    check_score_twins(t, select::tova{}, 4);
    t.budget = 1 << 20;  // beyond the context: nothing goes
    check_score_twins(t, select::h2o{}, 3, compact::hole_fill{});
  }
}

namespace {
/// The device ranking (`kernel::launch_ranking`, on `ctas` CTAs per request) on hand-made scores against the host's
/// `detail::lowest_ranked` of the same shared scores: ties (many exact zeros and equal values),
/// NaN, evicted slots, slots out of position order, sinks and a `before` bound.
std::vector<std::int64_t> device_ranking(const std::vector<float>& scores_by_head, std::int64_t stride, int heads,
                                         const std::vector<std::int64_t>& slot_positions, std::int64_t first_evictable,
                                         std::int64_t before, std::int64_t count, int ctas, std::vector<std::int64_t>& positions_after) {
  namespace k = kvmosaic::cuda::kernel;
  device_array<float> scores(scores_by_head);
  device_array<std::int64_t> positions(slot_positions);
  const auto slots = static_cast<std::int64_t>(slot_positions.size());
  // Two requests over the same sequence's keys, the second the one checked: requests index their
  // own keys and counters.
  const std::vector<k::rank_request> requests{
      k::rank_request{k::score_slot{scores.data(), stride, positions.data()}, std::min<std::int64_t>(slots, 3), first_evictable,
                      before, 0, 0},
      k::rank_request{k::score_slot{scores.data(), stride, positions.data()}, slots, first_evictable, before, count, 3}};
  std::vector<unsigned char> request_bytes(sizeof(k::rank_request) * requests.size());
  std::memcpy(request_bytes.data(), requests.data(), request_bytes.size());
  device_array<unsigned char> device_requests(request_bytes);
  device_array<unsigned long long> keys(std::vector<unsigned long long>(static_cast<std::size_t>(slots + 3)));
  device_array<unsigned char> states(std::vector<unsigned char>(2 * sizeof(k::rank_state), 0));
  const std::int64_t stride_chosen = std::max<std::int64_t>(count, 1);
  device_array<std::int64_t> chosen(std::vector<std::int64_t>(static_cast<std::size_t>(2 * (stride_chosen + 1)), 0));
  const k::rank_params p{reinterpret_cast<const k::rank_request*>(device_requests.data()),
                         reinterpret_cast<k::rank_state*>(states.data()), heads, keys.data(), chosen.data(), stride_chosen};
  k::launch_ranking(p, 2, ctas, count, nullptr);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int64_t> all = chosen.to_host(static_cast<std::size_t>(2 * (stride_chosen + 1)));
  REQUIRE(all[0] == 0);  // the first request asks for none
  const std::int64_t* row = all.data() + stride_chosen + 1;
  REQUIRE(row[0] >= 0);
  REQUIRE(row[0] <= stride_chosen);
  positions_after = positions.to_host(slot_positions.size());
  return std::vector<std::int64_t>(row + 1, row + 1 + row[0]);
}
}  // namespace

TEST_CASE("GPU eviction ranking: the host's lowest_ranked on the same scores", "[gpu][token_scores][ranking]") {
  if (!gpu_available()) return;
  const int heads = 3;
  for (const std::int64_t slots : {std::int64_t{1}, std::int64_t{37}, std::int64_t{1000}, std::int64_t{70000}}) {
    const std::int64_t stride = slots + 5;
    std::vector<float> scores(static_cast<std::size_t>(heads * stride));
    std::uint64_t state = 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(slots);
    const auto next = [&state] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return state;
    };
    for (float& x : scores) {
      const std::uint64_t r = next() % 16;
      x = r < 6 ? 0.0f : r < 9 ? 0.25f : r == 9 ? -0.0f : static_cast<float>(next() % 1000) / 997.0f;  // ties galore
    }
    scores[static_cast<std::size_t>(stride / 2)] = std::nanf("");  // NaN ranks highest
    // Slots out of position order (a hole-filling compaction), some evicted.
    std::vector<std::int64_t> positions(static_cast<std::size_t>(slots));
    for (std::int64_t i = 0; i < slots; ++i) positions[static_cast<std::size_t>(i)] = i;
    for (std::int64_t i = slots - 1; i > 0; --i) std::swap(positions[static_cast<std::size_t>(i)], positions[next() % static_cast<std::size_t>(i + 1)]);
    for (std::int64_t i = 0; i < slots; i += 7) positions[static_cast<std::size_t>(i)] = -1;
    const std::int64_t first_evictable = std::min<std::int64_t>(4, slots), before = slots - slots / 5;
    std::vector<std::int64_t> candidates;
    for (const std::int64_t p : positions)
      if (p >= first_evictable && p < before) candidates.push_back(p);
    std::sort(candidates.begin(), candidates.end());
    const auto shared = [&](std::int64_t p) {
      float total = 0.0f;
      for (int h = 0; h < heads; ++h) total += scores[static_cast<std::size_t>(h * stride + p)];
      return total;
    };
    for (const std::int64_t count : {std::int64_t{1}, std::int64_t{2}, slots / 3 + 1, static_cast<std::int64_t>(candidates.size()),
                                     static_cast<std::int64_t>(candidates.size()) + 9}) {
      INFO("slots " << slots << ", count " << count << ", candidates " << candidates.size());
      const std::vector<std::int64_t> expected = detail::lowest_ranked(candidates, count, shared);
      std::vector<std::int64_t> after;
      const int ctas = static_cast<int>(1 + (slots + count) % 5);  // one CTA, and several (the last-arriving one decides)
      const std::vector<std::int64_t> chosen =
          device_ranking(scores, stride, heads, positions, first_evictable, before, count, ctas, after);
      std::vector<std::int64_t> chosen_positions;
      for (const std::int64_t slot : chosen) {
        REQUIRE(slot >= 0);
        REQUIRE(slot < slots);
        chosen_positions.push_back(positions[static_cast<std::size_t>(slot)]);
        CHECK(after[static_cast<std::size_t>(slot)] == -1);  // marked evicted in the mirror
      }
      std::vector<std::int64_t> sorted_expected = expected;
      std::sort(sorted_expected.begin(), sorted_expected.end());
      std::sort(chosen_positions.begin(), chosen_positions.end());
      REQUIRE(chosen_positions == sorted_expected);
      std::int64_t marked = 0;
      for (std::size_t i = 0; i < after.size(); ++i) marked += after[i] != positions[i];
      CHECK(marked == static_cast<std::int64_t>(chosen.size()));
    }
  }
}

TEST_CASE("GPU per-KV-head eviction: each head keeps the host's tokens within its own budget, and frees its pages",
          "[gpu][token_scores][per_kv_head]") {
  if (!gpu_available()) return;
  for (const bool portable : {false, true}) {
    INFO((portable ? "portable kernel" : "sm_90 kernel where there is one"));
    twin_settings<> t;
    t.portable = portable;
    t.compact_every = 3;
    const std::int32_t tova_pages = check_per_head_twins(t, select::tova{}, 24, 64, 10);
    select::h2o h;
    h.combine = group_combine::max;
    const std::int32_t h2o_pages = check_per_head_twins(t, h, 24, 64, 10);
    // Two sequences, each head at most its budget's pages plus a partial one: (24 + 64) / 16 + 2 per sequence.
    CHECK(tova_pages <= 2 * ((24 + 64) / 16 + 2));
    CHECK(h2o_pages <= 2 * ((24 + 64) / 16 + 2));
  }
  SECTION("bitmap_tiles") {
    twin_settings<format::bitmap_tiles> t;
    t.page_size = 64;
    check_per_head_twins(t, select::h2o{}, 64, 200, 6);
  }
  SECTION("quant2") {
    twin_settings<format::quant2> t;
    t.page_size = 32;
    t.format.partition = 32;
    check_per_head_twins(t, select::tova{}, 40, 120, 6);
  }
}
