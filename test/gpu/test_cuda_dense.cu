// SPDX-License-Identifier: Apache-2.0
// The CUDA backend with format::dense against the host backend and the fp64 oracle, on the same
// data: stored bytes (prefill and append kernels), decode attention on ragged batches, long
// contexts, split-KV, and a decode step captured in a CUDA graph. Without a GPU every test says
// so and passes without checking anything.

#include "reliability.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;
using test::small_config;
using twin = test::twin<format::dense>;
using host_cache = twin::host_cache;
using cuda_cache = twin::cuda_cache;


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
  t.device.reserve_step(static_cast<std::int32_t>(batch), 64 * c.page_size);  // fixed layout for the graph's lifetime

  device_array<float> dq(static_cast<std::size_t>(batch) * hq * d), dout(static_cast<std::size_t>(batch) * hq * d);
  const span<const sequence_id> seqs(t.seqs.data(), batch);
  t.device.plan(seqs);
  cudaGraph_t graph;
  KVMOSAIC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  t.device.run(tensor_view<const float, 3>(dq.data(), batch, hq, d), tensor_view<float, 3>(dout.data(), batch, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVMOSAIC_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int step = 0; step < 20; ++step) {  // 20 appends: sequences cross page boundaries
    const std::vector<float> q = t.queries();
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(dq.data(), q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
    t.device.plan(seqs);
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

// --- Reliability (test/gpu/reliability.hpp) -----------------------------------------------------

TEST_CASE("GPU dense: a prefill in chunks of any size into any tail fill equals one prefill",
          "[gpu][dense][reliability][prefill]") {
  if (!gpu_available()) return;
  std::vector<int> fills;
  for (int f = 0; f < 16; ++f) fills.push_back(f);
  test::reliability::check_chunked_prefill<format::dense>(fills);
}

TEST_CASE("GPU dense: every operation is all or nothing when any CUDA call inside it fails",
          "[gpu][dense][reliability][faults][sanitize]") {
  if (!gpu_available()) return;
  test::reliability::check_chunked_prefill<format::dense>({0, 5, 15});
  test::reliability::check_every_operation_all_or_nothing<format::dense, select::all>();
}

TEST_CASE("GPU dense: heads of a GQA group are independent; unreadable arrays are rejected, strided ones honoured",
          "[gpu][dense][reliability][arguments]") {
  if (!gpu_available()) return;
  test::reliability::check_heads_independent();
  test::reliability::check_device_arrays();
}
