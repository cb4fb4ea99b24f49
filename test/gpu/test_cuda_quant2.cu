// SPDX-License-Identifier: Apache-2.0
// format::quant2 on the CUDA backend against the host backend: the device encoder writes the
// host's bytes exactly (the same stochastic draws for the same seed; prefill chunks and pages that
// appends complete), and the attention on the codes (int8 tensor cores, sm_90 pipeline and the
// portable kernel) equals the host's Eq. 4 within fp32 rounding and its effect on the 8-bit p
// grid, and exact attention on the decoded values within the bound the 8-bit steps predict.

#include <algorithm>

#include "../support/quant_bound.hpp"
#include "reliability.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;
using test::small_config;
using twin = test::twin<format::quant2>;

namespace {

/// Attends on both backends; checks the GPU against the host and against exact attention on the
/// values the host's pages decode to (test/support/quant_bound.hpp derives both bounds).
void check_quant2_attention(twin& t, bool report = false) {
  const twin::step_outputs step = t.attend_both();
  const std::vector<float>& q = step.q;
  const std::vector<float>& host_out = step.host;
  const std::vector<float>& gpu_out = step.gpu;
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
  std::vector<double> used_twin, used_exact;  // |difference| / bound
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const int length = static_cast<int>(t.host.length(t.seqs[b]));
    CAPTURE(b, length);
    const auto decoded = test::quant_decoded(
        t.host, t.seqs[b], test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), t.config.storage));
    const std::vector<float> qb(q.begin() + static_cast<std::ptrdiff_t>(b * per_seq),
                                q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    const auto exact = test::exact(qb, decoded, scale);
    const test::quant_bounds bounds = test::quant_attention_bounds(t.host, t.seqs[b], qb, decoded, scale);
    for (std::size_t i = 0; i < per_seq; ++i) {
      const float g = gpu_out[b * per_seq + i], h = host_out[b * per_seq + i];
      INFO("element " << i << ": gpu " << g << ", host " << h << ", exact " << exact[i]);
      REQUIRE(std::isfinite(g));  // every output written (the buffer was poisoned with NaN)
      REQUIRE(std::abs(g - h) <= bounds.vs_twin[i]);
      REQUIRE(std::abs(g - exact[i]) <= bounds.vs_exact[i]);
      used_twin.push_back(std::abs(g - h) / bounds.vs_twin[i]);
      used_exact.push_back(std::abs(g - exact[i]) / bounds.vs_exact[i]);
    }
  }
  if (report) {
    std::sort(used_twin.begin(), used_twin.end());
    std::sort(used_exact.begin(), used_exact.end());
    WARN("fraction of the bound used, median / max: gpu vs host " << used_twin[used_twin.size() / 2] << " / "
                                                                 << used_twin.back() << "; gpu vs exact "
                                                                 << used_exact[used_exact.size() / 2] << " / "
                                                                 << used_exact.back());
  }
}

}  // namespace

TEST_CASE("GPU quant2: device encode writes the host's bytes and attention on codes equals the host's",
          "[gpu][quant2]") {
  if (!gpu_available()) return;
  const int head_dim = GENERATE(64, 128, 256);
  const int partition = GENERATE(32, 64, 128);
  if (partition > head_dim) return;
  const int group_size = GENERATE(1, 3, 8);
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  const auto mode = GENERATE(format::rounding::stochastic, format::rounding::nearest);
  const int page_size = partition == 128 ? 128 : GENERATE(64, 128);
  const bool portable = GENERATE(false, true);
  CAPTURE(head_dim, partition, group_size, to_string(storage), mode == format::rounding::stochastic, page_size, portable);
  twin t(small_config(head_dim, group_size, storage, page_size), 13,
         format::quant2{partition, mode, 7, format::key_axis::tokens, /*sink_tokens=*/0});
  if (portable) t.device.engine().use_portable_kernel();
  // Lengths in the tail only, ending mid-partition, at page boundaries, and several pages.
  for (int length : {1, 7, partition + 5, page_size - 1, page_size, page_size + 1, 3 * page_size + 3, 700})
    t.add(length, t.seqs.size());
  t.check_storage();
  check_quant2_attention(t);
  for (int step = 0; step < 3; ++step) t.append_step();  // completes pages from the tail
  t.check_storage();
  check_quant2_attention(t);
}

