// SPDX-License-Identifier: Apache-2.0
// select::snapkv on the CUDA backend. The window's votes (`cache::window_votes`) are computed on
// the device from the decode kernels' logits: they are checked against the host's fp64 votes over
// the same stored values; the device's snapshot evicts exactly what a brute-force ranking of its
// own votes says; a host cache given the same evictions then holds the same block tables,
// positions, pool and page bytes, and both attend over the survivors alike. A second snapshot
// after more tokens runs over a compacted sequence with sinks. Without a GPU the test says so and
// returns.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "../support/feed.hpp"
#include "snapkv_reference.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

/// One kernel shape (bf16, head_dim 64, groups of 2), so that this unit compiles one engine's kernels.
using snapkv_shape = backend::cuda_for<kernel_shape<dtype::bf16, 64, 2>>;

/// The largest difference between the device's votes and the host's fp64 votes, relative to the
/// largest vote, and whether both mark the same positions as holding no live token.
double vote_difference(const std::vector<double>& device, const std::vector<double>& host, bool& same_holes) {
  double worst = 0.0, largest = 0.0;
  same_holes = device.size() == host.size();
  for (std::size_t i = 0; i < host.size() && same_holes; ++i) {
    if (std::isinf(host[i]) || std::isinf(device[i])) {
      same_holes = std::isinf(host[i]) && std::isinf(device[i]);
      continue;
    }
    largest = std::max(largest, std::abs(host[i]));
    worst = std::max(worst, std::abs(device[i] - host[i]));
  }
  return largest > 0.0 ? worst / largest : worst;
}

std::vector<float> window_queries(int window, int q_heads, int dim, float phase) {
  std::vector<float> out(static_cast<std::size_t>(window) * q_heads * dim);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = 1.3f * std::sin(0.37f * static_cast<float>(i) + phase);
  return out;
}

/// One snapshot on both caches: the device's votes against the host's, the device's evictions
/// against the brute-force ranking of its votes, then the host cache given the same evictions.
template <class HostCache, class DeviceCache>
void snapshot_twins(HostCache& host, DeviceCache& device, sequence_id h, sequence_id d, const std::vector<float>& window) {
  const cache_config& c = host.config();
  const select::snapkv& s = host.selector();
  const tensor_view<const float, 3> queries(window.data(), s.window, c.num_q_heads(), c.head_dim);  // host memory on both
  const std::vector<std::int64_t> before = device.positions(d);
  REQUIRE(before == host.positions(h));
  const std::int64_t length = device.length(d), window_start = length - s.window;
  const std::vector<double> device_votes = device.window_votes(d, queries, 0.0f, s.combine);
  const std::vector<double> host_votes = host.window_votes(h, queries, 0.0f, s.combine);
  bool same_holes = false;
  const double difference = vote_difference(device_votes, host_votes, same_holes);
  INFO("largest |device - host| vote, relative to the largest vote: " << difference);
  CHECK(same_holes);
  // fp32 logits (the sm_90 kernel's q in two 16-bit halves: about 2^-16 of |q||k| per logit),
  // exps and sums of at most a few hundred terms: well under 1e-4 of the largest vote.
  CHECK(difference <= 1e-4);

  const std::int64_t stored = device.stored_tokens(d);
  const std::int64_t open_from = length - stored % c.page_size;
  const std::vector<std::int64_t> expected =
      test::brute_force_evictions(device_votes, before, window_start, std::min(window_start, open_from),
                            sink_rows(device.format()), c.num_kv_heads, s.pool_kernel, s.budget.resolve(length));
  const std::int64_t evicted = device.snapshot(d, queries);
  CHECK(evicted == static_cast<std::int64_t>(expected.size()));
  std::vector<std::int64_t> kept = device.positions(d), expected_kept;
  kept.erase(std::remove(kept.begin(), kept.end(), -1), kept.end());
  for (const std::int64_t t : before)
    if (t >= 0 && !std::binary_search(expected.begin(), expected.end(), t)) expected_kept.push_back(t);
  std::sort(kept.begin(), kept.end());  // hole_fill moves later tokens into earlier slots
  std::sort(expected_kept.begin(), expected_kept.end());
  REQUIRE(kept == expected_kept);

  if (!expected.empty()) {
    host.evict(h, span<const std::int64_t>(expected.data(), static_cast<std::int64_t>(expected.size())));
    host.compact(h);
  }
  REQUIRE(host.positions(h) == device.positions(d));
  REQUIRE(host.pages(h) == device.pages(d));
  REQUIRE(host.pool().used_pages() == device.pool().used_pages());
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::size_t slot = host.engine().page_slot_bytes();
  std::vector<std::byte> device_slot(slot);
  for (const page_id page : host.pages(h)) {
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), device.engine().pages_data() + page * slot, slot, cudaMemcpyDeviceToHost));
    INFO("page " << page);
    REQUIRE(std::memcmp(device_slot.data(), host.engine().k_page(page, 0), slot) == 0);
  }
}

