// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A model's cache: every attention layer's `kvmosaic::cache` behind one object, for an inference
/// engine or a language binding (PyTorch) that cannot name one cache type per layer at compile
/// time.
///
/// - `tensor_ref<Rank>`: a strided view whose element type (f32, f16, bf16) is a run-time value,
///   the argument of every type-erased call; `as<T>()` gives the typed `tensor_view` back.
/// - `layer_cache`: one layer's cache of any type behind virtual calls (one indirect call per
///   operation, then the typed cache's own code); `layer_cache_of<Cache>` is the adapter that
///   owns a `Cache` and `make_layer<Cache>(args...)` builds one.
/// - `model_cache`: the layers of a model with one sequence id space: adding, forking and
///   removing a sequence fans out to every layer, all or nothing; per-layer calls take the
///   model's ids.
///
/// Nothing here includes CUDA: a layer on `backend::cuda` is built in a `.cu` file that includes
/// <kvmosaic/kvmosaic.cuh> (which compiles its kernels); a host-only file can then drive it
/// through `layer_cache` and `model_cache` with device pointers (`layer_cache::on_device`).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvmosaic/cache.hpp"
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/select/selector_traits.hpp"

namespace kvmosaic {

/// A strided view whose element type is a run-time value: `data`, `type` (f32, f16 or bf16: the
/// element types float, kvmosaic::half, kvmosaic::bfloat16), `extents` and `strides` (in elements).
/// Non-owning and trivially copyable, like `tensor_view`; host or device memory as the call that
/// takes it says. An aggregate: `tensor_ref<3>{ptr, dtype::bf16, {t, h, d}, {h * d, d, 1}}`.
/// It does not keep a view's constness: a callee reads or writes it as its contract says.
template <int Rank>
struct tensor_ref {
  static_assert(Rank >= 1 && Rank <= 4, "kvmosaic: tensor_ref Rank must be 1 to 4");

  void* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t extents[Rank] = {};
  std::int64_t strides[Rank] = {};

  /// The reference of a typed view (T: float, half or bfloat16, const or not). Cost: O(Rank).
  template <class T>
  static tensor_ref of(const tensor_view<T, Rank>& view) noexcept {
    static_assert(detail::is_io_type<std::remove_const_t<T>>::value,
                  "kvmosaic::tensor_ref::of: the element type must be float, kvmosaic::half or kvmosaic::bfloat16");
    tensor_ref r;
    r.data = const_cast<void*>(static_cast<const void*>(view.data()));
    r.type = dtype_traits<std::remove_const_t<T>>::id;
    for (int d = 0; d < Rank; ++d) {
      r.extents[d] = view.extent(d);
      r.strides[d] = view.stride(d);
    }
    return r;
  }

  /// The typed view (T: float, half or bfloat16, const or not). Throws `invalid_argument` naming
  /// this reference's dtype when it is not T's. Cost: O(Rank).
  template <class T>
  tensor_view<T, Rank> as() const {
    using element = std::remove_const_t<T>;
    static_assert(detail::is_io_type<element>::value,
                  "kvmosaic::tensor_ref::as: the element type must be float, kvmosaic::half or kvmosaic::bfloat16");
    detail::require(type == dtype_traits<element>::id, "tensor_ref::as", "type", to_string(type),
                    element_name<element>());
    return tensor_view<T, Rank>::strided(static_cast<T*>(data), extents, strides);
  }

