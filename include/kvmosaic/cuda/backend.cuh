// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CUDA backend: page and tail arenas in device memory, and the kernels of every cache
/// operation. `kvmosaic::cache<Format, Selector, Compactor, kvmosaic::backend::cuda>` uses it.
///
/// Pointers the cache passes to this backend (prefill/append rows, q, out) are device pointers
/// to contiguous arrays; operations are asynchronous on the engine's stream (`set_stream`), and the
/// caller synchronizes before reading results. A decode step is two pieces: `plan_step` (host:
/// the split plan and block tables, written to page-locked staging) and `launch_step` (one copy to
/// the device and two kernels, with a launch shape that depends only on the batch size), so
/// `launch_step` can be captured in a CUDA graph and replayed after each new `plan_step`.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/split_plan.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/detail/pull_from_host.cuh"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/kernel/chunk_bounds.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"
#include "kvmosaic/cuda/kernel/decode_bitmap.cuh"
#include "kvmosaic/cuda/kernel/decode_quant2.cuh"
#include "kvmosaic/cuda/kernel/encode_bitmap.cuh"
#include "kvmosaic/cuda/kernel/encode_quant2.cuh"
#include "kvmosaic/cuda/kernel/extend.cuh"
#include "kvmosaic/cuda/kernel/select_pages.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/bitmap_tiles.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/format/quant2.hpp"
#include "kvmosaic/host/backend.hpp"

namespace kvmosaic {
namespace backend {
/// Pages in device memory; prefill, append and attention run as CUDA kernels.
struct cuda {
  using policy_category = backend_tag;
  static constexpr const char* name = "cuda";
};
}  // namespace backend

namespace cuda {

namespace detail {

/// Calls f(T{}, head_dim constant, group constant): the one place where run-time shapes become
/// kernel template arguments (every supported combination is instantiated).
template <class F>
void dispatch_shape(dtype storage, int head_dim, int group_size, F&& f) {
  const auto by_group = [&](auto element, auto dim) {
    switch (group_size) {
      case 1: return f(element, dim, std::integral_constant<int, 1>{});
      case 2: return f(element, dim, std::integral_constant<int, 2>{});
      case 3: return f(element, dim, std::integral_constant<int, 3>{});
      case 4: return f(element, dim, std::integral_constant<int, 4>{});
      case 5: return f(element, dim, std::integral_constant<int, 5>{});
      case 6: return f(element, dim, std::integral_constant<int, 6>{});
      case 7: return f(element, dim, std::integral_constant<int, 7>{});
      case 8: return f(element, dim, std::integral_constant<int, 8>{});
    }
    kvmosaic::detail::require(false, "cuda::dispatch_shape", "group_size", group_size, limits::supported_group_sizes);
  };
  const auto by_dim = [&](auto element) {
    switch (head_dim) {
      case 64: return by_group(element, std::integral_constant<int, 64>{});
      case 128: return by_group(element, std::integral_constant<int, 128>{});
      case 256: return by_group(element, std::integral_constant<int, 256>{});
    }
    kvmosaic::detail::require(false, "cuda::dispatch_shape", "head_dim", head_dim, limits::supported_head_dims);
  };
  if (storage == dtype::f16) return by_dim(half{});
  return by_dim(bfloat16{});
}

/// Calls f(head_dim constant, partition constant) for a quant2 shape (Pi at most head_dim).
template <class F>
void dispatch_quant2(int head_dim, int partition, F&& f) {
  const auto by_partition = [&](auto dim) {
    switch (partition) {
      case 32: return f(dim, std::integral_constant<int, 32>{});
      case 64: return f(dim, std::integral_constant<int, 64>{});
      case 128:
        if constexpr (decltype(dim)::value >= 128) return f(dim, std::integral_constant<int, 128>{});
        break;
    }
    kvmosaic::detail::require(false, "cuda::dispatch_quant2", "format::quant2::partition", partition,
                              "32, 64 or 128, at most head_dim");
  };
  switch (head_dim) {
    case 64: return by_partition(std::integral_constant<int, 64>{});
    case 128: return by_partition(std::integral_constant<int, 128>{});
    case 256: return by_partition(std::integral_constant<int, 256>{});
  }
  kvmosaic::detail::require(false, "cuda::dispatch_quant2", "head_dim", head_dim, limits::supported_head_dims);
}

/// `bytes` of dynamic shared memory for a launch of `kernel`, opted in (past the default 48 KB)
/// right here, next to the launch. A kernel template that several translation units instantiate
/// may have one handle per unit, and which unit's copy of an inline engine function the linker
/// keeps is not ours to choose: an opt-in made in another function can land on another unit's
/// copy of the kernel (the GPU test binary, whose units all instantiate the engines, launched
/// with "invalid argument" that way). `static_bytes`: the kernel's own shared memory, which counts
/// towards the 48 KB. Cost: one cudaFuncSetAttribute per launch that needs it.
template <class Kernel>
int opted_in_shared(Kernel kernel, int bytes, int static_bytes = 0) {
  if (bytes + static_bytes > 48 * 1024)
    KVMOSAIC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return bytes;
}

/// Grid x for a grid-stride loop over `count` items.
inline unsigned grid_for(std::int64_t count, int threads) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((count + threads - 1) / threads, 1, 65535));
}

}  // namespace detail

/// Whether the CUDA backend has kernels for a format.
template <class Format>
struct has_kernels : std::false_type {};
template <>
struct has_kernels<format::dense> : std::true_type {};
template <>
struct has_kernels<format::bitmap_tiles> : std::true_type {};
template <>
struct has_kernels<format::quant2> : std::true_type {};

/// The CUDA engine of one format (`format::dense`, `format::bitmap_tiles` or `format::quant2`);
/// other formats fail to compile with a sentence rather than at run time.
///
/// Dense pages are written in place by the row kernels. Other formats' pages are encoded on the
/// device: the row kernels write the completed pages' dense rows to a scratch arena (at most
/// `encode_chunk_pages` pages at a time), and the format's encode kernel compresses them into
/// their pages.
template <class Format>
class engine {
  static_assert(has_kernels<Format>::value,
                "kvmosaic: the CUDA backend has kernels for format::dense, format::bitmap_tiles and format::quant2 "
                "only so far");
  using traits = format_traits<Format>;
  using dense_traits = format_traits<format::dense>;
  static constexpr bool encodes_pages = !std::is_same<Format, format::dense>::value;
  static constexpr bool is_bitmap = std::is_same<Format, format::bitmap_tiles>::value;
  static constexpr bool is_quant2 = std::is_same<Format, format::quant2>::value;
  /// Formats whose sm_90 kernel streams compressed page pairs through shared-memory stages.
  static constexpr bool streams_compressed_pages = is_bitmap || is_quant2;