template <class Format, class Compactor>
void check_snapkv_twins(const Format& format, int page_size, std::int64_t budget, group_combine combine, bool portable = false) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = page_size;
  c.max_pages = 64;
  c.max_sequences = 2;
  select::snapkv s;
  s.budget.tokens = budget;
  s.combine = combine;
  cache<Format, select::snapkv, Compactor> host(c, format, s);
  cache<Format, select::snapkv, Compactor, snapkv_shape> device(c, format, s);
  if (portable) device.engine().use_portable_kernel();
  const int n = 7 * page_size + 21, more = 3 * page_size + 5;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 31), 0, n + more);
  const sequence_id h = host.add_sequence(), d = device.add_sequence();
  REQUIRE(h == d);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  host.prefill(h, tensor_view<const float, 3>(data.k.data(), n, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data(), n, c.num_kv_heads, c.head_dim));
  device_array<float> k(data.k), v(data.v);
  device.prefill(d, tensor_view<const float, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
  const int hq = c.num_q_heads(), dim = c.head_dim;
  snapshot_twins(host, device, h, d, window_queries(s.window, hq, dim, 0.2f));
  // More tokens, then a second snapshot over the compacted sequence (evicted slots, moved rows).
  host.prefill(h, tensor_view<const float, 3>(data.k.data() + n * row, more, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data() + n * row, more, c.num_kv_heads, c.head_dim));
  device.prefill(d, tensor_view<const float, 3>(k.data() + n * row, more, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(v.data() + n * row, more, c.num_kv_heads, c.head_dim));
  snapshot_twins(host, device, h, d, window_queries(s.window, hq, dim, 1.1f));

  std::vector<float> q(static_cast<std::size_t>(hq) * dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.07f * static_cast<float>(i)) * 1.5f;
  std::vector<float> host_out(q.size());
  const sequence_id one[] = {h};
  host.attend(span<const sequence_id>(one, 1), tensor_view<const float, 3>(q.data(), 1, hq, dim),
              tensor_view<float, 3>(host_out.data(), 1, hq, dim));
  device_array<float> dq(q), dout(q.size());
  device.attend(span<const sequence_id>(one, 1), tensor_view<const float, 3>(dq.data(), 1, hq, dim),
                tensor_view<float, 3>(dout.data(), 1, hq, dim));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> gpu_out = dout.to_host(q.size());
  double worst = 0;
  for (std::size_t i = 0; i < q.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(gpu_out[i] - host_out[i])));
  INFO("largest |gpu - host| " << worst);
  CHECK(worst <= 2e-5);  // fp32 attention over the same bf16 rows, different summation orders

  // Rejections, before anything changes: a window longer than the sequence, queries of the wrong shape.
  const std::vector<float> long_window = window_queries(static_cast<int>(device.length(d)) + 1, hq, dim, 0.0f);
  const std::vector<std::int64_t> positions = device.positions(d);
  CHECK_THROWS_WITH(device.window_votes(d, tensor_view<const float, 3>(long_window.data(), device.length(d) + 1, hq, dim)),
                    Catch::Contains("queries.extent(0) (window)") && Catch::Contains("1 to length(seq)"));
  CHECK_THROWS_WITH(device.window_votes(d, tensor_view<const float, 3>(long_window.data(), 4, hq + 1, dim)),
                    Catch::Contains("queries.extent(1) (query heads)"));
  CHECK(device.positions(d) == positions);
}

}  // namespace

TEST_CASE("GPU snapkv: the host's snapshot, pages and attention", "[gpu][snapkv]") {
  if (!gpu_available()) return;
  format::dense sinks;
  sinks.sink_tokens = 4;
  SECTION("dense, repack") { check_snapkv_twins<format::dense, compact::repack>({}, 16, 60, group_combine::sum); }
  SECTION("dense, hole_fill, group max") {
    check_snapkv_twins<format::dense, compact::hole_fill>({}, 16, 75, group_combine::max);
  }
  SECTION("dense with 4 sinks, repack") { check_snapkv_twins<format::dense, compact::repack>(sinks, 16, 70, group_combine::sum); }
  SECTION("bitmap_tiles with 4 sinks, repack: votes on the pruned keys") {
    format::bitmap_tiles f;
    f.sink_tokens = 4;
    check_snapkv_twins<format::bitmap_tiles, compact::repack>(f, 64, 200, group_combine::sum);
  }
  SECTION("dense with 4 sinks, repack, the portable kernel") {
    check_snapkv_twins<format::dense, compact::repack>(sinks, 16, 70, group_combine::sum, true);
  }
}
