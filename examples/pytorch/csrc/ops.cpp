// SPDX-License-Identifier: Apache-2.0
//
// PyTorch bindings of kvmosaic: a model's KV cache (`kvmosaic::model_cache`, one type-erased
// cache per layer) as the TorchScript class `torch.classes.kvmosaic.ModelCache`, and the decode
// step as the operator `torch.ops.kvmosaic.attend`. Layers live on the CPU (backend::host) or on
// the current CUDA device (backend::cuda, when the extension is built with CUDA); tensors are
// passed to the library as views, in the model's dtype and strides, without copies, and CUDA work
// is enqueued on the current torch stream. Library errors surface as Python ValueError (bad
// arguments) or RuntimeError (capacity, CUDA).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#ifdef KVMOSAIC_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <memory>
#include <string>
#include <vector>

#include "layer_factory.hpp"

namespace kvmosaic_torch {
namespace {

// Errors are raised with messages built as std::string, never through the stream formatting of
// torch's checking macros (c10::str): with the GPU machine's g++ 13, stream insertion compiled
// into the extension crashed inside that machine's PyTorch (docs/pytorch.md, "Known issues").

/// Raises Python's ValueError with `message`.
[[noreturn]] void value_error(const std::string& message) { C10_THROW_ERROR(ValueError, message); }
/// Raises Python's ValueError with `message` unless `ok`.
void check_value(bool ok, const std::string& message) {
  if (!ok) value_error(message);
}
std::string text(std::int64_t value) { return std::to_string(value); }
std::string shape_text(const at::Tensor& t) {
  std::string out = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + text(t.size(d));
  return out + "]";
}

/// Runs `body`, turning kvmosaic's exceptions into torch's (ValueError for bad arguments).
template <class Body>
auto guarded(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const kvmosaic::invalid_argument& e) {
    value_error(e.what());
  } catch (const kvmosaic::error& e) {
    C10_THROW_ERROR(Error, std::string(e.what()));
  }
}

kvmosaic::dtype dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kvmosaic::dtype::f32;
    case at::kHalf: return kvmosaic::dtype::f16;
    case at::kBFloat16: return kvmosaic::dtype::bf16;
    default:
      value_error(std::string("kvmosaic: ") + name + " has dtype " + c10::toString(t.scalar_type()) +
                  "; allowed: float32, float16, bfloat16");
  }
}

std::vector<std::int32_t> to_ids(const c10::IntArrayRef& values) { return {values.begin(), values.end()}; }

}  // namespace

/// `torch.classes.kvmosaic.ModelCache(num_layers, num_kv_heads, group_size, head_dim, storage,
/// page_size, max_pages, max_sequences, device, layer_specs)`: a model's KV cache; `layer_specs`
/// holds one spec (every layer) or one per layer (layer_spec.hpp). `max_pages` is per layer.
class ModelCache : public torch::CustomClassHolder {
 public:
  ModelCache(std::int64_t num_layers, std::int64_t num_kv_heads, std::int64_t group_size, std::int64_t head_dim,
             const std::string& storage, std::int64_t page_size, std::int64_t max_pages, std::int64_t max_sequences,
             const std::string& device, const std::vector<std::string>& layer_specs)
      : device_(device) {
    check_value(num_layers >= 1, "kvmosaic: num_layers = " + text(num_layers) + "; allowed: >= 1");
    check_value(layer_specs.size() == 1 || static_cast<std::int64_t>(layer_specs.size()) == num_layers,
                "kvmosaic: layer_specs has " + text(static_cast<std::int64_t>(layer_specs.size())) +
                    " entries; allowed: 1 (every layer) or num_layers (" + text(num_layers) + ")");
    check_value(storage == "bf16" || storage == "f16", "kvmosaic: storage = " + storage + "; allowed: bf16 or f16");
    check_value(device_.is_cpu() || device_.is_cuda(), "kvmosaic: device = " + device + "; allowed: cpu or cuda");
#ifndef KVMOSAIC_TORCH_CUDA
    check_value(device_.is_cpu(),
                "kvmosaic: device = " + device + "; this build of the extension has no CUDA layers (allowed: cpu)");
#else
    if (device_.is_cuda() && !device_.has_index()) device_ = at::Device(at::kCUDA, at::cuda::current_device());
#endif
    kvmosaic::cache_config config;
    config.num_kv_heads = static_cast<int>(num_kv_heads);
    config.group_size = static_cast<int>(group_size);
    config.head_dim = static_cast<int>(head_dim);
    config.page_size = static_cast<int>(page_size);
    config.storage = storage == "bf16" ? kvmosaic::dtype::bf16 : kvmosaic::dtype::f16;
    config.max_pages = static_cast<std::int32_t>(max_pages);
    config.max_sequences = static_cast<std::int32_t>(max_sequences);
    guarded([&] {
      std::vector<std::unique_ptr<kvmosaic::layer_cache>> layers;
      for (std::int64_t i = 0; i < num_layers; ++i) {
        const layer_spec spec = parse_layer_spec(layer_specs[layer_specs.size() == 1 ? 0 : static_cast<std::size_t>(i)]);
        layers.push_back(device_.is_cpu() ? make_host_layer(spec, config) : make_on_device(spec, config));
      }
      model_ = std::make_unique<kvmosaic::model_cache>(std::move(layers));
      return 0;
    });
  }

