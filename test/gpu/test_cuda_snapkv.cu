// SPDX-License-Identifier: Apache-2.0
// select::snapkv on the CUDA backend: the same prompt and window queries on a host cache and a
// device cache; the snapshot keeps the same tokens (both score the keys read back from the same
// page bytes), leaves the same block tables, positions, pool and page bytes, and the device then
// attends over the survivors as the host does. Without a GPU the test says so and returns.

#include <algorithm>
#include <cstring>

#include "../support/feed.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

/// One kernel shape (bf16, head_dim 64, groups of 2), so that this unit compiles one engine's kernels.
using snapkv_shape = backend::cuda_for<kernel_shape<dtype::bf16, 64, 2>>;

template <class Format, class Compactor>
void check_snapkv_twins(const Format& format, int page_size, std::int64_t budget) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = page_size;
  c.max_pages = 64;
  c.max_sequences = 2;
  select::snapkv s;
  s.budget.tokens = budget;
  cache<Format, select::snapkv, Compactor> host(c, format, s);
  cache<Format, select::snapkv, Compactor, snapkv_shape> device(c, format, s);
  const int n = 7 * page_size + 21;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 31), 0, n);
  const sequence_id h = host.add_sequence(), d = device.add_sequence();
  REQUIRE(h == d);
  host.prefill(h, tensor_view<const float, 3>(data.k.data(), n, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data(), n, c.num_kv_heads, c.head_dim));
  device_array<float> k(data.k), v(data.v);
  device.prefill(d, tensor_view<const float, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
  const int hq = c.num_q_heads(), dim = c.head_dim;
  std::vector<float> window(static_cast<std::size_t>(s.window) * hq * dim);
  for (std::size_t i = 0; i < window.size(); ++i) window[i] = 1.3f * std::sin(0.37f * static_cast<float>(i) + 0.2f);
  const tensor_view<const float, 3> queries(window.data(), s.window, hq, dim);  // host memory on both
  const std::int64_t host_evicted = host.snapshot(h, queries);
  const std::int64_t device_evicted = device.snapshot(d, queries);
  CHECK(host_evicted == device_evicted);
  CHECK(host_evicted == n - budget);
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
}

}  // namespace

TEST_CASE("GPU snapkv: the host's snapshot, pages and attention", "[gpu][snapkv]") {
  if (!gpu_available()) return;
  SECTION("dense, repack") { check_snapkv_twins<format::dense, compact::repack>({}, 16, 60); }
  SECTION("dense, hole_fill") { check_snapkv_twins<format::dense, compact::hole_fill>({}, 16, 75); }
}