TEST_CASE("GPU quant2 on small cases (compute-sanitizer)", "[gpu][quant2][sanitize]") {
  if (!gpu_available()) return;
  const bool portable = GENERATE(false, true);
  twin t(small_config(128, 4, dtype::bf16, 64), 3, format::quant2{});
  if (portable) t.device.engine().use_portable_kernel();
  t.add(1, 0);
  t.add(64, 1);
  t.add(200, 2);
  t.check_storage();
  check_quant2_attention(t);
  t.append_step();
  t.check_storage();
  check_quant2_attention(t);
}

TEST_CASE("GPU quant2 at 128K context, batch 1: prefill in encode chunks, split and merged", "[gpu][quant2][long]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 4, dtype::bf16, 64);
  c.num_kv_heads = 1;
  c.max_pages = 2100;
  twin t(c, 5, format::quant2{});
  t.add(131072 + 5, 0);
  t.check_storage();
  check_quant2_attention(t, /*report=*/true);
}

TEST_CASE("GPU quant2 with batch 64 of ragged sequences", "[gpu][quant2]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 8, dtype::f16, 64);
  c.max_sequences = 64;
  c.max_pages = 64 * 10;
  twin t(c, 9, format::quant2{});
  for (int b = 0; b < 64; ++b) t.add(1 + (b * 37) % 500, static_cast<std::uint64_t>(b));
  check_quant2_attention(t);
  for (int step = 0; step < 70; ++step) t.append_step();  // every sequence completes a page
  t.check_storage();
  check_quant2_attention(t, /*report=*/true);
}

TEST_CASE("GPU quant2 with sink tokens: the device keeps them as the host does", "[gpu][quant2][sinks]") {
  if (!gpu_available()) return;
  const int sinks = GENERATE(1, 4, 16);
  const bool portable = GENERATE(false, true);
  CAPTURE(sinks, portable);
  twin t(small_config(128, 4, dtype::bf16, 64), 21,
         format::quant2{64, format::rounding::stochastic, 5, format::key_axis::tokens, sinks});
  if (portable) t.device.engine().use_portable_kernel();
  // Tail only; first page sealed by the prefill; by an append (63 + 1); several pages and splits.
  for (int length : {10, 64, 63, 300, 4000}) t.add(length, t.seqs.size());
  t.check_storage();
  check_quant2_attention(t);
  t.append_step();
  t.check_storage();
  check_quant2_attention(t);
}

TEST_CASE("GPU quant2 rejects K partitioned per token, naming the parameter", "[gpu][quant2][errors]") {
  if (!gpu_available()) return;
  try {
    cache<format::quant2, select::all, compact::none, test::gpu_backend> bad(
        small_config(128, 4, dtype::bf16, 64), format::quant2{64, format::rounding::stochastic, 0, format::key_axis::head_dim});
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("format::quant2::k_axis") != std::string::npos);
  }
}