  std::int64_t num_layers() const { return model_->num_layers(); }
  std::string device() const { return device_.str(); }
  std::string describe(std::int64_t layer) const {
    return guarded([&] { return model_->layer(checked_layer(layer)).describe(); });
  }

  std::int64_t add_sequence() { return guarded([&] { return static_cast<std::int64_t>(model_->add_sequence()); }); }
  void remove_sequence(std::int64_t seq) {
    guarded([&] { return model_->remove_sequence(static_cast<kvmosaic::sequence_id>(seq)), 0; });
  }
  std::int64_t fork_sequence(std::int64_t seq) {
    return guarded([&] { return static_cast<std::int64_t>(model_->fork_sequence(static_cast<kvmosaic::sequence_id>(seq))); });
  }
  std::int64_t length(std::int64_t seq) const {
    return guarded([&] { return model_->length(static_cast<kvmosaic::sequence_id>(seq)); });
  }
  std::int64_t stored_tokens(std::int64_t layer, std::int64_t seq) const {
    return guarded([&] {
      const int l = checked_layer(layer);
      return model_->layer(l).stored_tokens(model_->layer_sequence(l, static_cast<kvmosaic::sequence_id>(seq)));
    });
  }

  /// k, v: [tokens][num_kv_heads][head_dim]; token_ids: the tokens' ids (selectors that cut the
  /// stream at boundary tokens need them), any integer tensor, or None.
  void prefill(std::int64_t layer, std::int64_t seq, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& token_ids) {
    const std::vector<std::int32_t> ids = ids_of(token_ids);
    on_stream([&] {
      const kvmosaic::tensor_ref<3> k_rows = ref(k, "k"), v_rows = ref(v, "v");  // checked in argument order
      model_->prefill(checked_layer(layer), static_cast<kvmosaic::sequence_id>(seq), k_rows, v_rows,
                      kvmosaic::span<const std::int32_t>(ids.data(), static_cast<std::int64_t>(ids.size())));
    });
  }

  /// One new token per sequence: k, v [batch][num_kv_heads][head_dim].
  void append(std::int64_t layer, c10::IntArrayRef seqs, const at::Tensor& k, const at::Tensor& v,
              const c10::optional<at::Tensor>& token_ids) {
    const std::vector<std::int32_t> batch = to_ids(seqs);
    const std::vector<std::int32_t> ids = ids_of(token_ids);
    on_stream([&] {
      const kvmosaic::tensor_ref<3> k_rows = ref(k, "k"), v_rows = ref(v, "v");
      model_->append(checked_layer(layer), span_of(batch), k_rows, v_rows,
                     kvmosaic::span<const std::int32_t>(ids.data(), static_cast<std::int64_t>(ids.size())));
    });
  }

