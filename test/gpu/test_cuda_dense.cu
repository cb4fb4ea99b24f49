// SPDX-License-Identifier: Apache-2.0
// The CUDA backend with format::dense against the host backend and the fp64 oracle, on the same
// data: stored bytes (prefill and append kernels), decode attention on ragged batches, long
// contexts, split-KV, and a decode step captured in a CUDA graph. Without a GPU every test says
// so and passes without checking anything.

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.cuh"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;
using host_cache = cache<format::dense, select::all, compact::none, backend::host>;
using cuda_cache = cache<format::dense, select::all, compact::none, backend::cuda>;

namespace {

bool gpu_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    WARN("no CUDA device on this machine: GPU test skipped (run scripts/device/run-gpu-suite.sh on a GPU)");
    return false;
  }
  return true;
}

/// A device copy of a host vector.
template <class T>
struct device_array {
  explicit device_array(const std::vector<T>& host) : buffer(host.size() * sizeof(T)) {
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit device_array(std::size_t count) : buffer(count * sizeof(T)) {
    KVMOSAIC_CUDA_CHECK(cudaMemset(buffer.data(), 0xff, count * sizeof(T)));  // poison: NaN floats
  }
  T* data() const { return buffer.as<T>(); }
  std::vector<T> to_host(std::size_t count) const {
    std::vector<T> out(count);
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(out.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  kvmosaic::cuda::device_buffer buffer;
};

/// The same workload on both backends.
struct twin {
  twin(const cache_config& c, std::uint64_t seed) : config(c), host(c), device(c) {
    generator.num_kv_heads = c.num_kv_heads;
    generator.group_size = c.group_size;
    generator.head_dim = c.head_dim;
    generator.seed = seed;
  }

  sequence_id add(int tokens, std::uint64_t stream) {
    const auto kv = synthetic::generate_kv(generator, stream, tokens);
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    host.prefill(h, test::k_view(kv), test::v_view(kv));
    device_array<float> k(kv.k), v(kv.v);
    device.prefill(d, tensor_view<const float, 3>(k.data(), tokens, kv.num_kv_heads, kv.head_dim),
                   tensor_view<const float, 3>(v.data(), tokens, kv.num_kv_heads, kv.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    streams.push_back(stream);
    seqs.push_back(h);
    return h;
  }

  /// One decode token for every sequence, on both backends.
  void append_step() {
    std::vector<float> k, v;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto row = synthetic::generate_kv(generator, streams[b], static_cast<int>(host.length(seqs[b])), 1);
      k.insert(k.end(), row.k.begin(), row.k.end());
      v.insert(v.end(), row.v.begin(), row.v.end());
    }
    const auto batch = static_cast<std::int64_t>(seqs.size());
    const span<const sequence_id> ids(seqs.data(), batch);
    host.append(ids, tensor_view<const float, 3>(k.data(), batch, config.num_kv_heads, config.head_dim),
                tensor_view<const float, 3>(v.data(), batch, config.num_kv_heads, config.head_dim));
    device_array<float> dk(k), dv(v);
    device.append(ids, tensor_view<const float, 3>(dk.data(), batch, config.num_kv_heads, config.head_dim),
                  tensor_view<const float, 3>(dv.data(), batch, config.num_kv_heads, config.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  }

  std::vector<float> queries() const {
    std::vector<float> q;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto one = synthetic::generate_query(generator, streams[b], static_cast<int>(host.length(seqs[b])));
      q.insert(q.end(), one.begin(), one.end());
    }
    return q;
  }

  /// Attends on both backends and checks: GPU vs host, and each vs the fp64 oracle on the stored
  /// values within the fp32 error bound.
  void check_attention() {
    const std::vector<float> q = queries();
    const auto batch = static_cast<std::int64_t>(seqs.size());
    const int hq = config.num_q_heads(), d = config.head_dim;
    std::vector<float> host_out(q.size());
    host.attend(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
                tensor_view<float, 3>(host_out.data(), batch, hq, d));
    device_array<float> dq(q), dout(q.size());
    device.attend(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(dq.data(), batch, hq, d),
                  tensor_view<float, 3>(dout.data(), batch, hq, d));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> gpu_out = dout.to_host(q.size());
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int length = static_cast<int>(host.length(seqs[b]));
      CAPTURE(b, length);
      const auto stored = test::rounded(synthetic::generate_kv(generator, streams[b], length), config.storage);
      const std::vector<float> qb(q.begin() + static_cast<std::ptrdiff_t>(b * per_seq),
                                  q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
      const auto exact = test::exact(qb, stored, scale);
      // The sm_90 kernel multiplies q split in two 16-bit parts on tensor cores (score_mma.cuh).
      const double q_rounding = device.engine().uses_bulk_copy()
                                    ? (config.storage == dtype::bf16 ? std::ldexp(1.0, -16) : std::ldexp(1.0, -22))
                                    : 0.0;
      const double p_rounding = device.engine().uses_tma() ? q_rounding : 0.0;  // p . V on tensor cores too
      const auto bound = test::attention_error_bound(qb, stored, config.group_size, scale, config.storage,
                                                     config.page_size, /*exact_storage=*/true, q_rounding, p_rounding);
      for (std::size_t i = 0; i < per_seq; ++i) {
        const float g = gpu_out[b * per_seq + i], h = host_out[b * per_seq + i];
        INFO("element " << i);
        REQUIRE(std::isfinite(g));  // every output written (the buffer was poisoned with NaN)
        REQUIRE(std::abs(g - exact[i]) <= bound.per_element[i]);
        REQUIRE(std::abs(g - h) <= 2 * bound.per_element[i]);
      }
    }
  }

  /// The device page and tail bytes equal the host's, for every sequence.
  void check_storage() const {
    const std::size_t slot = host.engine().page_slot_bytes();
    std::vector<std::byte> device_slot(slot);
    for (const sequence_id s : seqs) {
      for (const page_id page : host.pages(s)) {
        KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), device.engine().pages_data() + page * slot, slot,
                                       cudaMemcpyDeviceToHost));
        REQUIRE(std::memcmp(device_slot.data(), host.engine().k_page(page, 0), slot) == 0);
      }
    }
  }

  cache_config config;
  synthetic::kv_config generator;
  host_cache host;
  cuda_cache device;
  std::vector<sequence_id> seqs;
  std::vector<std::uint64_t> streams;
};

cache_config small_config(int head_dim, int group_size, dtype storage, int page_size) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = group_size;
  c.head_dim = head_dim;
  c.page_size = page_size;
  c.storage = storage;
  c.max_pages = 512;
  c.max_sequences = 16;
  return c;
}

}  // namespace

