// SPDX-License-Identifier: Apache-2.0
#pragma once
// The GPU tests' harness: the same workload on a host cache and a CUDA cache of one format, and
// checks of the device's stored bytes and attention against the host backend and the fp64
// oracle on the values the format keeps. Without a GPU, gpu_available() says so and tests return.

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "../support/oracle.hpp"
#include "../support/prune.hpp"
#include "kvmosaic/kvmosaic.cuh"
#include "gpu_engines.cuh"  // generated: the engines of test::gpu_backend compiled once (test/gpu/CMakeLists.txt)
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {


inline bool gpu_available() {
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
template <class Format, class Selector = select::all, class DeviceBackend = test::gpu_backend>
struct twin {
  using host_cache = cache<Format, Selector, compact::none, backend::host>;
  using cuda_cache = cache<Format, Selector, compact::none, DeviceBackend>;

  twin(const cache_config& c, std::uint64_t seed, const Format& f = {}, const Selector& s = {})
      : config(c), format(f), host(c, f, s), device(c, f, s) {
    generator.num_kv_heads = c.num_kv_heads;
    generator.group_size = c.group_size;
    generator.head_dim = c.head_dim;
    generator.seed = seed;
  }

  sequence_id add(int tokens, std::uint64_t stream) {
    const auto kv = synthetic::generate_kv(generator, stream, tokens);
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    if constexpr (has_key_weights_v<Format>) {
      if (!key_weights.empty()) {
        const tensor_view<const float, 2> w(key_weights.data(), config.num_kv_heads, config.head_dim);
        host.set_key_weights(h, w);
        device.set_key_weights(d, w);
      }
    }
    device_array<float> k(kv.k), v(kv.v);
    const tensor_view<const float, 3> dk(k.data(), tokens, kv.num_kv_heads, kv.head_dim);
    const tensor_view<const float, 3> dv(v.data(), tokens, kv.num_kv_heads, kv.head_dim);
    if constexpr (selector_traits<Selector>::needs_token_ids) {
      const auto ids = synthetic::generate_tokens(generator, stream, tokens).ids;
      const span<const std::int32_t> id_span(ids.data(), tokens);
      host.prefill(h, test::k_view(kv), test::v_view(kv), id_span);
      device.prefill(d, dk, dv, id_span);
    } else {
      host.prefill(h, test::k_view(kv), test::v_view(kv));
      device.prefill(d, dk, dv);
    }
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    streams.push_back(stream);
    seqs.push_back(h);
    return h;
  }

  /// One decode token for every sequence, on both backends.
  void append_step() {
    std::vector<float> k, v;
    std::vector<std::int32_t> token_ids;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int position = static_cast<int>(host.length(seqs[b]));
      const auto row = synthetic::generate_kv(generator, streams[b], position, 1);
      k.insert(k.end(), row.k.begin(), row.k.end());
      v.insert(v.end(), row.v.begin(), row.v.end());
      if constexpr (selector_traits<Selector>::needs_token_ids)
        token_ids.push_back(synthetic::generate_tokens(generator, streams[b], position + 1).ids.back());
    }
    const auto batch = static_cast<std::int64_t>(seqs.size());
    const span<const sequence_id> ids(seqs.data(), batch);
    const tensor_view<const float, 3> hk(k.data(), batch, config.num_kv_heads, config.head_dim);
    const tensor_view<const float, 3> hv(v.data(), batch, config.num_kv_heads, config.head_dim);
    device_array<float> dk(k), dv(v);
    const tensor_view<const float, 3> gk(dk.data(), batch, config.num_kv_heads, config.head_dim);
    const tensor_view<const float, 3> gv(dv.data(), batch, config.num_kv_heads, config.head_dim);
    if constexpr (selector_traits<Selector>::needs_token_ids) {
      const span<const std::int32_t> id_span(token_ids.data(), batch);
      host.append(ids, hk, hv, id_span);
      device.append(ids, gk, gv, id_span);
    } else {
      host.append(ids, hk, hv);
      device.append(ids, gk, gv);
    }
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  }

  /// Each step's queries, [batch][num_q_heads][head_dim]: the generator's, then `adjust_queries`.
  std::vector<float> queries() const {
    std::vector<float> q;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto one = synthetic::generate_query(generator, streams[b], static_cast<int>(host.length(seqs[b])));
      q.insert(q.end(), one.begin(), one.end());
    }
    if (adjust_queries) adjust_queries(q);
    return q;
  }
  /// Rewrites the generated queries of every later step (empty: kept as generated).
  std::function<void(std::vector<float>&)> adjust_queries;

  /// One decode step's queries (each sequence's next position) and both backends' outputs,
  /// [batch][num_q_heads][head_dim] each; the GPU's output buffer starts poisoned with NaN.
  struct step_outputs {
    std::vector<float> q, host, gpu;
  };
  step_outputs attend_both() {
    step_outputs r;
    r.q = queries();
    const auto batch = static_cast<std::int64_t>(seqs.size());
    const int hq = config.num_q_heads(), d = config.head_dim;
    const span<const sequence_id> ids(seqs.data(), batch);
    r.host.resize(r.q.size());
    host.attend(ids, tensor_view<const float, 3>(r.q.data(), batch, hq, d), tensor_view<float, 3>(r.host.data(), batch, hq, d));
    device_array<float> dq(r.q), dout(r.q.size());
    device.attend(ids, tensor_view<const float, 3>(dq.data(), batch, hq, d), tensor_view<float, 3>(dout.data(), batch, hq, d));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    r.gpu = dout.to_host(r.q.size());
    return r;
  }

  /// Relative error of q inside the kernel: the sm_90 kernels multiply q split in two 16-bit parts
  /// on tensor cores (score_mma.cuh).
  double q_rounding() {
    return device.engine().uses_bulk_copy() ? (config.storage == dtype::bf16 ? std::ldexp(1.0, -16) : std::ldexp(1.0, -22))
                                            : 0.0;
  }
  /// The same for p, where the kernel splits p too (warp_attend_mma.cuh).
  double p_rounding() { return device.engine().splits_p_on_tensor_cores() ? q_rounding() : 0.0; }

  /// Attends on both backends and checks: GPU vs host, and each vs the fp64 oracle on the stored
  /// values within the fp32 error bound.
  void check_attention() {
    const step_outputs step = attend_both();
    const std::vector<float>& q = step.q;
    const std::vector<float>& host_out = step.host;
    const std::vector<float>& gpu_out = step.gpu;
    const int hq = config.num_q_heads(), d = config.head_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const int length = static_cast<int>(host.length(seqs[b]));
      CAPTURE(b, length);
      const auto stored = kept_values(test::rounded(synthetic::generate_kv(generator, streams[b], length), config.storage));
      const std::vector<float> qb(q.begin() + static_cast<std::ptrdiff_t>(b * per_seq),
                                  q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
      const auto exact = test::exact(qb, stored, scale);
      const auto bound = test::attention_error_bound(qb, stored, config.group_size, scale, config.storage,
                                                     config.page_size, /*exact_storage=*/true, q_rounding(), p_rounding());
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

  /// The values the format keeps of stored (rounded) data: all of them, or bitmap_tiles' pruning.
  synthetic::kv_data kept_values(synthetic::kv_data stored) const {
    if constexpr (std::is_same<Format, format::bitmap_tiles>::value)
      return pruned_cache(std::move(stored), config.page_size, format.s_k, format.s_v, key_weights);
    else
      return stored;
  }

  cache_config config;
  Format format;
  /// Output-aware K weights [num_kv_heads][head_dim] set on every sequence added (formats with
  /// has_key_weights_v; empty: magnitudes).
  std::vector<float> key_weights;
  synthetic::kv_config generator;
  host_cache host;
  cuda_cache device;
  std::vector<sequence_id> seqs;
  std::vector<std::uint64_t> streams;
};

inline cache_config small_config(int head_dim, int group_size, dtype storage, int page_size) {
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

}  // namespace kvmosaic::test
