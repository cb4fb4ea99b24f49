// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::sentence_chunks` on the CUDA backend (SentenceKV-style chunks cut by Algorithm 2 on
/// the host, select/sentence_chunks.hpp). The keys never leave the device: per sequence the stage
/// keeps its open chunk's K rows (at most L + Delta rows, in one of two buffers), and when the host
/// closes chunks it writes their key bounds and token ranges to a chunk arena of blocks of 32
/// chunks, listed per sequence in a chunk table as pages are in a block table
/// (kernel/chunk_bounds.cuh). A step scores every closed chunk and marks the chosen chunks' rows
/// in the pages that hold them (`span_selection`, always with row masks).
///
/// Cost: device memory for every chunk the pool's pages and tails can hold at the shortest chunk
/// length (2 x head_dim 16-bit values per chunk and KV head, plus 8 bytes of range), and two
/// open-row buffers of L + Delta rows per sequence, all reserved at construction; per write one
/// pass over the closed chunks' rows; per step the span selection's.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/kernel/chunk_bounds.cuh"
#include "kvmosaic/cuda/select/selection_stage.cuh"
#include "kvmosaic/cuda/select/span_selection.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/select/sentence_chunks.hpp"

namespace kvmosaic::cuda {

/// The spans are the closed chunks, listed per sequence in its chunk table (always with row
/// masks); staging, outputs, the launch and the read-back are `span_selection`'s.
template <class Shapes>
class selection_stage<select::sentence_chunks, Shapes> : public span_selection<Shapes> {
  using spans = span_selection<Shapes>;

 public:
  /// Chunks per block of the chunk arena.
  static constexpr int chunks_per_block = 32;

  /// Storage for chunks of max(1, L - Delta) to L + Delta tokens (what Algorithm 2 can cut).
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::sentence_chunks& selector)
      : spans(shape, true),
        shape_(shape),
        shortest_(std::max(1, selector.target_length - selector.window)),
        longest_(selector.target_length + selector.window) {
    const std::int64_t tokens = (static_cast<std::int64_t>(shape.max_pages) + shape.max_sequences) * shape.page_size;
    const std::int64_t blocks = (tokens / shortest_ + chunks_per_block - 1) / chunks_per_block + shape.max_sequences;
    slots_.assign(static_cast<std::size_t>(shape.max_sequences), open_chunks{});
    free_blocks_.resize(static_cast<std::size_t>(blocks));
    for (std::int64_t i = 0; i < blocks; ++i) free_blocks_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(blocks - 1 - i);
    bounds_ = device_buffer(static_cast<std::size_t>(blocks) * block_bytes());
    ranges_ = device_buffer(static_cast<std::size_t>(blocks) * chunks_per_block * sizeof(int2));
    open_ = device_buffer(static_cast<std::size_t>(shape.max_sequences) * 2 * open_row_bytes());
    spans::use_source(span_source{bounds_.as<const std::byte>(), static_cast<std::int64_t>(block_bytes()), chunks_per_block, 0,
                                  ranges_.as<const int2>(), longest_, true});
  }

  /// Chunk bounds are kept per chunk, not per page.
  std::size_t page_bytes() const noexcept { return 0; }
  void seal(const sealed_pages&, cudaStream_t) noexcept {}

  /// Rows [first, first + n) of `k` (device, [rows][num_kv_heads][head_dim]) extend the token
  /// stream of `slot`, and the host has just closed chunks of `lengths` tokens, in order, from the
  /// first open token on. Their key bounds (the host backend's values) and token ranges go to the
  /// arena; the rows still open are kept. Takes effect at `commit`: until then the kernels write
  /// only where the committed state does not look (new arena slots, rows past the open ones, or
  /// the other open-row buffer). Throws `capacity_error` when the arena is full.
  template <class T>
  void add_chunks(std::int32_t slot, tensor_view<const T, 3> k, std::int64_t first, std::int64_t n,
                  const std::vector<std::int32_t>& lengths, cudaStream_t stream) {
    add_chunk_rows(slot, k.data() + static_cast<std::size_t>(first) * shape_.num_kv_heads * shape_.head_dim, dtype_traits<T>::id,
                   n, lengths, stream);
  }
  /// `add_chunks` of rows [0, n) at `rows` (device, of dtype `rows_type`): out of line, so that an
  /// explicit instantiation declaration (cuda/instantiate.cuh) keeps its kernels out of a unit.
  void add_chunk_rows(std::int32_t slot, const void* rows, dtype rows_type, std::int64_t n,
                      const std::vector<std::int32_t>& lengths, cudaStream_t stream);