 private:
  template <class E>
  static const char* element_name() noexcept {
    return std::is_same<E, float>::value ? "f32 (the element type asked for: float)"
           : std::is_same<E, half>::value ? "f16 (the element type asked for: kvmosaic::half)"
                                          : "bf16 (the element type asked for: kvmosaic::bfloat16)";
  }
};

namespace detail {

template <class T>
struct type_tag {
  using type = T;
};

/// Calls f(type_tag<T>{}) with the element type of run-time dtype `t` (f32, f16 or bf16); an
/// unknown value is an `invalid_argument` naming `parameter`.
template <class F>
decltype(auto) with_io_type(dtype t, const char* where, const char* parameter, F&& f) {
  switch (t) {
    case dtype::f32: return f(type_tag<float>{});
    case dtype::f16: return f(type_tag<half>{});
    case dtype::bf16: return f(type_tag<bfloat16>{});
  }
  throw invalid_argument(parameter, describe(where, parameter, static_cast<int>(t), "dtype::f32, dtype::f16 or dtype::bf16"));
}

/// The parameter type of a one-argument member function (an engine's `set_stream`).
template <class Member>
struct argument_of;
template <class C, class A>
struct argument_of<void (C::*)(A)> {
  using type = A;
};
template <class C, class A>
struct argument_of<void (C::*)(A) noexcept> {
  using type = A;
};

/// `engine.set_stream(stream)`, the void pointer cast to the engine's stream type (cudaStream_t
/// for the CUDA engine), without naming that type here.
template <class Engine>
void set_engine_stream(Engine& engine, void* stream) {
  using stream_type = typename argument_of<decltype(&Engine::set_stream)>::type;
  engine.set_stream(static_cast<stream_type>(stream));
}

/// Whether `Cache` has a `snapshot(seq, queries, softmax_scale)` (its selector's cache members:
/// select::snapkv's).
template <class Cache, class = void>
struct takes_snapshot : std::false_type {};
template <class Cache>
struct takes_snapshot<Cache, std::void_t<decltype(std::declval<Cache&>().snapshot(
                                 sequence_id{}, std::declval<tensor_view<const float, 3>>(), 0.0f))>> : std::true_type {};

}  // namespace detail

/// One attention layer's cache of any type, behind virtual calls: each operation is one indirect
/// call to the typed cache's own (`layer_cache_of<Cache>`), with the same contract, errors and
/// all-or-nothing guarantee as `kvmosaic::cache`'s. Views are `tensor_ref`s: host memory on
/// backend::host, device memory on backend::cuda (`on_device()`), except `read`'s (host memory
/// on every backend) and token ids (host memory).
class layer_cache {
 public:
  virtual ~layer_cache() = default;
  layer_cache() = default;
  layer_cache(const layer_cache&) = delete;
  layer_cache& operator=(const layer_cache&) = delete;

  /// `cache::describe()`: "format/selector/compactor" with parameters.
  virtual std::string describe() const = 0;
  virtual const cache_config& config() const = 0;
  /// True on backend::cuda: k, v, q and out of prefill, append and attend are device memory.
  virtual bool on_device() const = 0;
  /// The CUDA stream (a cudaStream_t) every later operation is enqueued on; ignored on the host.
  virtual void set_stream(void* cuda_stream) = 0;
  /// `selector_traits<Selector>::needs_token_ids`: prefill and append need token ids.
  virtual bool needs_token_ids() const = 0;

  virtual sequence_id add_sequence() = 0;
  virtual void remove_sequence(sequence_id seq) = 0;
  virtual sequence_id fork_sequence(sequence_id seq) = 0;