  /// out[b] = attention of q[b] ([num_q_heads][head_dim]) over the tokens of seqs[b] the layer's
  /// selector reads. scale 0: 1/sqrt(head_dim). Writes `out` (same shape as q).
  void attend_into(std::int64_t layer, c10::IntArrayRef seqs, const at::Tensor& q, const at::Tensor& out, double scale) {
    const std::vector<std::int32_t> batch = to_ids(seqs);
    kvmosaic::attend_params params;
    params.softmax_scale = static_cast<float>(scale);
    on_stream([&] {
      const kvmosaic::tensor_ref<3> queries = ref(q, "q"), outputs = ref(out, "out");
      model_->attend(checked_layer(layer), span_of(batch), queries, outputs, params);
    });
  }
  at::Tensor attend(std::int64_t layer, c10::IntArrayRef seqs, const at::Tensor& q, double scale) {
    at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
    attend_into(layer, seqs, q, out, scale);
    return out;
  }

  /// The stored K and V of a sequence, decoded as attention reads them: two CPU float32 tensors
  /// [stored_tokens][num_kv_heads][head_dim] (slot order; see kvmosaic::cache::read).
  std::vector<at::Tensor> read(std::int64_t layer, std::int64_t seq) const {
    return guarded([&] {
      const int l = checked_layer(layer);
      const kvmosaic::cache_config& c = model_->layer(l).config();
      const std::int64_t rows = model_->layer(l).stored_tokens(model_->layer_sequence(l, static_cast<kvmosaic::sequence_id>(seq)));
      at::Tensor k = at::empty({rows, c.num_kv_heads, c.head_dim}, at::kFloat);
      at::Tensor v = at::empty_like(k);
      const kvmosaic::tensor_ref<3> k_rows = ref(k, "k", true), v_rows = ref(v, "v", true);
      model_->read(l, static_cast<kvmosaic::sequence_id>(seq), k_rows, v_rows);
      return std::vector<at::Tensor>{k, v};
    });
  }

  /// select::snapkv's snapshot of one layer's sequence (kvmosaic::cache::snapshot): `queries`
  /// [window][num_q_heads][head_dim], the prompt's last queries (after RoPE), any supported dtype,
  /// on the CPU whatever the layers' device; scale 0: 1/sqrt(head_dim). Evicts all but the budget
  /// and compacts; returns the tokens evicted. A layer of another selector refuses it.
  std::int64_t snapshot(std::int64_t layer, std::int64_t seq, const at::Tensor& queries, double scale) {
    std::int64_t evicted = 0;
    on_stream([&] {
      const kvmosaic::tensor_ref<3> q = ref(queries, "queries", true);
      evicted = model_->snapshot(checked_layer(layer), static_cast<kvmosaic::sequence_id>(seq), q, static_cast<float>(scale));
    });
    return evicted;
  }

  /// Bytes and pages of every layer together (`layer` < 0) or of one layer.
  c10::Dict<std::string, std::int64_t> memory(std::int64_t layer) const {
    return guarded([&] {
      const kvmosaic::memory_stats m = layer < 0 ? model_->memory() : model_->layer(checked_layer(layer)).memory();
      c10::Dict<std::string, std::int64_t> d;
      d.insert("tokens", m.tokens);
      d.insert("stored_bytes", m.stored_bytes);
      d.insert("dense_bytes", m.dense_bytes);
      d.insert("pages_used", m.pages_used);
      d.insert("pages_free", m.pages_free);
      return d;
    });
  }

 private:
  static std::unique_ptr<kvmosaic::layer_cache> make_on_device(const layer_spec& spec, const kvmosaic::cache_config& config) {
#ifdef KVMOSAIC_TORCH_CUDA
    return make_cuda_layer(spec, config);
#else
    (void)spec;
    (void)config;
    return nullptr;  // unreachable: the constructor rejects CUDA without CUDA layers
#endif
  }

  int checked_layer(std::int64_t layer) const {
    check_value(layer >= 0 && layer < model_->num_layers(),
                "kvmosaic: layer = " + text(layer) + "; allowed: 0 to " + text(model_->num_layers() - 1));
    return static_cast<int>(layer);
  }

  static kvmosaic::span<const kvmosaic::sequence_id> span_of(const std::vector<std::int32_t>& v) {
    return kvmosaic::span<const kvmosaic::sequence_id>(v.data(), static_cast<std::int64_t>(v.size()));
  }