TEST_CASE("GPU dense decode equals host and fp64 on ragged batches, every shape", "[gpu][dense]") {
  if (!gpu_available()) return;
  const int head_dim = GENERATE(64, 128, 256);
  const int group_size = GENERATE(1, 2, 3, 4, 5, 8);
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  // 16 and 64 divide the TMA stage, 128 is a multiple of it, 48 neither (the sm_90 bulk-copy
  // kernel); "portable" forces the sm_75+ kernel on any GPU.
  const int page_size = GENERATE(16, 48, 64, 128);
  const bool portable = GENERATE(false, true);
  CAPTURE(head_dim, group_size, to_string(storage), page_size, portable);
  twin t(small_config(head_dim, group_size, storage, page_size), 11);
  if (portable) t.device.engine().use_portable_kernel();
  for (int length : {1, 7, page_size - 1, page_size, page_size + 1, 5 * page_size + 3, 1000}) t.add(length, t.seqs.size());
  t.check_storage();
  t.check_attention();
  for (int step = 0; step < 3; ++step) t.append_step();  // crosses page boundaries (page_size - 1 + 3)
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU dense decode on small cases (compute-sanitizer)", "[gpu][dense][sanitize]") {
  if (!gpu_available()) return;
  const int group_size = GENERATE(1, 4, 8);
  twin t(small_config(128, group_size, dtype::bf16, 16), 3);
  t.add(1, 0);
  t.add(16, 1);
  t.add(37, 2);
  t.check_attention();
  t.append_step();
  t.check_storage();
  t.check_attention();
}

TEST_CASE("GPU dense decode at 128K context, batch 1, is split across the GPU and merged exactly",
          "[gpu][dense][long]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 4, dtype::bf16, 64);
  c.num_kv_heads = 1;
  c.max_pages = 2100;
  twin t(c, 5);
  t.add(131072 + 5, 0);
  t.check_attention();
}