  /// `cache::prefill`: k, v [tokens][num_kv_heads][head_dim], both of one dtype. `token_ids` are
  /// ignored unless `needs_token_ids()`, which makes them required (one per token).
  virtual void prefill(sequence_id seq, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids) = 0;
  /// `cache::append`: k, v [batch][num_kv_heads][head_dim], row b for seqs[b], both of one dtype;
  /// token ids as `prefill` (one per sequence).
  virtual void append(span<const sequence_id> seqs, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids) = 0;
  /// `cache::attend` (plan, then run): q, out [batch][num_q_heads][head_dim], each of any of the
  /// three dtypes.
  virtual void attend(span<const sequence_id> seqs, tensor_ref<3> q, tensor_ref<3> out, const attend_params& params = {}) = 0;
  /// `cache::plan`: the host half of a decode step over `seqs` (attend = plan, then run).
  virtual void plan(span<const sequence_id> seqs, const attend_params& params = {}) = 0;
  /// `cache::run`: the planned step. q, out as `attend`'s; `lse` ([batch][num_q_heads], f32;
  /// extent 0: not written) each head's log-sum-exp. On backend::cuda: capturable in a CUDA graph.
  virtual void run(tensor_ref<3> q, tensor_ref<3> out, tensor_ref<2> lse = {}) = 0;
  /// `cache::reserve_step`: step buffers for batches up to `batch` of up to `max_tokens` tokens.
  virtual void reserve_step(std::int32_t batch, std::int64_t max_tokens) = 0;
  /// `cache::read`: k, v [stored_tokens(seq)][num_kv_heads][head_dim] in host memory on every
  /// backend, both of one dtype.
  virtual void read(sequence_id seq, tensor_ref<3> k, tensor_ref<3> v) const = 0;
  /// `cache::window_votes`: queries [W][num_q_heads][head_dim] in host memory on every backend
  /// (any of the three dtypes); [length - W][num_kv_heads] by position.
  virtual std::vector<double> window_votes(sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f,
                                           group_combine combine = group_combine::sum) = 0;
  /// `cache::snapshot` of a layer whose selector takes one (select::snapkv), queries as
  /// `window_votes`': the tokens evicted. Any other layer: `invalid_argument`, nothing changed.
  virtual std::int64_t snapshot(sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f) = 0;

  virtual std::int64_t length(sequence_id seq) const = 0;
  virtual std::int64_t stored_tokens(sequence_id seq) const = 0;
  virtual memory_stats memory() const = 0;
};

/// The adapter: a `layer_cache` that owns a `Cache` (any `kvmosaic::cache<...>`, built in place
/// from the constructor's arguments) and forwards every call to it, the `tensor_ref`s turned into
/// typed views by their dtype. `get()` gives the typed cache back (for what `layer_cache` does not
/// carry: set_key_weights, evict, compact, positions, selection statistics, the engine). On
/// backend::cuda this compiles only where the cache's engine is complete (a `.cu` file with
/// <kvmosaic/kvmosaic.cuh>).
template <class Cache>
class layer_cache_of final : public layer_cache {
  using backend_type = typename Cache::backend_type;
  using selector_type = typename Cache::selector_type;
  static constexpr bool device_backend = !std::is_same<backend_type, backend::host>::value;
  /// select::per_kv_head: the heads hold different tokens (read, window_votes and stored_tokens
  /// differ; `get()` has them per head).
  static constexpr bool per_head = detail::is_per_kv_head<selector_type>::value;
  static constexpr bool ids_needed = selector_traits<selector_type>::needs_token_ids;

 public:
  /// Builds the cache: `Cache(cache_args...)`, e.g. (config), (config, format, selector).
  template <class... Args, class = std::enable_if_t<std::is_constructible<Cache, Args&&...>::value>>
  explicit layer_cache_of(Args&&... cache_args) : cache_(std::forward<Args>(cache_args)...) {}

  Cache& get() noexcept { return cache_; }
  const Cache& get() const noexcept { return cache_; }

  std::string describe() const override { return cache_.describe(); }
  const cache_config& config() const override { return cache_.config(); }
  bool on_device() const override { return device_backend; }
  void set_stream(void* cuda_stream) override {
    if constexpr (device_backend) detail::set_engine_stream(cache_.engine(), cuda_stream);
    else (void)cuda_stream;
  }
  bool needs_token_ids() const override { return ids_needed; }

  sequence_id add_sequence() override { return cache_.add_sequence(); }
  void remove_sequence(sequence_id seq) override { cache_.remove_sequence(seq); }
  sequence_id fork_sequence(sequence_id seq) override { return cache_.fork_sequence(seq); }

