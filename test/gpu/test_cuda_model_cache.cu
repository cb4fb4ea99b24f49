// SPDX-License-Identifier: Apache-2.0
// cache::read and model_cache on the CUDA backend against the host backend on the same data: the
// device's read-back equals the host's byte for byte (format::dense, bitmap_tiles, quant2 with
// sinks, after appends, on a stream of the caller's, and after evictions and compactions); a
// model of three CUDA layers of different types (dense/all, quant2/quest, bitmap_tiles/all)
// reads back the host model's rows, attends within the fp32 bound of the host model's outputs
// (dense, bitmap_tiles) or exactly as the same CUDA cache driven directly (quant2/quest), and its
// add, fork and remove fan out as on the host. Every cache is compiled for one kernel shape (bf16,
// head_dim 64, groups of 4: api_cache.cuh's, whose dense kernels api_cache.cu compiles). Without
// a GPU every test says so and returns.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../support/feed.hpp"
#include "api_cache.cuh"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

using one_shape = test::one_shape;  // bf16, head_dim 64, group_size 4

cache_config read_config() {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 64;
  c.storage = dtype::bf16;
  c.max_pages = 256;
  c.max_sequences = 8;
  return c;
}

format::quant2 quant2_with_sinks() {
  format::quant2 f;
  f.partition = 32;
  f.sink_tokens = 4;
  return f;
}

select::quest quarter_quest() {
  select::quest q;
  q.budget.ratio = 0.25;
  q.block_tokens = 16;
  return q;
}

/// A sequence's rows read back as bfloat16 (the storage type: the bytes themselves).
template <class Cache>
std::vector<bfloat16> read_bits(const Cache& kv, sequence_id seq, bool values) {
  const cache_config& c = kv.config();
  const std::int64_t n = kv.stored_tokens(seq);
  std::vector<bfloat16> k(static_cast<std::size_t>(n) * c.num_kv_heads * c.head_dim), v(k.size());
  kv.read(seq, tensor_view<bfloat16, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
          tensor_view<bfloat16, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
  return values ? v : k;
}

template <class Host, class Device>
void require_same_read(const Host& host, const Device& device, sequence_id h, sequence_id d) {
  REQUIRE(host.stored_tokens(h) == device.stored_tokens(d));
  for (const bool values : {false, true}) {
    const std::vector<bfloat16> a = read_bits(host, h, values), b = read_bits(device, d, values);
    REQUIRE(a.size() == b.size());
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(bfloat16)) == 0);
  }
  // Float destinations: the same values.
  const cache_config& c = host.config();
  const std::int64_t n = host.stored_tokens(h);
  std::vector<float> hk(static_cast<std::size_t>(n) * c.num_kv_heads * c.head_dim), hv(hk.size()), dk(hk.size()), dv(hk.size());
  host.read(h, tensor_view<float, 3>(hk.data(), n, c.num_kv_heads, c.head_dim), tensor_view<float, 3>(hv.data(), n, c.num_kv_heads, c.head_dim));
  device.read(d, tensor_view<float, 3>(dk.data(), n, c.num_kv_heads, c.head_dim), tensor_view<float, 3>(dv.data(), n, c.num_kv_heads, c.head_dim));
  REQUIRE(std::memcmp(hk.data(), dk.data(), hk.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(hv.data(), dv.data(), hv.size() * sizeof(float)) == 0);
}

/// The same synthetic rows on a host cache and a CUDA cache: prefills of ragged lengths, then
/// decode appends; every operation of the device cache on `stream`.
template <class Host, class Device>
struct read_twin {
  template <class... Args>
  explicit read_twin(const cache_config& c, cudaStream_t stream, const Args&... args) : config(c), host(c, args...), device(c, args...) {
    device.engine().set_stream(stream);
    generator = test::generator_for(c, 21);
  }

  void add(int tokens) {
    const auto kv = synthetic::generate_kv(generator, seqs.size(), tokens);
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    host.prefill(h, test::k_view(kv), test::v_view(kv));
    device_array<float> k(kv.k), v(kv.v);
    device.prefill(d, tensor_view<const float, 3>(k.data(), tokens, config.num_kv_heads, config.head_dim),
                   tensor_view<const float, 3>(v.data(), tokens, config.num_kv_heads, config.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(device.engine().stream()));  // k and v leave scope
    seqs.push_back(h);
  }

  void append_step() {
    std::vector<float> k, v;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto row = synthetic::generate_kv(generator, b, static_cast<int>(host.length(seqs[b])), 1);
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
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(device.engine().stream()));
  }

  void check() {
    for (const sequence_id s : seqs) {
      CAPTURE(s, host.stored_tokens(s));
      require_same_read(host, device, s, s);
    }
  }

  cache_config config;
  synthetic::kv_config generator;
  Host host;
  Device device;
  std::vector<sequence_id> seqs;
};