 public:
  /// `bounds_block_tokens` > 0 keeps the key bounds of each block of that many tokens of every
  /// sealed page for `select::quest` (the page size, or a multiple of 8 dividing it: then the
  /// selection is token-granular and the split kernels read row masks). `chunks` > 0 keeps
  /// `select::sentence_chunks`' chunk bounds on the device (`add_chunks`): storage for the most
  /// chunks the pages and tails can hold (every chunk of the shortest length, chunks.shortest),
  /// and each sequence's open rows (up to chunks.longest).
  engine(const kvmosaic::detail::engine_shape& shape, const Format& format, int bounds_block_tokens = 0,
         kvmosaic::detail::chunk_limits chunks = {})
      : shape_(shape),
        format_(format),
        geometry_(shape, format),
        bounds_geometry_(shape, bounds_block_tokens),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        bounds_(static_cast<std::size_t>(shape.max_pages) * bounds_geometry_.page_bytes) {
    kvmosaic::detail::require(bounds_block_tokens == 0 || (bounds_block_tokens % 8 == 0 && shape.page_size % bounds_block_tokens == 0),
                              "cuda::engine", "select::quest::block_tokens", bounds_block_tokens,
                              "0, or a multiple of 8 that divides the page size");
    int device = 0;
    KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device));
    int major = 0;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    use_bulk_copy_ = major >= 9;
    supports_dependent_launch_ = dependent_launch_ = major >= 9;
    int opt_in = 0;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    max_dynamic_shared_ = opt_in - 4 * 1024;  // the selection kernels' static shared memory
    // Rows a TMA box reads past a tail's last token must hold finite values (they meet p = 0).
    KVMOSAIC_CUDA_CHECK(cudaMemset(pages_.data(), 0, pages_.size()));
    KVMOSAIC_CUDA_CHECK(cudaMemset(tails_.data(), 0, tails_.size()));
    const std::int64_t arena_rows = static_cast<std::int64_t>(std::max(shape.max_pages, shape.max_sequences)) * 2 *
                                    shape.num_kv_heads * shape.page_size;
    use_tma_ = use_bulk_copy_ &&
               (shape.page_size % 64 == 0 || 64 % shape.page_size == 0) && arena_rows < (std::int64_t{1} << 31);
    if (use_tma_) {
      page_rows_ = make_row_map(pages_.data(), static_cast<std::uint64_t>(shape.max_pages) * 2 * shape.num_kv_heads * shape.page_size);
      tail_rows_map_ =
          make_row_map(tails_.data(), static_cast<std::uint64_t>(shape.max_sequences) * 2 * shape.num_kv_heads * shape.page_size);
    }
    KVMOSAIC_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    if constexpr (is_quant2) {
      kvmosaic::detail::require(format.k_axis == format::key_axis::tokens, "cuda::engine", "format::quant2::k_axis",
                                "key_axis::head_dim",
                                "key_axis::tokens (the CUDA kernels read K partitioned per channel; the per-token "
                                "layout runs on the host backend)");
      detail::dispatch_quant2(shape.head_dim, format.partition, [](auto, auto) {});  // rejects Pi > head_dim
    }
    if constexpr (streams_compressed_pages) {
      use_tma_ = false;
      if (use_bulk_copy_) choose_compressed_stages(device);
    }
    prepare_decode_kernel();
    if (chunks.shortest > 0) reserve_chunks(chunks);
  }
  ~engine() {
    if (staged_ != nullptr) cudaEventDestroy(staged_);
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  const kvmosaic::detail::arena_geometry& geometry() const noexcept { return geometry_; }
  /// Bytes of one pool slot: one page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return geometry_.page_slot_bytes(); }
  /// Bytes a page costs besides its slot: the key bounds a selector keeps (0 for none).
  std::size_t page_bounds_bytes() const noexcept { return bounds_geometry_.page_bytes; }
  /// Device key bounds: [max_pages][num_kv_heads][lo row, hi row] in the storage dtype.
  const std::byte* bounds_data() const noexcept { return bounds_.as<const std::byte>(); }
  const std::byte* pages_data() const noexcept { return pages_.as<const std::byte>(); }
  const std::byte* tails_data() const noexcept { return tails_.as<const std::byte>(); }

  /// The stream every operation of this engine is enqueued on (default: the legacy stream 0).
  void set_stream(cudaStream_t stream) noexcept { stream_ = stream; }
  cudaStream_t stream() const noexcept { return stream_; }

  /// Prefill (a chunk of) one sequence, which has `sealed_pages` pages and `tail_rows` tail rows,
  /// from device rows [n][heads][head_dim].
  template <class T>
  void extend(std::int32_t slot, int tail_rows, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              const page_id* new_pages, std::int64_t sealed_pages) {
    check_device_rows("cache::prefill", k, v);
    if (tail_rows > 0 && tail_rows + k.extent(0) > shape_.page_size) save_tail(slot);
    // Encoded formats: chunks of at most encode_chunk_pages completed pages (the scratch arena);
    // format::dense writes every row in one pass. A chunk always holds at least one row: the tail
    // holds fewer than page_size rows, and a chunk of an encoded format is whole pages.
    const std::int64_t rows = k.extent(0);
    for (std::int64_t first = 0; first < rows;) {
      const std::int64_t room = encodes_pages ? std::int64_t{encode_chunk_pages} * shape_.page_size - tail_rows : rows - first;
      const auto count = static_cast<std::int32_t>(std::min(room, rows - first));
      const kernel::extend_item item{first, count, slot, tail_rows, 0};
      const std::int32_t pages = (tail_rows + count) / shape_.page_size;
      std::vector<std::int32_t> sink_slots(static_cast<std::size_t>(pages), -1);  // the sequence's first page
      if (pages > 0 && sealed_pages == 0) sink_slots[0] = slot;
      run_extend(std::vector<kernel::extend_item>{item}, new_pages, pages, k.data(), v.data(), count, sink_slots);
      new_pages += pages;
      sealed_pages += pages;
      tail_rows = (tail_rows + count) % shape_.page_size;
      first += count;
    }
  }

  /// One decode token per sequence: row b of k, v (device, [batch][heads][head_dim]) to items[b].
  template <class T>
  void append(const std::vector<kvmosaic::detail::append_item>& items, tensor_view<const T, 3> k,
              tensor_view<const T, 3> v) {
    check_device_rows("cache::append", k, v);
    std::vector<kernel::extend_item> work;
    std::vector<page_id> new_pages;
    std::vector<std::int32_t> sink_slots;
    for (std::size_t b = 0; b < items.size(); ++b) {
      work.push_back(kernel::extend_item{static_cast<std::int64_t>(b), 1, items[b].slot, items[b].tail_rows,
                                         static_cast<std::int32_t>(new_pages.size())});
      if (items[b].new_page >= 0) {
        new_pages.push_back(items[b].new_page);
        sink_slots.push_back(items[b].sealed_pages == 0 ? items[b].slot : -1);
      }
    }
    run_extend(work, new_pages.data(), static_cast<std::int32_t>(new_pages.size()), k.data(), v.data(), 1, sink_slots);
  }

  /// Undoes the writes since the last `commit` that a caller can see: the tail rows an `extend`
  /// overwrote (copied back on the stream), and the chunk updates not yet committed. Rows past a
  /// tail's committed length, fresh pages and chunk slots not yet committed are never read. After
  /// a sticky CUDA error (a fault in a kernel) the device state is lost with the context.
  void rollback() noexcept {
    if (saved_slot_ >= 0) {
      const std::size_t bytes = geometry_.tail_slot_bytes();
      try {
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tails_.as<std::byte>() + saved_slot_ * bytes, saved_tail_.data(), bytes,
                                            cudaMemcpyDeviceToDevice, stream_));
      } catch (...) {  // the context is gone; the caller's exception says why
      }
    }
    saved_slot_ = -1;
    chunks_.pending.clear();
    chunks_.pending_blocks = 0;
  }
  /// Makes the writes since the last `commit` final (host bookkeeping only; cannot throw).
  void commit() noexcept {
    saved_slot_ = -1;
    for (pending_chunks& update : chunks_.pending)
      chunks_.slots[static_cast<std::size_t>(update.slot)] = std::move(update.next);
    chunks_.free_blocks.resize(chunks_.free_blocks.size() - chunks_.pending_blocks);
    chunks_.pending.clear();
    chunks_.pending_blocks = 0;
  }

  void copy_tail(std::int32_t from, std::int32_t to, int /*rows*/) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tails_.as<std::byte>() + to * bytes, tails_.as<std::byte>() + from * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    if constexpr (has_key_weights_v<Format>) {
      has_key_weights_[static_cast<std::size_t>(to)] = has_key_weights_[static_cast<std::size_t>(from)];
      if (has_key_weights_[static_cast<std::size_t>(from)]) {
        const std::size_t row = shape_.row_elements() * sizeof(float);
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(key_weights_.as<std::byte>() + to * row, key_weights_.as<std::byte>() + from * row,
                                            row, cudaMemcpyDeviceToDevice, stream_));
      }
    }
  }

  /// Output-aware K pruning for the pages of `slot` sealed from now on: weights [num_kv_heads]
  /// [head_dim] in host memory (copied before this returns), or null for plain magnitudes.
  void set_key_weights(std::int32_t slot, const float* weights) {
    static_assert(has_key_weights_v<Format>, "this format has no K weights");
    has_key_weights_[static_cast<std::size_t>(slot)] = weights != nullptr;
    if (weights == nullptr) return;
    const std::size_t row = shape_.row_elements() * sizeof(float);
    if (key_weights_.size() == 0) key_weights_ = device_buffer(static_cast<std::size_t>(shape_.max_sequences) * row);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // encodes in flight may read the old row
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(key_weights_.as<std::byte>() + slot * row, weights, row, cudaMemcpyHostToDevice));
  }

  /// A decode step: plan, then launch. q and out are device arrays [batch][num_q_heads][head_dim].
  /// With a selection request (`select::quest`), the pages each KV head reads are chosen on the
  /// device from the key bounds (kernel/select_pages.cuh) inside `launch_step`.
  void attend(const std::vector<kvmosaic::detail::sequence_ref>& batch, tensor_view<const float, 3> q,
              tensor_view<float, 3> out, float softmax_scale, const kvmosaic::detail::selection_request* request = nullptr) {
    kvmosaic::detail::require(q.is_contiguous() && out.is_contiguous(), "cache::attend", "q, out layout", "strided",
                              "contiguous device arrays [batch][num_q_heads][head_dim] on the CUDA backend");
    require_device_memory("cache::attend", "q", q.data());
    require_device_memory("cache::attend", "out", out.data());
    plan_step(batch, request);
    launch_step(q.data(), out.data(), softmax_scale);
  }

  /// The page ids the last step chose for (batch entry b, KV head h), in sequence order (copied
  /// from the device; synchronizes). For tests and reports.
  std::vector<std::int32_t> selected_pages(std::int32_t b, int head) const {
    kvmosaic::detail::require(selecting_ && b >= 0 && b < batch_, "cuda::engine::selected_pages", "b", b,
                              "a batch entry of the last step, which must have been a selected one");
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::int32_t count = selected_counts_[static_cast<std::size_t>(b)];
    if (token_granular())
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(&count, table_lengths_.as<const std::int32_t>() + b * shape_.num_kv_heads + head,
                                     sizeof count, cudaMemcpyDeviceToHost));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(count));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(ids.data(),
                                   selected_.as<const std::int32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * capacity_.table_stride,
                                   ids.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    return ids;
  }
  /// The row masks of `selected_pages(b, head)` after a token-granular step (sub-page Quest
  /// blocks): per page, mask_words() words, bit r of word w for row 32 w + r (synchronizes).
  std::vector<std::uint32_t> selected_rows(std::int32_t b, int head) const {
    const std::size_t pages = selected_pages(b, head).size(), words = static_cast<std::size_t>(mask_words());
    kvmosaic::detail::require(token_granular(), "cuda::engine::selected_rows", "the last step", "page-granular",
                              "a token-granular selection (sub-page select::quest blocks)");
    std::vector<std::uint32_t> masks(pages * words);
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(masks.data(),
                                   token_masks_.as<const std::uint32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * capacity_.table_stride * words,
                                   masks.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
    return masks;
  }
  /// Row-mask words per page: ceil(page_size / 32).
  int mask_words() const noexcept { return (shape_.page_size + 31) / 32; }
  /// Whether selections pick blocks smaller than a page (the split kernels then read row masks).
  bool token_granular() const noexcept {
    return chunks_.limits.shortest > 0 ||
           (bounds_geometry_.block_tokens > 0 && bounds_geometry_.block_tokens < shape_.page_size);
  }

  /// `select::sentence_chunks`: rows [first, first + n) of `k` (device, [rows][num_kv_heads]
  /// [head_dim]) extend the token stream of `slot`, and the host has just closed chunks of
  /// `lengths` tokens, in order, from the first open token on. Their key bounds (the same values as
  /// the host backend's) and token ranges go to the chunk arena; the rows still open are kept.
  template <class T>
  void add_chunks(std::int32_t slot, tensor_view<const T, 3> k, std::int64_t first, std::int64_t n,
                  const std::vector<std::int32_t>& lengths) {
    // The update is built on a copy and takes effect at `commit`; until then the kernels write
    // only where the committed state does not look (new arena slots, rows past the open ones, or
    // the other open-row buffer).
    pending_chunks update{slot, chunks_.slots[static_cast<std::size_t>(slot)], 0};
    open_chunks& c = update.next;
    const auto stream = static_cast<std::int32_t>(c.open_rows + n);
    std::vector<int4> work;
    std::int32_t at = 0;
    for (const std::int32_t length : lengths) {
      if (c.count % chunks_per_block == 0) c.blocks.push_back(take_chunk_block(update, "cuda::engine::add_chunks"));
      const std::int32_t arena_slot = c.blocks.back() * chunks_per_block + c.count % chunks_per_block;
      work.push_back(make_int4(at, at + length, arena_slot, static_cast<int>(c.open_start + at)));
      at += length;
      ++c.count;
    }
    kvmosaic::detail::require(stream - at <= chunks_.limits.longest, "cuda::engine::add_chunks", "open rows", stream - at,
                              "at most chunk_limits::longest (a chunk is closed once its window exists)");
    chunks_.pending.reserve(chunks_.pending.size() + 1);
    kernel::chunk_params p{};
    p.open = open_row_buffer(slot, c.buffer);
    p.rows = k.data() + static_cast<std::size_t>(first) * shape_.num_kv_heads * shape_.head_dim;
    p.open_rows = c.open_rows;
    p.new_rows = static_cast<int>(n);
    p.keep_from = at;
    p.copy_from = at == 0 ? c.open_rows : at;
    const int next_buffer = at == 0 ? c.buffer : 1 - c.buffer;
    p.next_open = open_row_buffer(slot, next_buffer);
    p.bounds = chunks_.bounds.template as<std::byte>();
    p.ranges = chunks_.ranges.template as<int2>();
    p.chunks_per_block = chunks_per_block;
    p.num_kv_heads = shape_.num_kv_heads;
    if (!work.empty()) {
      if (chunks_.work.size() < work.size() * sizeof(int4)) {
        KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be read
        chunks_.work = device_buffer(std::max<std::size_t>(work.size(), 1024) * sizeof(int4));
      }
      // From pageable memory: the copy has left `work` when the call returns.
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(chunks_.work.data(), work.data(), work.size() * sizeof(int4), cudaMemcpyHostToDevice, stream_));
      p.chunks = chunks_.work.template as<const int4>();
    }
    detail::dispatch_shape(shape_.storage, shape_.head_dim, 1, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      const auto heads = static_cast<unsigned>(shape_.num_kv_heads);
      if (!work.empty()) {
        kernel::chunk_bounds_kernel<S, T, head_dim><<<dim3(static_cast<unsigned>(work.size()), heads), head_dim, 0, stream_>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      }
      if (stream > p.copy_from) {
        kernel::keep_open_rows_kernel<S, T, head_dim>
            <<<dim3(static_cast<unsigned>(stream - p.copy_from), heads), head_dim, 0, stream_>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      }
    });
    c.open_rows = stream - at;
    c.open_start += at;
    c.buffer = next_buffer;
    chunks_.pending_blocks += update.blocks_taken;
    chunks_.pending.push_back(std::move(update));  // within the reserved capacity
  }

  /// Frees the chunks of `slot` (its sequence ended).
  void release_chunks(std::int32_t slot) {
    open_chunks& c = chunks_.slots[static_cast<std::size_t>(slot)];
    chunks_.free_blocks.insert(chunks_.free_blocks.end(), c.blocks.begin(), c.blocks.end());
    c = open_chunks{};
  }

  /// Gives `to` (a slot with no chunks) a copy of the chunks and open rows of `from` (a fork);
  /// takes effect at `commit`, as `add_chunks`.
  void copy_chunks(std::int32_t from, std::int32_t to) {
    const open_chunks& source = chunks_.slots[static_cast<std::size_t>(from)];
    pending_chunks update{to, open_chunks{}, 0};
    open_chunks& c = update.next;
    c.blocks.reserve(source.blocks.size());
    chunks_.pending.reserve(chunks_.pending.size() + 1);
    const std::size_t block_bytes = chunk_block_bytes();
    for (const std::int32_t block : source.blocks) {
      const std::int32_t copy = take_chunk_block(update, "cuda::engine::copy_chunks");
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(chunks_.bounds.template as<std::byte>() + copy * block_bytes,
                                          chunks_.bounds.template as<const std::byte>() + block * block_bytes, block_bytes,
                                          cudaMemcpyDeviceToDevice, stream_));
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(chunks_.ranges.template as<int2>() + copy * chunks_per_block,
                                          chunks_.ranges.template as<const int2>() + block * chunks_per_block,
                                          chunks_per_block * sizeof(int2), cudaMemcpyDeviceToDevice, stream_));
      c.blocks.push_back(copy);
    }
    c.count = source.count;
    c.open_rows = source.open_rows;
    c.open_start = source.open_start;
    c.buffer = source.buffer;
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(open_row_buffer(to, c.buffer), open_row_buffer(from, source.buffer),
                                        open_row_bytes(), cudaMemcpyDeviceToDevice, stream_));
    chunks_.pending_blocks += update.blocks_taken;
    chunks_.pending.push_back(std::move(update));
  }

  /// Chunks of the sequence in `slot` so far (closed ones).
  std::int32_t chunk_count(std::int32_t slot) const { return chunks_.slots[static_cast<std::size_t>(slot)].count; }
  /// Device bytes kept for chunks: the arena and the open rows (reserved at construction).
  std::size_t chunk_storage_bytes() const noexcept { return chunks_.bounds.size() + chunks_.ranges.size() + chunks_.open.size(); }

  /// Quest scores of the last selected step for (b, head), one per span (a page, or a block of
  /// one: `spans` of them; synchronizes).
  std::vector<float> page_scores(std::int32_t b, int head, std::int32_t spans) const {
    std::vector<float> scores(static_cast<std::size_t>(spans));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(scores.data(),
                                   scores_.as<const float>() + (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * score_stride(),
                                   scores.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return scores;
  }

  /// Fixes the step metadata layout for batches up to `batch` sequences of up to
  /// `max_pages_per_sequence` pages. Steps within it reuse the same buffers and launch shape, which
  /// is what a captured CUDA graph needs; a larger step grows the layout (re-capture after that).
  void reserve_step(std::int32_t batch, std::int32_t max_pages_per_sequence, std::int32_t splits = 0,
                    std::int32_t max_chunk_blocks_per_sequence = 0) {
    const layout_capacity new_capacity{std::max(capacity_.batch, batch),
                                       std::max(capacity_.table_stride, max_pages_per_sequence),
                                       std::max({capacity_.work, splits, work_capacity(batch)}),
                                       std::max(capacity_.chunk_stride, max_chunk_blocks_per_sequence)};
    if (new_capacity.batch == capacity_.batch && new_capacity.table_stride == capacity_.table_stride &&
        new_capacity.work == capacity_.work && new_capacity.chunk_stride == capacity_.chunk_stride)
      return;
    capacity_ = new_capacity;
    const std::int32_t work = capacity_.work;
    layout_.header = 0;
    layout_.work = align(4 * sizeof(std::int32_t));
    layout_.partial_offset = layout_.work + align(static_cast<std::size_t>(work) * sizeof(split_work));
    layout_.slots = layout_.partial_offset + align((capacity_.batch + 1) * sizeof(std::int32_t));
    layout_.tail_rows = layout_.slots + align(capacity_.batch * sizeof(std::int32_t));
    layout_.sealed = layout_.tail_rows + align(capacity_.batch * sizeof(std::int32_t));
    layout_.budget = layout_.sealed + align(capacity_.batch * sizeof(std::int32_t));
    layout_.span_counts = layout_.budget + align(capacity_.batch * sizeof(std::int32_t));
    layout_.budget_tokens = layout_.span_counts + align(capacity_.batch * sizeof(std::int32_t));
    layout_.always_from = layout_.budget_tokens + align(capacity_.batch * sizeof(std::int32_t));
    layout_.tables = layout_.always_from + align(capacity_.batch * sizeof(std::int32_t));
    layout_.chunk_tables = layout_.tables + align(static_cast<std::size_t>(capacity_.batch) * capacity_.table_stride * sizeof(std::int32_t));
    layout_.bytes = layout_.chunk_tables + align(static_cast<std::size_t>(capacity_.batch) * capacity_.chunk_stride * sizeof(std::int32_t));
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));
    staging_ = pinned_buffer(layout_.bytes);
    step_metadata_ = device_buffer(layout_.bytes);
    const std::size_t partial_floats = static_cast<std::size_t>(work) * shape_.num_kv_heads * shape_.group_size * (shape_.head_dim + 1);
    partials_ = device_buffer(partial_floats * sizeof(float));
    if (bounds_geometry_.block_tokens > 0 || chunks_.limits.shortest > 0) {  // per (sequence, KV head): a score per span, the chosen pages
      const std::size_t rows = static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * capacity_.table_stride;
      scores_ = device_buffer(static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * score_stride() * sizeof(float));
      selected_ = device_buffer(rows * sizeof(std::int32_t));
      if (token_granular()) {  // and each chosen page's row mask
        const std::size_t words = rows * static_cast<std::size_t>(mask_words()) * sizeof(std::uint32_t);
        marks_ = device_buffer(words);
        token_masks_ = device_buffer(words);
        table_lengths_ = device_buffer(static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * sizeof(std::int32_t));
      }
    }
  }

  /// Host part of a step: the split plan from the lengths and the block tables, written to
  /// page-locked staging. Waits for the previous step's copy out of that staging, not for kernels.
  /// With a selection request, each sequence's splits cover the pages its KV heads may read: whole
  /// pages, min(budget / page_size, sealed pages), known here and chosen on the device; blocks of
  /// a page, at most min(budget / block, sealed pages), and the splits share those the device
  /// marks in proportion (`detail_decode::pages_of_split`).
  void plan_step(const std::vector<kvmosaic::detail::sequence_ref>& batch,
                 const kvmosaic::detail::selection_request* request = nullptr) {
    const auto n = static_cast<std::int32_t>(batch.size());
    std::vector<std::int32_t> full_pages(batch.size()), tail_rows(batch.size()), slots(batch.size()), read_pages(batch.size());
    std::int32_t longest = 1, most_chunk_blocks = 0;
    const bool chunked = chunks_.limits.shortest > 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      full_pages[b] = static_cast<std::int32_t>(batch[b].pages->size());
      tail_rows[b] = static_cast<std::int32_t>(batch[b].length - static_cast<std::int64_t>(full_pages[b]) * shape_.page_size);
      slots[b] = batch[b].slot;
      longest = std::max(longest, full_pages[b]);
      const int span_tokens = token_granular() ? bounds_geometry_.block_tokens : shape_.page_size;
      read_pages[b] = request == nullptr ? full_pages[b]
                                         : static_cast<std::int32_t>(std::min<std::int64_t>(
                                               std::max<std::int64_t>(request->budget[b], 0) / span_tokens, full_pages[b]));
      if (chunked) {  // chunks may touch any page: the splits share the pages the device marks
        read_pages[b] = full_pages[b];
        most_chunk_blocks = std::max(most_chunk_blocks, static_cast<std::int32_t>(chunks_.slots[static_cast<std::size_t>(slots[b])].blocks.size()));
      }
    }
    kvmosaic::detail::require(request == nullptr || bounds_geometry_.block_tokens > 0 || chunked, "cuda::engine::plan_step",
                              "selection request", "without key bounds",
                              "an engine built with bounds_block_tokens or chunk limits");
    const decode_tuning tuning = decode_tuning_for(shape_.head_dim, shape_.group_size);
    const split_plan plan =
        make_split_plan(read_pages, tail_rows, target_splits(), use_bulk_copy_ ? max_pages_per_split(tuning) : 1 << 30,
                        split_page_multiple);
    reserve_step(n, longest, plan.num_splits(), most_chunk_blocks);
    batch_ = n;
    step_splits_ = plan.num_splits();
    selecting_ = request != nullptr;
    if (request != nullptr) {
      combine_sum_ = request->combine == group_combine::sum;
      selected_counts_ = read_pages;
    }

    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));  // the previous copy has left the staging
    std::byte* host = staging_.as<std::byte>();
    const std::int32_t stride = capacity_.table_stride;
    const std::int32_t header[4] = {plan.num_splits(), selecting_ ? shape_.num_kv_heads * stride : stride,
                                    selecting_ ? stride : 0, stride};
    std::memcpy(host + layout_.header, header, sizeof header);
    std::memcpy(host + layout_.sealed, full_pages.data(), full_pages.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.budget, read_pages.data(), read_pages.size() * sizeof(std::int32_t));
    if (request != nullptr) {
      auto* spans = reinterpret_cast<std::int32_t*>(host + layout_.span_counts);
      auto* budget = reinterpret_cast<std::int32_t*>(host + layout_.budget_tokens);
      auto* always = reinterpret_cast<std::int32_t*>(host + layout_.always_from);
      auto* chunk_tables = reinterpret_cast<std::int32_t*>(host + layout_.chunk_tables);
      for (std::size_t b = 0; b < batch.size(); ++b) {
        spans[b] = full_pages[b] * bounds_geometry_.blocks_per_page;
        if (chunked) {
          const open_chunks& c = chunks_.slots[static_cast<std::size_t>(slots[b])];
          spans[b] = c.count;
          std::copy(c.blocks.begin(), c.blocks.end(), chunk_tables + b * capacity_.chunk_stride);
        }
        budget[b] = static_cast<std::int32_t>(std::clamp<std::int64_t>(request->budget[b], 0, std::numeric_limits<std::int32_t>::max()));
        always[b] = static_cast<std::int32_t>(std::min<std::int64_t>(request->always_from[b], std::numeric_limits<std::int32_t>::max()));
      }
    }
    std::memcpy(host + layout_.work, plan.work.data(), plan.work.size() * sizeof(split_work));
    std::memcpy(host + layout_.partial_offset, plan.partial_offset.data(), plan.partial_offset.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.slots, slots.data(), slots.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.tail_rows, tail_rows.data(), tail_rows.size() * sizeof(std::int32_t));
    auto* tables = reinterpret_cast<std::int32_t*>(host + layout_.tables);
    for (std::size_t b = 0; b < batch.size(); ++b)
      std::copy(batch[b].pages->begin(), batch[b].pages->end(), tables + b * capacity_.table_stride);
  }

  /// Device part of a step (capturable in a CUDA graph): copy the staged metadata, run the split
  /// kernel over a grid of `work_capacity(batch)` x num_kv_heads CTAs, then the merge kernel. On
  /// sm_90 the split and merge kernels are programmatic dependents of the kernel before each
  /// (cuda/detail/dependent_launch.cuh): each is scheduled while its predecessor finishes.
  void launch_step(const float* q, float* out, float softmax_scale) {
    const kernel::decode_params p = stage_step(q, out, softmax_scale);
    if (selecting_) launch_selection(p, q);
    const int num_q_heads = shape_.num_kv_heads * shape_.group_size;
    const dim3 grid(static_cast<unsigned>(std::max(work_capacity(batch_), step_splits_)), static_cast<unsigned>(shape_.num_kv_heads));
    with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
      detail::launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), detail::opted_in_shared(kernel, shared_bytes),
                            stream_, dependent_launch_, p);
    });
    detail::dispatch_shape(shape_.storage, shape_.head_dim, shape_.group_size, [&](auto, auto dim, auto) {
      constexpr int head_dim = decltype(dim)::value;
      detail::launch_kernel(kernel::merge_splits_kernel<head_dim>, dim3(static_cast<unsigned>(batch_ * num_q_heads)),
                            dim3(merge_threads(head_dim)), 0, stream_, dependent_launch_, p, num_q_heads);
    });
  }

  /// The selection part of a planned selected step alone (the metadata copy, scoring and top-k),
  /// capturable like `launch_step`: for timing selection apart from attention.
  void launch_selection_only(const float* q) {
    kvmosaic::detail::require(selecting_, "cuda::engine::launch_selection_only", "the planned step", "not selected",
                              "a step planned with a selection request");
    launch_selection(stage_step(q, nullptr, 1.0f), q);
  }

 private:
  /// Copies the staged metadata to the device and returns the step's kernel parameters.
  kernel::decode_params stage_step(const float* q, float* out, float softmax_scale) {
    detail::pull_from_host(staging_, step_metadata_.data(), layout_.bytes, stream_);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    KVMOSAIC_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
    // In a graph the caller orders replays and plan_step (it synchronizes before reading results).
    if (capturing == cudaStreamCaptureStatusNone) KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
    const std::byte* device = step_metadata_.as<const std::byte>();
    kernel::decode_params p{};
    p.pages = pages_.as<const std::byte>();
    p.tails = tails_.as<const std::byte>();
    p.page_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
    p.k_page_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
    p.v_page_bytes = static_cast<std::int64_t>(geometry_.v_page_bytes);
    p.tail_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
    p.tail_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
    p.num_kv_heads = shape_.num_kv_heads;
    p.page_size = shape_.page_size;
    p.step_header = reinterpret_cast<const std::int32_t*>(device + layout_.header);
    p.sequence_tables = reinterpret_cast<const std::int32_t*>(device + layout_.tables);
    p.sealed_pages = reinterpret_cast<const std::int32_t*>(device + layout_.sealed);
    p.block_tables = selecting_ ? selected_.as<const std::int32_t>() : p.sequence_tables;
    if (selecting_ && token_granular()) {
      p.token_masks = token_masks_.as<const std::uint32_t>();
      p.mask_words = mask_words();
      p.table_lengths = table_lengths_.as<const std::int32_t>();
      p.planned_pages = reinterpret_cast<const std::int32_t*>(device + layout_.budget);
    }
    p.tail_slots = reinterpret_cast<const std::int32_t*>(device + layout_.slots);
    p.tail_rows = reinterpret_cast<const std::int32_t*>(device + layout_.tail_rows);
    p.work = reinterpret_cast<const split_work*>(device + layout_.work);
    p.partial_offset = reinterpret_cast<const std::int32_t*>(device + layout_.partial_offset);
    p.q = q;
    p.softmax_scale = softmax_scale;
    const std::int32_t work = capacity_.work;
    p.partial_o = partials_.as<float>();
    p.partial_lse = partials_.as<float>() + static_cast<std::size_t>(work) * shape_.num_kv_heads * shape_.group_size * shape_.head_dim;
    p.out = out;
    p.page_rows = page_rows_;
    p.tail_rows_map = tail_rows_map_;
    p.stages = compressed_stages_;
    p.group_size = shape_.group_size;
    p.sink_rows = static_cast<int>(geometry_.sink_rows);
    if constexpr (is_bitmap) p.k_along_tokens = traits::k_along_tokens(format_) ? 1 : 0;
    return p;
  }

  /// The selection kernels of a step: score every span (a page, a block of one, or a chunk), then
  /// choose each KV head's pages (and, token-granular, their rows).
  void launch_selection(const kernel::decode_params& p, const float* q) {
    const std::byte* device = step_metadata_.as<const std::byte>();
    kernel::select_params s{};
    s.bounds = bounds_.as<const std::byte>();
    s.bounds_entry_bytes = static_cast<std::int64_t>(bounds_geometry_.page_bytes);
    s.spans_per_entry = bounds_geometry_.blocks_per_page;
    s.span_tables = p.sequence_tables;
    s.span_table_stride = capacity_.table_stride;
    s.span_tokens = bounds_geometry_.block_tokens;
    if (chunks_.limits.shortest > 0) {  // sentence chunks: spans from the chunk arena
      s.bounds = chunks_.bounds.template as<const std::byte>();
      s.bounds_entry_bytes = static_cast<std::int64_t>(chunk_block_bytes());
      s.spans_per_entry = chunks_per_block;
      s.span_tables = reinterpret_cast<const std::int32_t*>(device + layout_.chunk_tables);
      s.span_table_stride = capacity_.chunk_stride;
      s.span_tokens = 0;
      s.span_ranges = chunks_.ranges.template as<const int2>();
    }
    s.span_counts = reinterpret_cast<const std::int32_t*>(device + layout_.span_counts);
    s.score_stride = score_stride();
    s.step_header = p.step_header;
    s.block_tables = p.sequence_tables;
    s.sealed_pages = p.sealed_pages;
    s.budget_pages = reinterpret_cast<const std::int32_t*>(device + layout_.budget);
    s.q = q;
    s.num_kv_heads = shape_.num_kv_heads;
    s.group_size = shape_.group_size;
    s.combine_sum = combine_sum_ ? 1 : 0;
    s.scores = scores_.as<float>();
    s.selected = selected_.as<std::int32_t>();
    constexpr int spans_per_cta = kernel::score_warps * kernel::score_pages_per_warp;
    const dim3 score_grid(static_cast<unsigned>(shape_.num_kv_heads),
                          static_cast<unsigned>(std::max((score_stride() + spans_per_cta - 1) / spans_per_cta, 1)),
                          static_cast<unsigned>(batch_));
    detail::dispatch_shape(shape_.storage, shape_.head_dim, 1, [&](auto element, auto dim, auto) {
      kernel::score_pages_kernel<decltype(element), decltype(dim)::value><<<score_grid, kernel::score_warps * 32, 0, stream_>>>(s);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    const dim3 select_grid(static_cast<unsigned>(batch_), static_cast<unsigned>(shape_.num_kv_heads));
    if (token_granular()) {
      s.budget_tokens = reinterpret_cast<const std::int32_t*>(device + layout_.budget_tokens);
      s.always_from = reinterpret_cast<const std::int32_t*>(device + layout_.always_from);
      s.page_size = shape_.page_size;
      s.mask_words = mask_words();
      s.marks = marks_.as<std::uint32_t>();
      s.token_masks = token_masks_.as<std::uint32_t>();
      s.table_lengths = table_lengths_.as<std::int32_t>();
      // Keys and token counts in shared memory when they fit (its static shared memory: under 4 KB).
      const int longest_span = chunks_.limits.shortest > 0 ? chunks_.limits.longest : bounds_geometry_.block_tokens;
      int bytes = kernel::span_select_shared_bytes(score_stride());
      if (bytes > max_dynamic_shared_ || longest_span > 65535) bytes = 0;
      const auto select = kernel::select_spans_kernel<kernel::select_threads>;
      select<<<select_grid, kernel::select_threads, detail::opted_in_shared(select, bytes, 4 * 1024), stream_>>>(
          s, bytes > 0 ? 1 : 0);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      return;
    }
    const int keys_bytes = kernel::select_shared_bytes(capacity_.table_stride);
    kernel::select_pages_kernel<kernel::select_threads><<<select_grid, kernel::select_threads, keys_bytes, stream_>>>(
        s, keys_bytes > 0 ? 1 : 0);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  }

 public:
  /// Calls f(kernel, threads, dynamic shared bytes) with the split kernel this engine launches:
  /// the bulk-copy pipeline on sm_90 and later, the portable register-streaming kernel elsewhere.
  template <class F>
  void with_decode_kernel(F&& f) const {
    if constexpr (is_quant2) {
      // The group size is a run-time value of this kernel: instantiations per (type, head_dim, Pi).
      const int stage_bytes = static_cast<int>(geometry_.k_page_bytes + geometry_.v_page_bytes);
      const auto by_shape = [&](auto element) {
        using T = decltype(element);
        detail::dispatch_quant2(shape_.head_dim, format_.partition, [&](auto dim, auto partition) {
          constexpr int head_dim = decltype(dim)::value, pi = decltype(partition)::value;
          using layout = kernel::quant2_decode_layout<head_dim, pi>;
          const bool masks = selecting_ && token_granular();  // row masks: their own instantiations
          if (use_bulk_copy_ && masks)
            f(kernel::decode_partial_quant2_kernel<T, head_dim, pi, true, true>, 128, layout::bytes(stage_bytes, compressed_stages_));
          else if (use_bulk_copy_)
            f(kernel::decode_partial_quant2_kernel<T, head_dim, pi, true>, 128, layout::bytes(stage_bytes, compressed_stages_));
          else if (masks)
            f(kernel::decode_partial_quant2_kernel<T, head_dim, pi, false, true>, 128, layout::bytes(stage_bytes, 1));
          else
            f(kernel::decode_partial_quant2_kernel<T, head_dim, pi, false>, 128, layout::bytes(stage_bytes, 1));
        });
      };
      if (shape_.storage == dtype::f16)
        by_shape(half{});
      else
        by_shape(bfloat16{});
      return;
    }
    detail::dispatch_shape(shape_.storage, shape_.head_dim, shape_.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
      if constexpr (is_bitmap) {
        if (use_bulk_copy_) {
          const int shared_bytes = kernel::bitmap_decode_shared_bytes(
              head_dim, group_size, static_cast<int>(geometry_.k_page_bytes + geometry_.v_page_bytes), compressed_stages_,
              traits::k_along_tokens(format_));
          if (selecting_ && token_granular())  // row masks: their own instantiation
            f(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size, true>, 128, shared_bytes);
          else
            f(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size>, 128, shared_bytes);
        } else {
          using collective = page_attend<format::dense, T, head_dim, group_size, t.threads, t.unroll>;
          f(kernel::decode_partial_bitmap_portable_kernel<T, head_dim, group_size, t.threads, t.unroll>, t.threads,
            kernel::bitmap_portable_layout<head_dim, group_size, collective::rows>::bytes);
        }
      } else if (use_tma_) {
        constexpr int stage_tokens = 64, stages = t.tma_stages;
        using layout = kernel::tma_decode_layout<T, head_dim, stage_tokens, stages, t.max_pages_per_split>;
        f(kernel::decode_partial_tma_kernel<T, head_dim, group_size, stage_tokens, stages, t.max_pages_per_split>, 128,
          layout::bytes);
      } else if (use_bulk_copy_) {
        using layout =
            kernel::bulk_decode_layout<T, head_dim, group_size, t.stage_tokens, t.stages, t.max_pages_per_split>;
        f(kernel::decode_partial_bulk_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll, t.stage_tokens,
                                             t.stages, t.max_pages_per_split>,
          t.threads, layout::bytes);
      } else {
        f(kernel::decode_partial_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll>, t.threads, 0);
      }
    });
  }

  /// The most pages one split may hold: the page ids the dense sm_90 kernels keep in shared
  /// memory (the bitmap_tiles and quant2 kernels read them from the block table: no limit).
  static constexpr int max_pages_per_split(const decode_tuning& t) {
    return streams_compressed_pages ? 1 << 30 : t.max_pages_per_split;
  }

  /// bitmap_tiles and quant2 on sm_90: sets the compressed page pairs in flight (1 to 4; per CTA
  /// for bitmap_tiles, per warp for quant2) and re-reads the occupancy. For tuning experiments;
  /// the engine picks a value by itself.
  void set_compressed_stages(int stages) {
    kvmosaic::detail::require(stages >= 1 && stages <= 4, "cuda::engine::set_compressed_stages", "stages", stages,
                              "1 to 4");
    compressed_stages_ = stages;
    prepare_decode_kernel();
  }
  int compressed_stages() const noexcept { return compressed_stages_; }

  /// Splits per KV head the plan aims for: exactly one wave of resident CTAs (occupancy of the
  /// kernel this engine launches, times the SMs), so every split runs at once.
  std::int32_t target_splits() const { return std::max(1, num_sms_ * ctas_per_sm_ / shape_.num_kv_heads); }
  /// Decode with the portable kernel (the sm_75+ path) even on sm_90: for tests and comparisons.
  /// Takes effect from the next step.
  void use_portable_kernel() {
    use_bulk_copy_ = false;
    use_tma_ = false;
    prepare_decode_kernel();
  }

  /// Programmatic dependent launch of the split and merge kernels (on by default where the device
  /// supports it, sm_90 and later; elsewhere this does nothing). For comparisons: off, each kernel
  /// of a step starts after the one before it has drained. Takes effect from the next launch.
  void use_dependent_launch(bool enable) noexcept { dependent_launch_ = enable && supports_dependent_launch_; }
  bool uses_dependent_launch() const noexcept { return dependent_launch_; }

  /// True when decode runs an sm_90 pipeline (bulk copies or TMA), whose q is rounded to two
  /// 16-bit halves on tensor cores.
  bool uses_bulk_copy() const noexcept { return use_bulk_copy_; }
  /// True when decode runs the sm_90 TMA kernel with q.k and p.v on tensor cores (p also split
  /// into two 16-bit halves).
  bool uses_tma() const noexcept { return use_tma_; }
  /// True when decode multiplies p.v on tensor cores, p split into two 16-bit halves (the dense
  /// TMA kernel and the sm_90 bitmap_tiles kernel).
  bool splits_p_on_tensor_cores() const noexcept {
    return use_tma_ || (is_bitmap && use_bulk_copy_);
  }
  /// Grid size of the split kernel for a batch: an upper bound on the splits of any plan for it
  /// (at most target + batch: each sequence rounds its split count up by less than one), so a
  /// captured graph stays valid. Plans capped by max_pages_per_split (longer than a wave) may need
  /// more; the grid then grows with them (re-capture).
  std::int32_t work_capacity(std::int32_t batch) const { return target_splits() + batch; }

 private:
  static std::size_t align(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
  /// Split sizes in multiples of the workers a split kernel deals its pages to: quant2's warps
  /// (so none idles at the end of a split: 3% at batch 8, 128K); other kernels share each page.
  static constexpr std::int32_t split_page_multiple = is_quant2 ? 4 : 1;
  /// Completed pages per encode pass (encoded formats): bounds the scratch arena for a prefill.
  static constexpr std::int32_t encode_chunk_pages = 64;

  /// bitmap_tiles and quant2 on sm_90: the compressed stages (per CTA for bitmap_tiles, per warp
  /// for quant2). Occupancy comes first: as many CTAs per SM as the kernel's registers allow
  /// (quant2: at most 4) with at least one stage each, then as many stages as fit next to them
  /// (bitmap_tiles at most 2, quant2 at most 4). quant2 at Pi = 64, head_dim 128 gets 4 CTAs of 4
  /// warps with 2 pages in flight per warp; bitmap_tiles at head_dim 128, groups <= 4 (its kernel
  /// bounded to 96 registers) 5 CTAs of 2 stages. Measured on H100, bitmap_tiles, s = 0.7, 128K
  /// (results/h100-2026-11-25d and e): five CTAs against four 1.06x faster at batch 8 (779 against
  /// 826 us) and 1.07x at batch 32; two stages against three equal at batch 8 and 1.03x at batch
  /// 32; batch 1 is the exception (fewer, longer splits win there: 4K 25.0 us with four CTAs of
  /// four stages against 27.0). Pages too large for one stage run the portable kernel.
  void choose_compressed_stages(int device) {
    int per_sm = 0, per_block = 0, reserved = 0, registers = 0;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&registers, cudaDevAttrMaxRegistersPerMultiprocessor, device));
    int kernel_registers = 0;
    with_decode_kernel([&](auto kernel, int, int) {
      cudaFuncAttributes attributes{};
      KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
      kernel_registers = attributes.numRegs;
    });
    // Registers are allocated per warp in units of 256; the kernels run 4 warps.
    const int per_cta_registers = 4 * ((kernel_registers * 32 + 255) / 256 * 256);
    // A stage: one page pair for the CTA (bitmap_tiles), or for each of its 4 warps (quant2).
    const int pair = static_cast<int>(geometry_.k_page_bytes + geometry_.v_page_bytes) * (is_quant2 ? 4 : 1);
    const auto shared_bytes = [&](int stages) {
      int bytes = 0;
      if constexpr (is_quant2)
        detail::dispatch_quant2(shape_.head_dim, format_.partition, [&](auto dim, auto partition) {
          bytes = kernel::quant2_decode_layout<decltype(dim)::value, decltype(partition)::value>::stage_offset + 1024 +
                  stages * pair;
        });
      else
        bytes = kernel::bitmap_decode_shared_bytes(shape_.head_dim, shape_.group_size, pair, stages,
                                                   traits::k_along_tokens(format_));
      return bytes;
    };
    // bitmap_tiles takes at most 2: at five CTAs per SM a third or fourth stage was slower or equal
    // at batch 8-32 (H100, 2026-11-25, results/h100-2026-11-25e/stages: batch 32, 128K, s = 0.7
    // 2940 us with 2 stages, 3036 with 3). quant2 up to 4, as tuned.
    const int max_stages = is_quant2 ? kernel::bitmap_decode_layout<64, 1>::max_stages : 2;
    // bitmap_tiles: as many CTAs as registers allow (5 at head_dim 128, groups <= 4: the kernel is
    // bounded for it); quant2 stays at 4, as tuned.
    const int most_ctas = is_quant2 ? 4 : 16;
    for (int ctas = std::min(most_ctas, registers / std::max(per_cta_registers, 1)); ctas >= 1; --ctas) {
      const int budget = std::min(per_sm / ctas - reserved, per_block);
      int stages = 0;
      while (stages < max_stages && shared_bytes(stages + 1) <= budget) ++stages;
      if (stages >= 1) {
        compressed_stages_ = stages;
        return;
      }
    }
    use_bulk_copy_ = false;  // not even one page pair fits next to the dense tiles
  }

  /// Raises the chosen split kernel's dynamic shared-memory limit and reads its occupancy, which
  /// sizes the split plan.
  void prepare_decode_kernel() {
    with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
      if (shared_bytes > 48 * 1024)
        KVMOSAIC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
      KVMOSAIC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm_, kernel, threads, shared_bytes));
      ctas_per_sm_ = std::max(ctas_per_sm_, 1);
    });
  }

  /// A 2D tensor map over `rows` rows of head_dim 16-bit values at `base`, boxes of 64 channels x
  /// min(page_size, 64) rows, 128-byte swizzle (the layout the TMA kernel reads with ldmatrix).
  CUtensorMap make_row_map(void* base, std::uint64_t rows) const {
    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    cudaDriverEntryPointQueryResult status{};
    KVMOSAIC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                                         12000, cudaEnableDefault, &status));
    kvmosaic::detail::require(status == cudaDriverEntryPointSuccess && encode != nullptr, "cuda::engine",
                              "cuTensorMapEncodeTiled", "missing", "a driver with TMA (CUDA 12+)");
    CUtensorMap map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(shape_.head_dim), rows};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(shape_.head_dim) * 2};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(std::min(shape_.page_size, 64))};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result =
        encode(&map, shape_.storage == dtype::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
               base, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    kvmosaic::detail::require(result == CUDA_SUCCESS, "cuda::engine", "cuTensorMapEncodeTiled result",
                              static_cast<int>(result), "CUDA_SUCCESS");
    return map;
  }

  template <class T>
  void check_device_rows(const char* where, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v) const {
    kvmosaic::detail::require(k.is_contiguous() && v.is_contiguous(), where, "k, v layout", "strided",
                              "contiguous device arrays [rows][num_kv_heads][head_dim] on the CUDA backend");
    require_device_memory(where, "k", k.data());
    require_device_memory(where, "v", v.data());
  }
  /// Rejects a pointer the device cannot read: host memory that is not mapped (page-locked
  /// host memory and managed memory are accepted). One driver query, no synchronization.
  static void require_device_memory(const char* where, const char* name, const void* pointer) {
    cudaPointerAttributes attributes{};
    const cudaError_t result = cudaPointerGetAttributes(&attributes, pointer);
    if (result != cudaSuccess) cudaGetLastError();  // not a pointer CUDA knows: clear, then reject
    const bool readable = result == cudaSuccess && (attributes.type == cudaMemoryTypeDevice ||
                                                    attributes.type == cudaMemoryTypeManaged ||
                                                    (attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr));
    kvmosaic::detail::require(readable, where, name, "host memory",
                              "device memory (cudaMalloc, cudaMallocManaged or mapped page-locked host memory) on "
                              "the CUDA backend");
  }

  /// Writes rows and completes pages; `sink_slots[i]`: the tail slot that keeps the sink rows of
  /// new page i when it is a sequence's first page (formats with sinks), else -1.
  template <class T>
  void run_extend(const std::vector<kernel::extend_item>& items, const page_id* new_pages, std::int32_t num_new_pages,
                  const T* k, const T* v, std::int64_t max_rows, const std::vector<std::int32_t>& sink_slots) {
    // Staging: [items][new page ids], and for encoded formats [scratch ordinals 0 .. n) [the K
    // weight row of each new page, -1 for none] [sink slots].
    const std::size_t items_bytes = align(items.size() * sizeof(kernel::extend_item));
    const std::size_t pages_bytes = align(static_cast<std::size_t>(num_new_pages) * sizeof(page_id));
    const std::size_t bytes = items_bytes + (encodes_pages ? 4 : 1) * pages_bytes;
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));
    extend_staging_.reserve(bytes);
    extend_metadata_.reserve(bytes);
    std::byte* staging = extend_staging_.as<std::byte>();
    std::memcpy(staging, items.data(), items.size() * sizeof(kernel::extend_item));
    if (num_new_pages > 0) std::memcpy(staging + items_bytes, new_pages, num_new_pages * sizeof(page_id));
    if (encodes_pages) {
      auto* ordinals = reinterpret_cast<std::int32_t*>(staging + items_bytes + pages_bytes);
      for (std::int32_t i = 0; i < num_new_pages; ++i) ordinals[i] = i;
      auto* weight_rows = reinterpret_cast<std::int32_t*>(staging + items_bytes + 2 * pages_bytes);
      for (const kernel::extend_item& item : items) {
        const std::int32_t pages = (item.tail_rows + item.count) / shape_.page_size;
        bool weighted = false;
        if constexpr (has_key_weights_v<Format>) weighted = has_key_weights_[static_cast<std::size_t>(item.slot)];
        for (std::int32_t i = 0; i < pages; ++i) weight_rows[item.first_new_page + i] = weighted ? item.slot : -1;
      }
      if (num_new_pages > 0)
        std::memcpy(staging + items_bytes + 3 * pages_bytes, sink_slots.data(), num_new_pages * sizeof(std::int32_t));
      reserve_scratch(num_new_pages);
    }
    detail::pull_from_host(extend_staging_, extend_metadata_.data(), bytes, stream_);
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
    const std::byte* metadata = extend_metadata_.as<const std::byte>();
    const auto* page_ids = reinterpret_cast<const std::int32_t*>(metadata + items_bytes);
    kernel::extend_params p{};
    // Completed pages: dense rows straight into their pages, or into scratch slots to encode.
    p.pages = encodes_pages ? scratch_.as<std::byte>() : pages_.as<std::byte>();
    p.page_slot_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_slot_bytes() : geometry_.page_slot_bytes());
    p.new_pages = encodes_pages ? page_ids + pages_bytes / sizeof(std::int32_t) : page_ids;
    p.tails = tails_.as<std::byte>();
    p.page_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
    p.tail_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
    p.num_kv_heads = shape_.num_kv_heads;
    p.head_dim = shape_.head_dim;
    p.page_size = shape_.page_size;
    p.items = reinterpret_cast<const kernel::extend_item*>(metadata);
    const std::int64_t vectors_per_row = 2LL * shape_.num_kv_heads * (shape_.head_dim / 8);
    const dim3 tail_grid(detail::grid_for(vectors_per_row * shape_.page_size, extend_threads), static_cast<unsigned>(items.size()));
    const dim3 row_grid(detail::grid_for(vectors_per_row * max_rows, extend_threads), static_cast<unsigned>(items.size()));
    const auto scatter = [&](auto element) {
      using S = decltype(element);
      kernel::move_tail_rows_kernel<S><<<tail_grid, extend_threads, 0, stream_>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      kernel::scatter_rows_kernel<S, T><<<row_grid, extend_threads, 0, stream_>>>(p, k, v);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    };
    if (shape_.storage == dtype::f16)
      scatter(half{});
    else
      scatter(bfloat16{});
    if (bounds_geometry_.block_tokens > 0 && num_new_pages > 0) {
      // The rows of the new pages: in their page slots (dense), or in scratch slots 0 .. n.
      kernel::bounds_params b{};
      b.rows = encodes_pages ? scratch_.as<const std::byte>() : pages_.as<const std::byte>();
      b.rows_slot_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_slot_bytes() : geometry_.page_slot_bytes());
      b.rows_head_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_head_bytes : geometry_.k_page_bytes);
      b.row_slots = encodes_pages ? page_ids + pages_bytes / sizeof(std::int32_t) : page_ids;
      b.new_pages = page_ids;
      b.bounds = bounds_.as<std::byte>();
      b.bounds_page_bytes = static_cast<std::int64_t>(bounds_geometry_.page_bytes);
      b.block_tokens = bounds_geometry_.block_tokens;
      detail::dispatch_shape(shape_.storage, shape_.head_dim, 1, [&](auto element, auto dim, auto) {
        constexpr int head_dim = decltype(dim)::value;
        kernel::page_bounds_kernel<decltype(element), head_dim>
            <<<dim3(static_cast<unsigned>(num_new_pages), static_cast<unsigned>(shape_.num_kv_heads),
                    static_cast<unsigned>(bounds_geometry_.blocks_per_page)),
               head_dim, 0, stream_>>>(b);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      });
    }
    if constexpr (encodes_pages) {
      if (num_new_pages > 0)
        encode_pages(page_ids, reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 2 * pages_bytes),
                     reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 3 * pages_bytes), num_new_pages);
    }
  }

  /// Grows the scratch arena of dense page rows that encoded formats compress from.
  void reserve_scratch(std::int32_t pages) {
    if (pages <= scratch_pages_) return;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old arena may still be read
    scratch_pages_ = std::max(pages, encode_chunk_pages);
    scratch_ = device_buffer(static_cast<std::size_t>(scratch_pages_) * geometry_.tail_slot_bytes());
  }

  /// Compresses scratch slots 0 .. n into pages page_ids[0 .. n), K scored with weight rows
  /// weight_rows[0 .. n), sinks kept in tail slots sink_slots[0 .. n) (device arrays).
  void encode_pages(const std::int32_t* page_ids, const std::int32_t* weight_rows, const std::int32_t* sink_slots,
                    std::int32_t n) {
    if constexpr (is_quant2) {
      kernel::quant2_encode_params e{};
      e.rows = scratch_.as<const std::byte>();
      e.rows_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
      e.rows_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
      e.pages = pages_.as<std::byte>();
      e.page_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
      e.page_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
      e.tails = tails_.as<std::byte>();
      e.sink_rows = static_cast<int>(geometry_.sink_rows);
      e.sink_slots = sink_slots;
      e.new_pages = page_ids;
      e.num_kv_heads = shape_.num_kv_heads;
      e.page_size = shape_.page_size;
      e.partition = format_.partition;
      e.stochastic = format_.mode == format::rounding::stochastic;
      e.seed = format_.seed;
      const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(shape_.num_kv_heads), 2);
      const int code_bytes = shape_.page_size * shape_.head_dim;
      detail::dispatch_shape(shape_.storage, shape_.head_dim, 1, [&](auto element, auto dim, auto) {
        using S = decltype(element);
        constexpr int head_dim = decltype(dim)::value;
        const auto encode = kernel::encode_quant2_pages_kernel<S, head_dim>;
        encode<<<grid, kernel::quant2_encode_threads, detail::opted_in_shared(encode, code_bytes), stream_>>>(e);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      });
      (void)weight_rows;
      return;
    } else {
      (void)sink_slots;  // no sinks in other formats
      encode_bitmap_pages(page_ids, weight_rows, n);
    }
  }

  void encode_bitmap_pages(const std::int32_t* page_ids, const std::int32_t* weight_rows, std::int32_t n) {
    kernel::bitmap_encode_params e{};
    e.rows = scratch_.as<const std::byte>();
    e.rows_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
    e.pages = pages_.as<std::byte>();
    e.page_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
    e.k_page_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
    e.v_page_bytes = static_cast<std::int64_t>(geometry_.v_page_bytes);
    e.new_pages = page_ids;
    e.num_kv_heads = shape_.num_kv_heads;
    e.page_size = shape_.page_size;
    e.keep_k = kvmosaic::detail::kept_per_vector(format_.s_k, shape_.head_dim);
    e.keep_v = kvmosaic::detail::kept_per_vector(format_.s_v, shape_.head_dim);
    e.k_along_tokens = format_traits<Format>::k_along_tokens(format_) ? 1 : 0;
    e.key_weights = key_weights_.as<const float>();
    e.weight_rows = key_weights_.size() > 0 ? weight_rows : nullptr;
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(shape_.num_kv_heads), 2);
    const int mask_bytes = shape_.page_size * shape_.head_dim / 8;
    detail::dispatch_shape(shape_.storage, shape_.head_dim, 1, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      kernel::encode_bitmap_pages_kernel<S, head_dim><<<grid, kernel::encode_threads, mask_bytes, stream_>>>(e);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Chunks per block of the chunk arena: a sequence's chunks live in whole blocks, listed in its
  /// chunk table (as pages in a block table).
  static constexpr int chunks_per_block = 32;
  /// One sequence's chunks: its blocks, how many chunks it closed, and its open rows (in one of
  /// two buffers: closing chunks moves the rows still open to the other).
  struct open_chunks {
    std::vector<std::int32_t> blocks;
    std::int32_t count = 0;
    std::int32_t open_rows = 0;
    std::int64_t open_start = 0;  ///< the token of the first open row
    int buffer = 0;
  };
  /// A slot's chunk state after an `add_chunks` or `copy_chunks` not yet committed, and how many
  /// free blocks it took (from the back of the free list, after the pending updates before it).
  struct pending_chunks {
    std::int32_t slot;
    open_chunks next;
    std::size_t blocks_taken;
  };
  struct chunk_store {
    kvmosaic::detail::chunk_limits limits;
    std::vector<open_chunks> slots;        ///< [max_sequences]
    std::vector<std::int32_t> free_blocks;
    std::vector<pending_chunks> pending;   ///< updates of the current write (commit / rollback)
    std::size_t pending_blocks = 0;        ///< free blocks (at the back) the pending updates hold
    device_buffer bounds;                  ///< [blocks][num_kv_heads][chunks_per_block][lo row, hi row]
    device_buffer ranges;                  ///< [blocks * chunks_per_block] {first token, end token}
    device_buffer open;                    ///< [max_sequences][2][limits.longest][num_kv_heads][head_dim]
    device_buffer work;                    ///< one call's closed chunks
  };
  /// The next free chunk block for a pending update, or `capacity_error` (nothing taken).
  std::int32_t take_chunk_block(pending_chunks& update, const char* where) {
    const std::size_t taken = chunks_.pending_blocks + update.blocks_taken;
    if (taken >= chunks_.free_blocks.size())
      throw capacity_error("chunk storage", std::string("kvmosaic: ") + where +
                                                ": chunk storage is full; allowed: at most the chunks of the cache's "
                                                "pages and tails (forks copy their chunks)");
    ++update.blocks_taken;
    return chunks_.free_blocks[chunks_.free_blocks.size() - 1 - taken];
  }
  /// Keeps the tail slot `slot` on the device for `rollback` (a stream-ordered copy).
  void save_tail(std::int32_t slot) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    if (saved_tail_.size() < bytes) saved_tail_ = device_buffer(bytes);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(saved_tail_.data(), tails_.as<const std::byte>() + slot * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    saved_slot_ = slot;
  }
  std::size_t chunk_block_bytes() const noexcept {
    return static_cast<std::size_t>(shape_.num_kv_heads) * chunks_per_block * 2 * shape_.head_dim * size_of(shape_.storage);
  }
  std::size_t open_row_bytes() const noexcept {
    return static_cast<std::size_t>(chunks_.limits.longest) * shape_.num_kv_heads * shape_.head_dim * size_of(shape_.storage);
  }
  std::byte* open_row_buffer(std::int32_t slot, int buffer) {
    return chunks_.open.template as<std::byte>() + (static_cast<std::size_t>(slot) * 2 + buffer) * open_row_bytes();
  }
  /// Sizes the chunk storage: every token of every page and tail in chunks of the shortest length.
  void reserve_chunks(kvmosaic::detail::chunk_limits limits) {
    chunks_.limits = limits;
    const std::int64_t tokens = (static_cast<std::int64_t>(shape_.max_pages) + shape_.max_sequences) * shape_.page_size;
    const std::int64_t blocks = (tokens / limits.shortest + chunks_per_block - 1) / chunks_per_block + shape_.max_sequences;
    chunks_.slots.assign(static_cast<std::size_t>(shape_.max_sequences), open_chunks{});
    chunks_.free_blocks.resize(static_cast<std::size_t>(blocks));
    for (std::int64_t i = 0; i < blocks; ++i) chunks_.free_blocks[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(blocks - 1 - i);
    chunks_.bounds = device_buffer(static_cast<std::size_t>(blocks) * chunk_block_bytes());
    chunks_.ranges = device_buffer(static_cast<std::size_t>(blocks) * chunks_per_block * sizeof(int2));
    chunks_.open = device_buffer(static_cast<std::size_t>(shape_.max_sequences) * 2 * open_row_bytes());
  }

  struct layout_capacity {
    std::int32_t batch = 0, table_stride = 0, work = 0, chunk_stride = 0;
  };
  /// Byte offsets of the step metadata: [header][work][partial_offset][slots][tail_rows][sealed pages]
  /// [pages to read][tables].
  struct step_layout {
    std::size_t header = 0, work = 0, partial_offset = 0, slots = 0, tail_rows = 0, sealed = 0, budget = 0,
                span_counts = 0, budget_tokens = 0, always_from = 0, tables = 0, chunk_tables = 0, bytes = 0;
  };
  /// Scores per (sequence, KV head) in `scores_`: one per span of the longest sequence.
  std::int32_t score_stride() const noexcept {
    if (chunks_.limits.shortest > 0) return std::max(capacity_.chunk_stride, 1) * chunks_per_block;
    return capacity_.table_stride * std::max(bounds_geometry_.blocks_per_page, 1);
  }

  kvmosaic::detail::engine_shape shape_;
  Format format_;
  kvmosaic::detail::arena_geometry geometry_;
  kvmosaic::detail::bounds_geometry bounds_geometry_;
  device_buffer pages_;
  device_buffer tails_;
  device_buffer bounds_;          ///< key bounds per page (select::quest), else empty
  device_buffer scores_;          ///< [batch][num_kv_heads][table stride] page scores of a selected step
  device_buffer selected_;        ///< [batch][num_kv_heads][table stride] the pages each KV head reads
  bool selecting_ = false;        ///< the planned step is a selected one
  bool combine_sum_ = false;
  std::vector<std::int32_t> selected_counts_;
  device_buffer marks_;           ///< token-granular selection scratch: [batch][num_kv_heads][table stride][mask words]
  device_buffer token_masks_;     ///< the row masks of selected_ ([batch][num_kv_heads][table stride][mask words])
  device_buffer table_lengths_;   ///< [batch][num_kv_heads] entries of selected_ a token-granular step wrote
  chunk_store chunks_;            ///< select::sentence_chunks' chunks (limits.shortest == 0: none)
  int max_dynamic_shared_ = 48 * 1024;  ///< the most dynamic shared memory a CTA may opt in to, less static use
  int num_sms_ = 1;
  int ctas_per_sm_ = 1;
  bool use_bulk_copy_ = false;
  bool use_tma_ = false;
  bool supports_dependent_launch_ = false;  ///< sm_90 and later
  bool dependent_launch_ = false;           ///< split and merge kernels overlap their predecessor's end
  CUtensorMap page_rows_{};
  CUtensorMap tail_rows_map_{};
  cudaStream_t stream_ = nullptr;
  cudaEvent_t staged_ = nullptr;  ///< the last copy out of page-locked staging
  layout_capacity capacity_;
  step_layout layout_;
  std::int32_t batch_ = 0;
  std::int32_t step_splits_ = 0;
  pinned_buffer staging_, extend_staging_;
  device_buffer step_metadata_, extend_metadata_, partials_;
  device_buffer scratch_;        ///< dense rows of pages to encode (encoded formats)
  device_buffer key_weights_;    ///< [max_sequences][num_kv_heads][head_dim] output-aware K weights
  std::vector<bool> has_key_weights_ = std::vector<bool>(static_cast<std::size_t>(shape_.max_sequences), false);
  std::int32_t scratch_pages_ = 0;
  device_buffer saved_tail_;      ///< one tail slot kept for `rollback`
  std::int32_t saved_slot_ = -1;  ///< its slot, -1: nothing to restore
  int compressed_stages_ = 2;    ///< bitmap_tiles / quant2 sm_90 kernels: compressed page pairs in flight
};

}  // namespace cuda

namespace detail {
template <class Format>
struct engine_for<backend::cuda, Format> {
  using type = cuda::engine<Format>;
};
}  // namespace detail

}  // namespace kvmosaic