  void prefill(sequence_id seq, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids) override {
    const char* where = "layer_cache::prefill";
    same_type(where, k, v);
    detail::with_io_type(k.type, where, "k.type", [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (ids_needed) {
        require_ids(where, token_ids, k.extents[0], "k.extent(0) (one id per token)");
        cache_.prefill(seq, k.as<const T>(), v.as<const T>(), token_ids);
      } else {
        (void)token_ids;
        cache_.prefill(seq, k.as<const T>(), v.as<const T>());
      }
    });
  }

  void append(span<const sequence_id> seqs, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids) override {
    const char* where = "layer_cache::append";
    same_type(where, k, v);
    detail::with_io_type(k.type, where, "k.type", [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (ids_needed) {
        require_ids(where, token_ids, seqs.size(), "seqs.size() (one id per sequence)");
        cache_.append(seqs, k.as<const T>(), v.as<const T>(), token_ids);
      } else {
        (void)token_ids;
        cache_.append(seqs, k.as<const T>(), v.as<const T>());
      }
    });
  }

  void attend(span<const sequence_id> seqs, tensor_ref<3> q, tensor_ref<3> out, const attend_params& params = {}) override {
    const char* where = "layer_cache::attend";
    detail::with_io_type(q.type, where, "q.type", [&](auto q_tag) {
      using Q = typename decltype(q_tag)::type;
      detail::with_io_type(out.type, where, "out.type", [&](auto out_tag) {
        using O = typename decltype(out_tag)::type;
        cache_.attend(seqs, q.as<const Q>(), out.as<O>(), params);
      });
    });
  }

  void plan(span<const sequence_id> seqs, const attend_params& params = {}) override { cache_.plan(seqs, params); }

  void run(tensor_ref<3> q, tensor_ref<3> out, tensor_ref<2> lse = {}) override {
    const char* where = "layer_cache::run";
    detail::require(lse.type == dtype::f32, where, "lse.type", to_string(lse.type), "f32");
    detail::with_io_type(q.type, where, "q.type", [&](auto q_tag) {
      using Q = typename decltype(q_tag)::type;
      detail::with_io_type(out.type, where, "out.type", [&](auto out_tag) {
        using O = typename decltype(out_tag)::type;
        cache_.run(q.as<const Q>(), out.as<O>(), lse.as<float>());
      });
    });
  }

  void reserve_step(std::int32_t batch, std::int64_t max_tokens) override { cache_.reserve_step(batch, max_tokens); }

  void read(sequence_id seq, tensor_ref<3> k, tensor_ref<3> v) const override {
    const char* where = "layer_cache::read";
    reject_per_head(where);
    same_type(where, k, v);
    detail::with_io_type(k.type, where, "k.type", [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (!per_head) cache_.read(seq, k.as<T>(), v.as<T>());
    });
  }

  std::vector<double> window_votes(sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f,
                                   group_combine combine = group_combine::sum) override {
    reject_per_head("layer_cache::window_votes");
    return with_queries("layer_cache::window_votes", queries, [&](const auto& q) {
      if constexpr (per_head) {
        (void)q, (void)seq, (void)softmax_scale, (void)combine;
        return std::vector<double>{};
      } else {
        return cache_.window_votes(seq, q, softmax_scale, combine);
      }
    });
  }

  std::int64_t snapshot(sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f) override {
    const char* where = "layer_cache::snapshot";
    if constexpr (detail::takes_snapshot<Cache>::value) {
      return with_queries(where, queries, [&](const auto& q) { return cache_.snapshot(seq, q, softmax_scale); });
    } else {
      (void)seq, (void)queries, (void)softmax_scale;
      detail::require(false, where, "the layer's selector", selector_traits<selector_type>::name,
                      "a selector that takes a snapshot (select::snapkv)");
      return 0;
    }
  }

  std::int64_t length(sequence_id seq) const override { return cache_.length(seq); }
  /// select::per_kv_head: the mean over the heads of the slots each holds.
  std::int64_t stored_tokens(sequence_id seq) const override {
    if constexpr (per_head) {
      std::int64_t total = 0;
      for (int h = 0; h < cache_.config().num_kv_heads; ++h) total += cache_.stored_tokens(seq, h);
      return total / cache_.config().num_kv_heads;
    } else {
      return cache_.stored_tokens(seq);
    }
  }
  memory_stats memory() const override { return cache_.memory(); }