/// A CUDA stream for a test's lifetime: a blocking one, so device_array's copies and poisoning
/// (on the legacy stream) are ordered with the work on it.
struct owned_stream {
  owned_stream() { KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream)); }
  ~owned_stream() { cudaStreamDestroy(stream); }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  cudaStream_t stream = nullptr;
};

template <class Format>
void check_read_of(const Format& format) {
  owned_stream s;
  read_twin<cache<Format>, cache<Format, select::all, compact::none, one_shape>> t(read_config(), s.stream, format);
  for (const int length : {1, 4, 5, 63, 64, 65, 200, 3 * 64 + 3}) t.add(length);
  t.check();
  for (int step = 0; step < 3; ++step) t.append_step();  // seals the pages of 63 and 3 * 64 + 3 (+ 1)
  t.check();
}

}  // namespace

TEST_CASE("GPU read: the device's read-back equals the host's, byte for byte (dense, bitmap_tiles, quant2 with sinks)",
          "[gpu][read][sanitize]") {
  if (!gpu_available()) return;
  SECTION("dense") { check_read_of(format::dense{}); }
  SECTION("bitmap_tiles") { check_read_of(format::bitmap_tiles{0.5f, 0.7f}); }
  SECTION("quant2, 4 sinks") { check_read_of(quant2_with_sinks()); }
}

TEST_CASE("GPU read after evictions and compactions equals the host's (dense repack, quant2 hole_fill)", "[gpu][read][eviction]") {
  if (!gpu_available()) return;
  owned_stream s;
  const auto evict_and_compact = [](auto& t) {
    for (const int length : {300, 130}) t.add(length);
    for (std::size_t b = 0; b < t.seqs.size(); ++b) {
      std::vector<std::int64_t> dead;
      const std::int64_t sealed = t.host.length(t.seqs[b]) / 64 * 64;
      for (std::int64_t p = 8; p < sealed; ++p)
        if (p % 3 != 0) dead.push_back(p);
      const span<const std::int64_t> positions(dead.data(), static_cast<std::int64_t>(dead.size()));
      t.host.evict(t.seqs[b], positions);
      t.device.evict(t.seqs[b], positions);
    }
    t.check();  // evicted, not compacted: dead slots as stored
    for (const sequence_id seq : t.seqs) {
      t.host.compact(seq);
      t.device.compact(seq);
      REQUIRE(t.host.positions(seq) == t.device.positions(seq));
    }
    t.check();
    t.append_step();
    t.check();
  };
  SECTION("dense, repack") {
    read_twin<cache<format::dense, select::all, compact::repack>, cache<format::dense, select::all, compact::repack, one_shape>> t(
        read_config(), s.stream);
    evict_and_compact(t);
  }
  SECTION("quant2 with sinks, hole_fill") {
    read_twin<cache<format::quant2, select::all, compact::hole_fill>, cache<format::quant2, select::all, compact::hole_fill, one_shape>> t(
        read_config(), s.stream, quant2_with_sinks());
    evict_and_compact(t);
  }
}

namespace {

using host_dense = cache<format::dense, select::all>;
using host_quant2 = cache<format::quant2, select::quest>;
using host_bitmap = cache<format::bitmap_tiles, select::all>;
using device_dense = cache<format::dense, select::all, compact::none, one_shape>;
using device_quant2 = cache<format::quant2, select::quest, compact::none, one_shape>;
using device_bitmap = cache<format::bitmap_tiles, select::all, compact::none, one_shape>;

/// Layer `layer`'s K and V of stream `stream`, tokens [first, first + n).
synthetic::kv_data layer_rows(const cache_config& c, int layer, std::size_t stream, int first, int n) {
  return synthetic::generate_kv(test::generator_for(c, 200 + static_cast<std::uint64_t>(layer)), stream, first, n);
}

tensor_ref<3> ref(const float* data, std::int64_t a, std::int64_t b, std::int64_t c) {
  return tensor_ref<3>::of(tensor_view<const float, 3>(data, a, b, c));
}

/// Relative error of q and p inside the device kernel (twin.hpp's q_rounding and p_rounding).
template <class Cache>
std::pair<double, double> kernel_rounding(const Cache& kv) {
  const double q = kv.engine().uses_bulk_copy() ? std::ldexp(1.0, -16) : 0.0;  // bf16 storage
  return {q, kv.engine().splits_p_on_tensor_cores() ? q : 0.0};
}

}  // namespace