  /// Gives `to` (a slot with no chunks) a copy of the chunks and open rows of `from` (a fork);
  /// takes effect at `commit`, as `add_chunks`.
  void copy_chunks(std::int32_t from, std::int32_t to, cudaStream_t stream) {
    const open_chunks& source = slots_[static_cast<std::size_t>(from)];
    pending update{to, open_chunks{}, 0};
    open_chunks& c = update.next;
    c.blocks.reserve(source.blocks.size());
    pending_.reserve(pending_.size() + 1);
    for (const std::int32_t block : source.blocks) {
      const std::int32_t copy = take_block(update, "cuda::engine::copy_chunks");
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(bounds_.as<std::byte>() + copy * block_bytes(),
                                          bounds_.as<const std::byte>() + block * block_bytes(), block_bytes(),
                                          cudaMemcpyDeviceToDevice, stream));
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(ranges_.as<int2>() + copy * chunks_per_block, ranges_.as<const int2>() + block * chunks_per_block,
                                          chunks_per_block * sizeof(int2), cudaMemcpyDeviceToDevice, stream));
      c.blocks.push_back(copy);
    }
    c.count = source.count;
    c.open_rows = source.open_rows;
    c.open_start = source.open_start;
    c.buffer = source.buffer;
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(open_row_buffer(to, c.buffer), open_row_buffer(from, source.buffer), open_row_bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
    pending_blocks_ += update.blocks_taken;
    pending_.push_back(std::move(update));
  }

  /// Frees the chunks of `slot` (its sequence ended).
  void release_chunks(std::int32_t slot) {
    open_chunks& c = slots_[static_cast<std::size_t>(slot)];
    free_blocks_.insert(free_blocks_.end(), c.blocks.begin(), c.blocks.end());
    c = open_chunks{};
  }

  void commit() noexcept {
    for (pending& update : pending_) slots_[static_cast<std::size_t>(update.slot)] = std::move(update.next);
    free_blocks_.resize(free_blocks_.size() - pending_blocks_);
    pending_.clear();
    pending_blocks_ = 0;
  }
  void rollback() noexcept {
    pending_.clear();
    pending_blocks_ = 0;
  }

  /// Chunks of the sequence in `slot` so far (closed ones).
  std::int32_t chunk_count(std::int32_t slot) const { return slots_[static_cast<std::size_t>(slot)].count; }
  /// Device bytes kept for chunks: the arena and the open rows (reserved at construction).
  std::size_t chunk_storage_bytes() const noexcept { return bounds_.size() + ranges_.size() + open_.size(); }

  /// Every sealed page is covered (chunks may touch any page; the splits share the pages the
  /// device marks); the spans are the sequence's closed chunks.
  void plan(const kvmosaic::detail::selection_request* request, const std::vector<step_sequence>& batch,
            std::vector<std::int32_t>& read_pages) {
    for (std::size_t b = 0; b < batch.size(); ++b) read_pages[b] = batch[b].sealed_pages;
    if (request == nullptr) {
      spans::start_unselected();
      return;
    }
    std::int32_t most_blocks = 0;
    for (const step_sequence& s : batch)
      most_blocks = std::max(most_blocks, static_cast<std::int32_t>(slots_[static_cast<std::size_t>(s.slot)].blocks.size()));
    spans::start(*request, batch.size(), true, most_blocks);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const open_chunks& c = slots_[static_cast<std::size_t>(batch[b].slot)];
      spans::add(b, c.count, *request, read_pages[b], &c.blocks);
    }
  }

 private:
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
  struct pending {
    std::int32_t slot;
    open_chunks next;
    std::size_t blocks_taken;
  };

  /// The next free block for a pending update, or `capacity_error` (nothing taken).
  std::int32_t take_block(pending& update, const char* where) {
    const std::size_t taken = pending_blocks_ + update.blocks_taken;
    if (taken >= free_blocks_.size())
      throw capacity_error("chunk storage", std::string("kvmosaic: ") + where +
                                                ": chunk storage is full; allowed: at most the chunks of the cache's "
                                                "pages and tails (forks copy their chunks)");
    ++update.blocks_taken;
    return free_blocks_[free_blocks_.size() - 1 - taken];
  }
  std::size_t block_bytes() const noexcept {
    return static_cast<std::size_t>(shape_.num_kv_heads) * chunks_per_block * 2 * shape_.head_dim * size_of(shape_.storage);
  }
  std::size_t open_row_bytes() const noexcept {
    return static_cast<std::size_t>(longest_) * shape_.num_kv_heads * shape_.head_dim * size_of(shape_.storage);
  }
  std::byte* open_row_buffer(std::int32_t slot, int buffer) {
    return open_.as<std::byte>() + (static_cast<std::size_t>(slot) * 2 + buffer) * open_row_bytes();
  }
  kvmosaic::detail::engine_shape shape_;
  int shortest_, longest_;                 ///< chunk lengths Algorithm 2 can cut
  std::vector<open_chunks> slots_;         ///< [max_sequences]
  std::vector<std::int32_t> free_blocks_;
  std::vector<pending> pending_;           ///< updates of the current write (commit / rollback)
  std::size_t pending_blocks_ = 0;         ///< free blocks (at the back) the pending updates hold
  device_buffer bounds_;                   ///< [blocks][num_kv_heads][chunks_per_block][lo row, hi row]
  device_buffer ranges_;                   ///< [blocks * chunks_per_block] {first token, end token}
  device_buffer open_;                     ///< [max_sequences][2][L + Delta][num_kv_heads][head_dim]
  device_buffer work_;                     ///< one call's closed chunks
};