 private:
  static void reject_per_head(const char* where) {
    if constexpr (per_head)
      detail::require(false, where, "the layer's selector", "select::per_kv_head (its heads hold different tokens)",
                      "a selector that keeps the same tokens in every head (read each head through get())");
    else
      (void)where;
  }
  /// f(queries as a typed view of host memory).
  template <class F>
  static auto with_queries(const char* where, const tensor_ref<3>& queries, F&& f) {
    using result = decltype(f(queries.as<const float>()));
    result out{};
    detail::with_io_type(queries.type, where, "queries.type", [&](auto tag) {
      using Q = typename decltype(tag)::type;
      out = f(queries.as<const Q>());
    });
    return out;
  }
  static void same_type(const char* where, const tensor_ref<3>& k, const tensor_ref<3>& v) {
    detail::require(v.type == k.type, where, "v.type", to_string(v.type), "the dtype of k");
  }
  static void require_ids(const char* where, span<const std::int32_t> ids, std::int64_t expected, const char* allowed) {
    detail::require(ids.size() == expected, where, "token_ids.size()", ids.size(),
                    ("this layer's selector needs token ids: " + std::string(allowed)).c_str());
  }

  Cache cache_;
};

/// A `layer_cache` owning a `Cache(cache_args...)`.
template <class Cache, class... Args>
std::unique_ptr<layer_cache> make_layer(Args&&... cache_args) {
  return std::make_unique<layer_cache_of<Cache>>(std::forward<Args>(cache_args)...);
}

/// All attention layers of a model, each a `layer_cache` of its own type, with one sequence id
/// space. A model sequence id names one sequence of every layer (`layer_sequence` gives each
/// layer's own id); ids are handed out by `add_sequence` and `fork_sequence`, never reused, and
/// rejected with `invalid_argument` once removed. Adding, forking and removing fan out to every
/// layer, all or nothing: a layer that fails (e.g. `capacity_error`: its max_sequences are in use)
/// has the layers before it undo their part (the new sequence removed) and the call rethrows,
/// leaving every layer holding what it held. Per-layer calls (prefill, append, attend, read)
/// translate the ids and forward to that layer, with its contract; the layers are driven one at a
/// time, as a model's forward pass does, so between a step's layers their lengths differ.
/// Add, fork and remove sequences through the model only: a sequence a layer gets or loses
/// directly is unknown to the model.
class model_cache {
 public:
  /// Takes the layers (>= 1, none null). Throws `invalid_argument` otherwise.
  explicit model_cache(std::vector<std::unique_ptr<layer_cache>> layers) : layers_(std::move(layers)) {
    detail::require(!layers_.empty(), "model_cache", "layers.size()", layers_.size(), ">= 1 layer");
    for (std::size_t i = 0; i < layers_.size(); ++i)
      detail::require(layers_[i] != nullptr, "model_cache", "layers[i]", "null (i = " + std::to_string(i) + ")",
                      "a layer_cache (make_layer<Cache>(...))");
    detail::require(layers_.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()), "model_cache", "layers.size()",
                    layers_.size(), "at most INT_MAX layers");
  }

  int num_layers() const noexcept { return static_cast<int>(layers_.size()); }
  /// Layer `i` (0 to num_layers() - 1), or `invalid_argument`.
  layer_cache& layer(int i) { return *layers_[index(i, "model_cache::layer")]; }
  const layer_cache& layer(int i) const { return *layers_[index(i, "model_cache::layer")]; }