TEST_CASE("GPU dense decode with batch 64 of ragged short sequences", "[gpu][dense]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 4, dtype::bf16, 64);
  c.max_sequences = 64;
  c.max_pages = 64 * 8;
  twin t(c, 9);
  for (int b = 0; b < 64; ++b) t.add(1 + (b * 37) % 400, static_cast<std::uint64_t>(b));
  t.check_attention();
  t.append_step();
  t.check_attention();
}

TEST_CASE("a decode step captured in a CUDA graph replays correctly as the cache grows", "[gpu][dense][graph]") {
  if (!gpu_available()) return;
  cache_config c = small_config(128, 4, dtype::bf16, 16);
  twin t(c, 21);
  t.add(30, 0);
  t.add(100, 1);
  const auto batch = static_cast<std::int64_t>(t.seqs.size());
  const int hq = c.num_q_heads(), d = c.head_dim;
  auto& engine = t.device.engine();
  cudaStream_t stream;
  KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream));
  engine.set_stream(stream);
  engine.reserve_step(static_cast<std::int32_t>(batch), 64);  // fixed layout for the graph's lifetime

  device_array<float> dq(static_cast<std::size_t>(batch) * hq * d), dout(static_cast<std::size_t>(batch) * hq * d);
  const auto refs = [&] {
    std::vector<detail::sequence_ref> r;
    for (const sequence_id s : t.seqs) r.push_back(detail::sequence_ref{&t.device.pages(s), t.device.length(s), s});
    return r;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  engine.plan_step(refs());
  cudaGraph_t graph;
  KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  engine.launch_step(dq.data(), dout.data(), scale);
  KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int step = 0; step < 20; ++step) {  // 20 appends: sequences cross page boundaries
    const std::vector<float> q = t.queries();
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(dq.data(), q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
    engine.plan_step(refs());
    KVMOSAIC_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> graph_out = dout.to_host(q.size());
    std::vector<float> host_out(q.size());
    t.host.attend(span<const sequence_id>(t.seqs.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
                  tensor_view<float, 3>(host_out.data(), batch, hq, d));
    for (std::size_t i = 0; i < q.size(); ++i) REQUIRE(std::abs(graph_out[i] - host_out[i]) <= 1e-4f * (1 + std::abs(host_out[i])));
    t.append_step();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  engine.set_stream(nullptr);
  cudaStreamDestroy(stream);
}

TEST_CASE("device conversions to 16 bits round like the host", "[gpu][dtype]") {
  if (!gpu_available()) return;
  // Covered end to end by check_storage (device-encoded bytes == host-encoded bytes); here the
  // hard cases directly: ties, subnormals, overflow.
  std::vector<float> x{1.0f + std::ldexp(1.0f, -11), 1.0f + std::ldexp(3.0f, -11), std::ldexp(1.0f, -25),
                       std::ldexp(3.0f, -26), 65519.0f, 65520.0f, 1.0f + std::ldexp(1.0f, -8), -3.0f, 1e-30f};
  const int n = static_cast<int>(x.size());
  cache_config c = small_config(64, 1, dtype::f16, 16);
  c.num_kv_heads = 1;
  for (const dtype storage : {dtype::f16, dtype::bf16}) {
    c.storage = storage;
    host_cache h(c);
    cuda_cache g(c);
    std::vector<float> rows(static_cast<std::size_t>(16) * 64);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = x[i % static_cast<std::size_t>(n)] * (i % 3 == 0 ? -1.0f : 1.0f);
    const sequence_id hs = h.add_sequence(), gs = g.add_sequence();
    h.prefill(hs, tensor_view<const float, 3>(rows.data(), 16, 1, 64), tensor_view<const float, 3>(rows.data(), 16, 1, 64));
    device_array<float> dr(rows);
    g.prefill(gs, tensor_view<const float, 3>(dr.data(), 16, 1, 64), tensor_view<const float, 3>(dr.data(), 16, 1, 64));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::byte> slot(h.engine().page_slot_bytes());
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(slot.data(), g.engine().pages_data(), slot.size(), cudaMemcpyDeviceToHost));
    CHECK(std::memcmp(slot.data(), h.engine().k_page(h.pages(hs)[0], 0), slot.size()) == 0);
  }
}