template <class Shapes>
void selection_stage<select::sentence_chunks, Shapes>::add_chunk_rows(std::int32_t slot, const void* rows, dtype rows_type,
                                                                      std::int64_t n, const std::vector<std::int32_t>& lengths,
                                                                      cudaStream_t stream) {
  pending update{slot, slots_[static_cast<std::size_t>(slot)], 0};
  open_chunks& c = update.next;
  const auto stream_rows = static_cast<std::int32_t>(c.open_rows + n);
  std::vector<int4> work;
  std::int32_t at = 0;
  for (const std::int32_t length : lengths) {
    if (c.count % chunks_per_block == 0) c.blocks.push_back(take_block(update, "cuda::engine::add_chunks"));
    const std::int32_t arena_slot = c.blocks.back() * chunks_per_block + c.count % chunks_per_block;
    work.push_back(make_int4(at, at + length, arena_slot, static_cast<int>(c.open_start + at)));
    at += length;
    ++c.count;
  }
  kvmosaic::detail::require(stream_rows - at <= longest_, "cuda::engine::add_chunks", "open rows", stream_rows - at,
                            "at most L + Delta (a chunk is closed once its window exists)");
  pending_.reserve(pending_.size() + 1);
  kernel::chunk_params p{};
  p.open = open_row_buffer(slot, c.buffer);
  p.rows = rows;
  p.open_rows = c.open_rows;
  p.new_rows = static_cast<int>(n);
  p.keep_from = at;
  p.copy_from = at == 0 ? c.open_rows : at;
  const int next_buffer = at == 0 ? c.buffer : 1 - c.buffer;
  p.next_open = open_row_buffer(slot, next_buffer);
  p.bounds = bounds_.as<std::byte>();
  p.ranges = ranges_.as<int2>();
  p.chunks_per_block = chunks_per_block;
  p.num_kv_heads = shape_.num_kv_heads;
  if (!work.empty()) {
    if (work_.size() < work.size() * sizeof(int4)) {
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old buffer may still be read
      work_ = device_buffer(std::max<std::size_t>(work.size(), 1024) * sizeof(int4));
    }
    // From pageable memory: the copy has left `work` when the call returns.
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(work_.data(), work.data(), work.size() * sizeof(int4), cudaMemcpyHostToDevice, stream));
    p.chunks = work_.as<const int4>();
  }
  detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto dim, auto) {
    detail::dispatch_io_type(rows_type, [&](auto input) {
      using S = decltype(element);
      using T = decltype(input);
      constexpr int head_dim = decltype(dim)::value;
      const auto heads = static_cast<unsigned>(shape_.num_kv_heads);
      if (!work.empty()) {
        kernel::chunk_bounds_kernel<S, T, head_dim><<<dim3(static_cast<unsigned>(work.size()), heads), head_dim, 0, stream>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      }
      if (stream_rows > p.copy_from) {
        kernel::keep_open_rows_kernel<S, T, head_dim>
            <<<dim3(static_cast<unsigned>(stream_rows - p.copy_from), heads), head_dim, 0, stream>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      }
    });
  });
  c.open_rows = stream_rows - at;
  c.open_start += at;
  c.buffer = next_buffer;
  pending_blocks_ += update.blocks_taken;
  pending_.push_back(std::move(update));  // within the reserved capacity
}

}  // namespace kvmosaic::cuda