  /// A new empty sequence in every layer. All or nothing (see the class comment).
  sequence_id add_sequence() {
    return fan_out("model_cache::add_sequence", [](layer_cache& layer, int) { return layer.add_sequence(); });
  }
  /// A fork of `seq` in every layer (each layer shares its full pages, `cache::fork_sequence`).
  /// All or nothing.
  sequence_id fork_sequence(sequence_id seq) {
    const std::vector<sequence_id>& parent = ids_of(seq, "model_cache::fork_sequence");
    return fan_out("model_cache::fork_sequence",
                   [&parent](layer_cache& layer, int i) { return layer.fork_sequence(parent[static_cast<std::size_t>(i)]); });
  }
  /// Ends `seq` in every layer; its id is invalid from now on.
  void remove_sequence(sequence_id seq) {
    const auto it = find(seq, "model_cache::remove_sequence");
    for (std::size_t i = 0; i < layers_.size(); ++i) layers_[i]->remove_sequence(it->second[i]);
    sequences_.erase(it);
  }
  /// True while `seq` is a live id of this model.
  bool contains(sequence_id seq) const { return sequences_.count(seq) > 0; }
  /// Live sequences.
  std::int64_t num_sequences() const noexcept { return static_cast<std::int64_t>(sequences_.size()); }
  /// The id layer `layer` knows model sequence `seq` by.
  sequence_id layer_sequence(int layer, sequence_id seq) const {
    const char* where = "model_cache::layer_sequence";
    return ids_of(seq, where)[index(layer, where)];
  }

  /// `layer_cache::prefill` of layer `layer`, with a model sequence id.
  void prefill(int layer, sequence_id seq, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids = {}) {
    const char* where = "model_cache::prefill";
    const std::size_t i = index(layer, where);
    layers_[i]->prefill(ids_of(seq, where)[i], k, v, token_ids);
  }
  /// `layer_cache::append` of layer `layer`, with model sequence ids.
  void append(int layer, span<const sequence_id> seqs, tensor_ref<3> k, tensor_ref<3> v, span<const std::int32_t> token_ids = {}) {
    const char* where = "model_cache::append";
    const std::size_t i = index(layer, where);
    const std::vector<sequence_id> ids = layer_ids(i, seqs, where);
    layers_[i]->append(span<const sequence_id>(ids.data(), seqs.size()), k, v, token_ids);
  }
  /// `layer_cache::attend` of layer `layer`, with model sequence ids.
  void attend(int layer, span<const sequence_id> seqs, tensor_ref<3> q, tensor_ref<3> out, const attend_params& params = {}) {
    const char* where = "model_cache::attend";
    const std::size_t i = index(layer, where);
    const std::vector<sequence_id> ids = layer_ids(i, seqs, where);
    layers_[i]->attend(span<const sequence_id>(ids.data(), seqs.size()), q, out, params);
  }
  /// `layer_cache::plan` of layer `layer`, with model sequence ids; `run(layer, ...)` runs it.
  void plan(int layer, span<const sequence_id> seqs, const attend_params& params = {}) {
    const char* where = "model_cache::plan";
    const std::size_t i = index(layer, where);
    const std::vector<sequence_id> ids = layer_ids(i, seqs, where);
    layers_[i]->plan(span<const sequence_id>(ids.data(), seqs.size()), params);
  }
  /// `layer_cache::run` of layer `layer`: its last plan's step.
  void run(int layer, tensor_ref<3> q, tensor_ref<3> out, tensor_ref<2> lse = {}) {
    layers_[index(layer, "model_cache::run")]->run(q, out, lse);
  }
  /// `layer_cache::reserve_step` of every layer.
  void reserve_step(std::int32_t batch, std::int64_t max_tokens) {
    for (const auto& layer : layers_) layer->reserve_step(batch, max_tokens);
  }
  /// `layer_cache::read` of layer `layer` (host memory), with a model sequence id.
  void read(int layer, sequence_id seq, tensor_ref<3> k, tensor_ref<3> v) const {
    const char* where = "model_cache::read";
    const std::size_t i = index(layer, where);
    layers_[i]->read(ids_of(seq, where)[i], k, v);
  }
  /// `layer_cache::snapshot` of layer `layer` (queries in host memory), with a model sequence id:
  /// each layer takes its own window's queries, so a model's prefill calls it once per layer.
  std::int64_t snapshot(int layer, sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f) {
    const char* where = "model_cache::snapshot";
    const std::size_t i = index(layer, where);
    return layers_[i]->snapshot(ids_of(seq, where)[i], queries, softmax_scale);
  }