  static std::vector<std::int32_t> ids_of(const c10::optional<at::Tensor>& token_ids) {
    if (!token_ids.has_value() || !token_ids->defined()) return {};
    check_value(!at::isFloatingType(token_ids->scalar_type()), std::string("kvmosaic: token_ids has dtype ") +
                                                                   c10::toString(token_ids->scalar_type()) +
                                                                   "; allowed: an integer dtype");
    const at::Tensor ids = token_ids->reshape({-1}).to(at::kCPU, at::kInt).contiguous();
    return {ids.data_ptr<std::int32_t>(), ids.data_ptr<std::int32_t>() + ids.numel()};
  }

  /// A tensor as a view for the library: checks that it is there, 3-D, of a supported dtype and
  /// on the layers' device (`host`: on the CPU whatever the layers' device).
  kvmosaic::tensor_ref<3> ref(const at::Tensor& t, const char* name, bool host = false) const {
    check_value(t.defined(), std::string("kvmosaic: ") + name + " is missing (an undefined tensor)");
    check_value(t.dim() == 3, std::string("kvmosaic: ") + name + " has shape " + shape_text(t) +
                                  "; allowed: 3 dimensions ([tokens or batch][heads][head_dim])");
    const at::Device expected = host ? at::Device(at::kCPU) : device_;
    check_value(t.device() == expected, std::string("kvmosaic: ") + name + " is on " + t.device().str() +
                                            "; this cache's layers are on " + expected.str());
    kvmosaic::tensor_ref<3> r;
    r.data = t.data_ptr();
    r.type = dtype_of(t, name);
    for (int d = 0; d < 3; ++d) {
      r.extents[d] = t.size(d);
      r.strides[d] = t.stride(d);
    }
    return r;
  }

  /// Runs a library call on the current torch stream of the layers' device.
  template <class Body>
  void on_stream(Body&& body) {
#ifdef KVMOSAIC_TORCH_CUDA
    if (device_.is_cuda()) {
      const c10::cuda::CUDAGuard device_guard(device_);
      model_->set_stream(at::cuda::getCurrentCUDAStream(device_.index()).stream());
      guarded([&] { return body(), 0; });
      return;
    }
#endif
    guarded([&] { return body(), 0; });
  }

  at::Device device_;
  std::unique_ptr<kvmosaic::model_cache> model_;
};

namespace {

at::Tensor attend_op(const c10::intrusive_ptr<ModelCache>& cache, std::int64_t layer, c10::IntArrayRef seqs,
                     const at::Tensor& q, double scale) {
  return cache->attend(layer, seqs, q, scale);
}

void append_op(const c10::intrusive_ptr<ModelCache>& cache, std::int64_t layer, c10::IntArrayRef seqs,
               const at::Tensor& k, const at::Tensor& v) {
  cache->append(layer, seqs, k, v, c10::nullopt);
}

}  // namespace
}  // namespace kvmosaic_torch

TORCH_LIBRARY(kvmosaic, m) {
  using kvmosaic_torch::ModelCache;
  m.class_<ModelCache>("ModelCache")
      .def(torch::init<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::string, std::int64_t, std::int64_t,
                       std::int64_t, std::string, std::vector<std::string>>())
      .def("num_layers", &ModelCache::num_layers)
      .def("device", &ModelCache::device)
      .def("describe", &ModelCache::describe)
      .def("add_sequence", &ModelCache::add_sequence)
      .def("remove_sequence", &ModelCache::remove_sequence)
      .def("fork_sequence", &ModelCache::fork_sequence)
      .def("length", &ModelCache::length)
      .def("stored_tokens", &ModelCache::stored_tokens)
      .def("prefill", &ModelCache::prefill)
      .def("append", &ModelCache::append)
      .def("attend", &ModelCache::attend)
      .def("attend_into", &ModelCache::attend_into)
      .def("read", &ModelCache::read)
      .def("snapshot", &ModelCache::snapshot)
      .def("memory", &ModelCache::memory);
  m.def("attend", &kvmosaic_torch::attend_op);
  m.def("append", &kvmosaic_torch::append_op);
}