TEST_CASE("GPU model_cache: three CUDA layers read back, attend and fan out as the host model does",
          "[gpu][model_cache][sanitize]") {
  if (!gpu_available()) return;
  const cache_config c = read_config();
  const int h = c.num_kv_heads, d = c.head_dim, hq = c.num_q_heads();
  const format::quant2 q2 = quant2_with_sinks();
  const format::bitmap_tiles bm{0.5f, 0.7f};
  std::vector<std::unique_ptr<layer_cache>> host_layers, device_layers;
  host_layers.push_back(make_layer<host_dense>(c));
  host_layers.push_back(make_layer<host_quant2>(c, q2, quarter_quest()));
  host_layers.push_back(make_layer<host_bitmap>(c, bm));
  device_layers.push_back(make_layer<device_dense>(c));
  device_layers.push_back(make_layer<device_quant2>(c, q2, quarter_quest()));
  device_layers.push_back(make_layer<device_bitmap>(c, bm));
  model_cache host(std::move(host_layers)), device(std::move(device_layers));
  device_quant2 direct(c, q2, quarter_quest());  // the quant2/quest layer driven directly
  owned_stream s;
  device.set_stream(s.stream);
  direct.engine().set_stream(s.stream);
  REQUIRE(device.layer(1).on_device());
  REQUIRE_FALSE(host.layer(1).on_device());

  std::vector<sequence_id> seqs;
  const std::vector<int> lengths{300, 65, 9};
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    const sequence_id id = host.add_sequence();
    REQUIRE(device.add_sequence() == id);
    REQUIRE(direct.add_sequence() == device.layer_sequence(1, id));
    seqs.push_back(id);
    for (int layer = 0; layer < 3; ++layer) {
      const auto kv = layer_rows(c, layer, b, 0, lengths[b]);
      host.prefill(layer, id, ref(kv.k.data(), lengths[b], h, d), ref(kv.v.data(), lengths[b], h, d));
      device_array<float> k(kv.k), v(kv.v);
      device.prefill(layer, id, ref(k.data(), lengths[b], h, d), ref(v.data(), lengths[b], h, d));
      if (layer == 1)
        direct.prefill(device.layer_sequence(1, id), tensor_view<const float, 3>(k.data(), lengths[b], h, d),
                       tensor_view<const float, 3>(v.data(), lengths[b], h, d));
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    }
  }
  const auto batch = static_cast<std::int64_t>(seqs.size());
  const span<const sequence_id> ids(seqs.data(), batch);
  std::vector<sequence_id> direct_ids;
  for (const sequence_id id : seqs) direct_ids.push_back(device.layer_sequence(1, id));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int step = 0; step < 4; ++step) {
    for (int layer = 0; layer < 3; ++layer) {
      CAPTURE(step, layer);
      std::vector<float> k, v, q;
      for (std::int64_t b = 0; b < batch; ++b) {
        const int position = static_cast<int>(host.layer(layer).length(host.layer_sequence(layer, seqs[static_cast<std::size_t>(b)])));
        const auto row = layer_rows(c, layer, static_cast<std::size_t>(b), position, 1);
        k.insert(k.end(), row.k.begin(), row.k.end());
        v.insert(v.end(), row.v.begin(), row.v.end());
        const auto query = synthetic::generate_query(test::generator_for(c, 200 + static_cast<std::uint64_t>(layer)),
                                                     static_cast<std::uint64_t>(b), position + 1);
        q.insert(q.end(), query.begin(), query.end());
      }
      host.append(layer, ids, ref(k.data(), batch, h, d), ref(v.data(), batch, h, d));
      device_array<float> dk(k), dv(v), dq(q), dout(q.size()), direct_out(q.size());
      device.append(layer, ids, ref(dk.data(), batch, h, d), ref(dv.data(), batch, h, d));
      std::vector<float> host_out(q.size());
      host.attend(layer, ids, ref(q.data(), batch, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(host_out.data(), batch, hq, d)));
      device.attend(layer, ids, ref(dq.data(), batch, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(dout.data(), batch, hq, d)));
      if (layer == 1) {
        const span<const sequence_id> direct_span(direct_ids.data(), batch);
        direct.append(direct_span, tensor_view<const float, 3>(dk.data(), batch, h, d), tensor_view<const float, 3>(dv.data(), batch, h, d));
        direct.attend(direct_span, tensor_view<const float, 3>(dq.data(), batch, hq, d), tensor_view<float, 3>(direct_out.data(), batch, hq, d));
      }
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(s.stream));
      const std::vector<float> gpu = dout.to_host(q.size());
      if (layer == 1) {
        const std::vector<float> want = direct_out.to_host(q.size());
        REQUIRE(std::memcmp(gpu.data(), want.data(), gpu.size() * sizeof(float)) == 0);
        continue;
      }
      // dense and bitmap_tiles: exact attention over the rows the host model reads back, within
      // the fp32 bound with the kernel's q and p rounding (twin.hpp's check).
      const auto rounding = layer == 0 ? kernel_rounding(dynamic_cast<layer_cache_of<device_dense>&>(device.layer(0)).get())
                                       : kernel_rounding(dynamic_cast<layer_cache_of<device_bitmap>&>(device.layer(2)).get());
      const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
      for (std::int64_t b = 0; b < batch; ++b) {
        const sequence_id id = seqs[static_cast<std::size_t>(b)];
        synthetic::kv_data rows;
        rows.num_kv_heads = h;
        rows.head_dim = d;
        rows.num_tokens = static_cast<int>(host.layer(layer).stored_tokens(host.layer_sequence(layer, id)));
        rows.k.resize(static_cast<std::size_t>(rows.num_tokens) * h * d);
        rows.v.resize(rows.k.size());
        host.read(layer, id, tensor_ref<3>::of(tensor_view<float, 3>(rows.k.data(), rows.num_tokens, h, d)),
                  tensor_ref<3>::of(tensor_view<float, 3>(rows.v.data(), rows.num_tokens, h, d)));
        const std::vector<float> qb(q.begin() + static_cast<std::ptrdiff_t>(b * per_seq), q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
        const auto exact = test::exact(qb, rows, scale);
        const auto bound = test::attention_error_bound(qb, rows, c.group_size, scale, c.storage, c.page_size, /*exact_storage=*/true,
                                                       rounding.first, rounding.second);
        for (std::size_t i = 0; i < per_seq; ++i) {
          const float g = gpu[static_cast<std::size_t>(b) * per_seq + i], hv = host_out[static_cast<std::size_t>(b) * per_seq + i];
          INFO("sequence " << b << ", element " << i);
          REQUIRE(std::isfinite(g));
          REQUIRE(std::abs(g - exact[i]) <= bound.per_element[i]);
          REQUIRE(std::abs(g - hv) <= 2 * bound.per_element[i]);
        }
      }
    }
  }
  // Every layer of every sequence reads back the host model's rows, byte for byte.
  const auto same_rows = [&](sequence_id id) {
    for (int layer = 0; layer < 3; ++layer) {
      const std::int64_t n = host.layer(layer).stored_tokens(host.layer_sequence(layer, id));
      REQUIRE(device.layer(layer).stored_tokens(device.layer_sequence(layer, id)) == n);
      std::vector<bfloat16> hk(static_cast<std::size_t>(n) * h * d), hv(hk.size()), dk(hk.size()), dv(hk.size());
      const auto as_ref = [&](std::vector<bfloat16>& x) { return tensor_ref<3>::of(tensor_view<bfloat16, 3>(x.data(), n, h, d)); };
      host.read(layer, id, as_ref(hk), as_ref(hv));
      device.read(layer, id, as_ref(dk), as_ref(dv));
      REQUIRE(std::memcmp(hk.data(), dk.data(), hk.size() * sizeof(bfloat16)) == 0);
      REQUIRE(std::memcmp(hv.data(), dv.data(), hv.size() * sizeof(bfloat16)) == 0);
    }
  };
  for (const sequence_id id : seqs) same_rows(id);
  // plan then run on a CUDA graph-sized step (reserve_step) is attend, bit for bit, with the
  // log-sum-exp written.
  device.reserve_step(static_cast<std::int32_t>(batch), 1024);
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<float> q;
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto one = synthetic::generate_query(test::generator_for(c, 200 + static_cast<std::uint64_t>(layer)),
                                                 static_cast<std::uint64_t>(b), 400);
      q.insert(q.end(), one.begin(), one.end());
    }
    device_array<float> dq(q), by_attend(q.size()), by_run(q.size()), lse(static_cast<std::size_t>(batch) * hq);
    device.attend(layer, ids, ref(dq.data(), batch, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_attend.data(), batch, hq, d)));
    device.plan(layer, ids);
    device.run(layer, ref(dq.data(), batch, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_run.data(), batch, hq, d)),
               tensor_ref<2>::of(tensor_view<float, 2>(lse.data(), batch, hq)));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    const std::vector<float> a = by_attend.to_host(q.size()), r = by_run.to_host(q.size());
    REQUIRE(std::memcmp(a.data(), r.data(), a.size() * sizeof(float)) == 0);
    for (const float x : lse.to_host(static_cast<std::size_t>(batch) * hq)) REQUIRE(std::isfinite(x));
  }
  // Fork and remove fan out alike; the fork reads its parent's rows.
  const sequence_id child = host.fork_sequence(seqs[0]);
  REQUIRE(device.fork_sequence(seqs[0]) == child);
  same_rows(child);
  host.remove_sequence(seqs[1]);
  device.remove_sequence(seqs[1]);
  REQUIRE_THROWS_AS(device.length(seqs[1]), invalid_argument);
  const memory_stats hm = host.memory(), dm = device.memory();
  REQUIRE(dm.tokens == hm.tokens);
  REQUIRE(dm.pages_used == hm.pages_used);
  REQUIRE(dm.pages_free == hm.pages_free);
  REQUIRE(device.length(child) == host.length(child));
}