  /// Tokens given to layer 0 for `seq` (later layers may be behind within a step).
  std::int64_t length(sequence_id seq) const { return layers_[0]->length(ids_of(seq, "model_cache::length")[0]); }

  /// Every layer's `memory()`, summed field by field: bytes, tokens (a token counts once per
  /// layer, so `bytes_per_token()` is per layer), pages_used and pages_free (over the layers'
  /// pools). Cost: O(layers x max_sequences).
  memory_stats memory() const {
    memory_stats total;
    for (const auto& layer : layers_) {
      const memory_stats m = layer->memory();
      total.tokens += m.tokens;
      total.stored_bytes += m.stored_bytes;
      total.dense_bytes += m.dense_bytes;
      total.pages_used += m.pages_used;
      total.pages_free += m.pages_free;
    }
    return total;
  }

  /// Sets every layer's CUDA stream (a cudaStream_t; host layers ignore it).
  void set_stream(void* cuda_stream) {
    for (const auto& layer : layers_) layer->set_stream(cuda_stream);
  }

 private:
  using id_map = std::unordered_map<sequence_id, std::vector<sequence_id>>;

  std::size_t index(int layer, const char* where) const {
    detail::require(layer >= 0 && layer < num_layers(), where, "layer", layer, "0 to num_layers() - 1");
    return static_cast<std::size_t>(layer);
  }
  id_map::const_iterator find(sequence_id seq, const char* where) const {
    const auto it = sequences_.find(seq);
    detail::require(it != sequences_.end(), where, "seq", seq,
                    "an id returned by model_cache::add_sequence or fork_sequence and not removed");
    return it;
  }
  const std::vector<sequence_id>& ids_of(sequence_id seq, const char* where) const { return find(seq, where)->second; }

  /// The layer's ids of `seqs` (host memory).
  std::vector<sequence_id> layer_ids(std::size_t layer, span<const sequence_id> seqs, const char* where) const {
    detail::require(seqs.size() == 0 || seqs.data() != nullptr, where, "seqs", "null",
                    "a span of model sequence ids in host memory");
    std::vector<sequence_id> ids(static_cast<std::size_t>(seqs.size()));
    for (std::int64_t b = 0; b < seqs.size(); ++b) ids[static_cast<std::size_t>(b)] = ids_of(seqs(b), where)[layer];
    return ids;
  }

  /// Runs make(layer, i) on every layer for a new sequence; on a failure removes what the layers
  /// before made and rethrows. Returns the new model id.
  template <class Make>
  sequence_id fan_out(const char* where, Make&& make) {
    if (next_id_ == std::numeric_limits<sequence_id>::max())
      throw capacity_error("model_cache", std::string("kvmosaic: ") + where +
                                              ": model sequence ids are spent (2^31 - 1 handed out); allowed: "
                                              "fewer adds and forks over a model_cache's life");
    std::vector<sequence_id> ids;
    ids.reserve(layers_.size());  // may throw: nothing made yet
    try {
      for (std::size_t i = 0; i < layers_.size(); ++i) ids.push_back(make(*layers_[i], static_cast<int>(i)));
      sequences_.emplace(next_id_, ids);
    } catch (...) {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        try {
          layers_[i]->remove_sequence(ids[i]);
        } catch (...) {  // a valid id's removal does not fail; the first error is the one to report
        }
      }
      throw;
    }
    return next_id_++;
  }

  std::vector<std::unique_ptr<layer_cache>> layers_;
  id_map sequences_;          ///< model id -> each layer's id
  sequence_id next_id_ = 0;   ///< the next model id handed out
};

}  // namespace kvmosaic