namespace {

/// Prefills `kv` (values of the test's choosing) as a new sequence on both backends of `t`.
sequence_id add_values(twin& t, const synthetic::kv_data& kv) {
  const sequence_id h = t.host.add_sequence(), d = t.device.add_sequence();
  REQUIRE(h == d);
  test::device_array<float> k(kv.k), v(kv.v);
  t.host.prefill(h, test::k_view(kv), test::v_view(kv));
  t.device.prefill(d, tensor_view<const float, 3>(k.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim),
                   tensor_view<const float, 3>(v.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  t.seqs.push_back(h);
  t.streams.push_back(0);
  return h;
}

/// One sequence's attention on both backends for query q [num_q_heads][head_dim].
std::pair<std::vector<float>, std::vector<float>> attend_values(twin& t, sequence_id id, const std::vector<float>& q) {
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  std::vector<float> host_out(q.size());
  t.host.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, hq, d),
                tensor_view<float, 3>(host_out.data(), 1, hq, d));
  test::device_array<float> dq(q), dout(q.size());
  t.device.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(dq.data(), 1, hq, d),
                  tensor_view<float, 3>(dout.data(), 1, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  return {host_out, dout.to_host(q.size())};
}

}  // namespace

TEST_CASE("GPU quant2 beyond f16's range: mins and scales in the storage dtype, f16 saturated, host bytes",
          "[gpu][quant2][range]") {
  if (!gpu_available()) return;
  // bf16: values below -65504 and partition ranges above 1.9e5 (f16 mins and scales would be
  // infinite); f16: the same inputs saturate to +-65504 on entry, on both backends alike.
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  const auto mode = GENERATE(format::rounding::stochastic, format::rounding::nearest);
  const bool portable = GENERATE(false, true);
  CAPTURE(to_string(storage), mode == format::rounding::stochastic, portable);
  twin t(small_config(128, 4, storage, 64), 31, format::quant2{64, mode, 3, format::key_axis::tokens, /*sink_tokens=*/0});
  if (portable) t.device.engine().use_portable_kernel();
  const int length = 300;
  synthetic::kv_data kv = synthetic::generate_kv(t.generator, 1, length);
  for (float& x : kv.k) x = x * 1e5f - 2e5f;
  for (float& x : kv.v) x = x * 1e6f - 1e6f;
  const sequence_id id = add_values(t, kv);
  t.check_storage();
  std::vector<float> q = synthetic::generate_query(t.generator, 1, length);
  for (float& x : q) x *= 1e-5f;
  const auto [host_out, gpu_out] = attend_values(t, id, q);
  const auto decoded = test::quant_decoded(t.host, id, test::rounded(kv, storage));
  const double scale = 1.0 / std::sqrt(128.0);
  const auto exact = test::exact(q, decoded, scale);
  const test::quant_bounds bounds = test::quant_attention_bounds(t.host, id, q, decoded, scale);
  for (std::size_t i = 0; i < q.size(); ++i) {
    const float g = gpu_out[i], h = host_out[i];
    INFO("element " << i << ": gpu " << g << ", host " << h << ", exact " << exact[i]);
    REQUIRE(std::isfinite(g));
    REQUIRE(std::abs(g - h) <= bounds.vs_twin[i]);
    REQUIRE(std::abs(g - exact[i]) <= bounds.vs_exact[i]);
  }
}

TEST_CASE("GPU quant2 with NaN and infinite K and V: the host's bytes; other heads unaffected",
          "[gpu][quant2][nan]") {
  if (!gpu_available()) return;
  // The encoder stores NaN min and scale and codes 0 for a partition with a non-finite value;
  // outputs that read it are not specified on the device (NaN, or what the split merge makes of
  // it), the other KV head's are.
  const bool portable = GENERATE(false, true);
  CAPTURE(portable);
  twin t(small_config(128, 4, dtype::bf16, 64), 33, format::quant2{64, format::rounding::stochastic, 3, format::key_axis::tokens, /*sink_tokens=*/0});
  if (portable) t.device.engine().use_portable_kernel();
  const int length = 300, d = 128;
  synthetic::kv_data kv = synthetic::generate_kv(t.generator, 2, length);
  kv.k[(static_cast<std::size_t>(70) * 2 + 1) * d + 5] = NAN;        // KV head 1
  kv.k[(static_cast<std::size_t>(130) * 2 + 1) * d + 9] = INFINITY;  // KV head 1
  kv.v[(static_cast<std::size_t>(3) * 2 + 1) * d + 17] = -INFINITY;  // KV head 1
  const sequence_id id = add_values(t, kv);
  t.check_storage();
  const std::vector<float> q = synthetic::generate_query(t.generator, 2, length);
  const auto [host_out, gpu_out] = attend_values(t, id, q);
  const auto decoded = test::quant_decoded(t.host, id, test::rounded(kv, dtype::bf16));
  const double scale = 1.0 / std::sqrt(128.0);
  const auto exact = test::exact(q, decoded, scale);
  const test::quant_bounds bounds = test::quant_attention_bounds(t.host, id, q, decoded, scale);
  for (std::size_t i = 0; i < 4 * static_cast<std::size_t>(d); ++i) {  // query heads 0-3: KV head 0
    const float g = gpu_out[i], h = host_out[i];
    INFO("element " << i << ": gpu " << g << ", host " << h << ", exact " << exact[i]);
    REQUIRE(std::isfinite(g));
    REQUIRE(std::abs(g - h) <= bounds.vs_twin[i]);
    REQUIRE(std::abs(g - exact[i]) <= bounds.vs_exact[i]);
  }
  for (std::size_t i = 4 * static_cast<std::size_t>(d); i < q.size(); ++i) CHECK(std::isnan(host_out[i]));
}

// --- Reliability (test/gpu/reliability.hpp) -----------------------------------------------------

TEST_CASE("GPU quant2: chunked prefills equal one prefill; all or nothing under CUDA errors",
          "[gpu][quant2][reliability][faults][sanitize]") {
  if (!gpu_available()) return;
  test::reliability::check_chunked_prefill<format::quant2>({0, 1, 2, 15, 16, 30, 31});
  test::reliability::check_every_operation_all_or_nothing<format::quant2, select::all>();
}
