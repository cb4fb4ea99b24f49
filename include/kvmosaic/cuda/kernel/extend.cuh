// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Kernels that write new tokens into dense storage (format::dense pages and every format's tail):
/// a prefill chunk of one sequence or one decode token of each sequence in a batch. Rows are
/// rounded to the storage dtype (round to nearest even, as on the host) and go either to the tail
/// or, when they complete a page, straight into that page; a page that a partly filled tail
/// completes first receives the tail's rows (`move_tail_rows_kernel`, launched before the scatter
/// so the scatter may reuse the tail).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/detail/vector_io.cuh"

namespace kvmosaic::cuda::kernel {

/// One sequence's share of an extend: `count` input rows starting at `src_row`, appended after
/// `tail_rows` rows in tail slot `slot`. Pages completed by them are
/// `new_pages[first_new_page ...]`, (tail_rows + count) / page_size of them.
struct extend_item {
  std::int64_t src_row;
  std::int32_t count;
  std::int32_t slot;
  std::int32_t tail_rows;
  std::int32_t first_new_page;
};

/// Element strides of the input rows [rows][heads][head_dim] (the last dimension contiguous).
struct row_strides {
  std::int64_t k_row, k_head, v_row, v_head;
};

struct extend_params {
  std::byte* pages;
  std::byte* tails;
  std::int64_t page_slot_bytes;
  std::int64_t page_head_bytes;   ///< dense: page_size * head_dim * sizeof(T), K and V alike
  std::int64_t tail_slot_bytes;
  std::int64_t tail_head_bytes;   ///< a tail head: the exact rows, then page_size tail rows
  std::int64_t tail_row_offset;   ///< bytes before tail row 0 in a tail head (the exact rows)
  int num_kv_heads;
  int head_dim;
  int page_size;
  const extend_item* items;
  const std::int32_t* new_pages;
  row_strides strides;            ///< of the input rows
};

namespace detail_extend {
/// Work item i of a grid-stride loop over rows x (K, V) x heads x 16-byte vectors.
struct row_vector {
  int vector;
  int head;
  int is_v;
  std::int64_t row;
};
__device__ __forceinline__ row_vector decompose(const extend_params& p, std::int64_t i) {
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t rest = i / vectors_per_row;
  return row_vector{static_cast<int>(i % vectors_per_row), static_cast<int>(rest % p.num_kv_heads),
                    static_cast<int>((rest / p.num_kv_heads) % 2), rest / (2 * p.num_kv_heads)};
}

/// Byte offset of (K or V, head, row) inside a page slot laid out [K heads][V heads] of
/// `page_head_bytes`.
__device__ __forceinline__ std::int64_t row_offset(const extend_params& p, int is_v, int head, int row) {
  return (static_cast<std::int64_t>(is_v) * p.num_kv_heads + head) * p.page_head_bytes +
         static_cast<std::int64_t>(row) * p.head_dim * 2;  // 16-bit rows
}
/// Byte offset of tail row `row` of (K or V, head) inside a tail slot.
__device__ __forceinline__ std::int64_t tail_row_offset(const extend_params& p, int is_v, int head, int row) {
  return (static_cast<std::int64_t>(is_v) * p.num_kv_heads + head) * p.tail_head_bytes + p.tail_row_offset +
         static_cast<std::int64_t>(row) * p.head_dim * 2;
}
}  // namespace detail_extend

/// Copies rows [0, tail_rows) of each item's tail into its first new page (items that complete a
/// page from a partly filled tail), T being the 16-bit storage type. Grid: (vectors of the largest
/// tail, items). (A template, so that every translation unit may define it.)
template <class T>
__global__ void move_tail_rows_kernel(const extend_params p) {
  static_assert(sizeof(T) == 2, "dense rows are 16-bit");
  const extend_item item = p.items[blockIdx.y];
  const bool completes_page = item.tail_rows > 0 && item.tail_rows + item.count >= p.page_size;
  if (!completes_page) return;
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t total = static_cast<std::int64_t>(item.tail_rows) * 2 * p.num_kv_heads * vectors_per_row;
  std::byte* page = p.pages + static_cast<std::int64_t>(p.new_pages[item.first_new_page]) * p.page_slot_bytes;
  const std::byte* tail = p.tails + static_cast<std::int64_t>(item.slot) * p.tail_slot_bytes;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const detail_extend::row_vector x = detail_extend::decompose(p, i);
    const std::int64_t to = detail_extend::row_offset(p, x.is_v, x.head, static_cast<int>(x.row)) + x.vector * 16;
    const std::int64_t from = detail_extend::tail_row_offset(p, x.is_v, x.head, static_cast<int>(x.row)) + x.vector * 16;
    *reinterpret_cast<uint4*>(page + to) = *reinterpret_cast<const uint4*>(tail + from);
  }
}

/// Writes each item's input rows (InT: float, half or bfloat16, [rows][heads][head_dim] with the
/// strides `p.strides`) to their page or to the tail, as T. Grid: (vectors of the largest item,
/// items).
template <class T, class InT>
__global__ void scatter_rows_kernel(const extend_params p, const InT* __restrict__ k, const InT* __restrict__ v) {
  const extend_item item = p.items[blockIdx.y];
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t total = static_cast<std::int64_t>(item.count) * 2 * p.num_kv_heads * vectors_per_row;
  const int full_pages = (item.tail_rows + item.count) / p.page_size;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const detail_extend::row_vector x = detail_extend::decompose(p, i);
    const int vector = x.vector, head = x.head, is_v = x.is_v;
    const std::int64_t r = x.row;
    const std::int64_t position = item.tail_rows + r;
    const int page_index = static_cast<int>(position / p.page_size);
    const int row = static_cast<int>(position % p.page_size);
    const bool to_page = page_index < full_pages;
    std::byte* base = to_page ? p.pages + static_cast<std::int64_t>(p.new_pages[item.first_new_page + page_index]) * p.page_slot_bytes
                              : p.tails + static_cast<std::int64_t>(item.slot) * p.tail_slot_bytes;
    const std::int64_t row_stride = is_v ? p.strides.v_row : p.strides.k_row;
    const std::int64_t head_stride = is_v ? p.strides.v_head : p.strides.k_head;
    const InT* src = (is_v ? v : k) + (item.src_row + r) * row_stride + head * head_stride + vector * detail::vector_elements;
    alignas(16) T converted[detail::vector_elements];
#pragma unroll
    for (int e = 0; e < detail::vector_elements; ++e) converted[e] = T(to_float(src[e]));
    const std::int64_t offset = to_page ? detail_extend::row_offset(p, is_v, head, row) : detail_extend::tail_row_offset(p, is_v, head, row);
    *reinterpret_cast<uint4*>(base + offset + vector * 16) = *reinterpret_cast<const uint4*>(converted);
  }
}

/// One new page of a sequence whose format keeps exact rows (`sink_rows`, `window_rows`): its
/// tail slot, the position of its first token, and the first position of the recent window once
/// this write is done (sealed tokens - W).
struct exact_item {
  std::int64_t first;
  std::int64_t window_from;
  std::int32_t slot;
  std::int32_t pad;
};

/// Copies the exact rows of each new page (`exact[i]`, its dense rows in page slot
/// `p.new_pages[i]` laid out as `p.pages`): its sinks (positions below `sinks`) to their rows
/// and its positions from `window_from` on (the latest W sealed ones) to their window-ring rows,
/// in the tail slot (host/backend.hpp: ring entry j, position sinks + j modulo W, at row W - 1 - j
/// of the head; sink t at row W + t). Grid: (vectors of a page, new pages). Cost: at most S + W
/// rows per new page.
template <class T>
__global__ void keep_exact_rows_kernel(const extend_params p, const exact_item* exact, int sinks, int window) {
  static_assert(sizeof(T) == 2, "dense rows are 16-bit");
  const exact_item item = exact[blockIdx.y];
  if (item.slot < 0) return;
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t total = static_cast<std::int64_t>(p.page_size) * 2 * p.num_kv_heads * vectors_per_row;
  const std::byte* page = p.pages + static_cast<std::int64_t>(p.new_pages[blockIdx.y]) * p.page_slot_bytes;
  std::byte* tail = p.tails + static_cast<std::int64_t>(item.slot) * p.tail_slot_bytes;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const detail_extend::row_vector x = detail_extend::decompose(p, i);
    const std::int64_t t = item.first + x.row;
    std::int64_t row;
    if (t < sinks) row = window + t;
    else if (window > 0 && t >= item.window_from) row = window - 1 - (t - sinks) % window;
    else continue;
    const std::int64_t from = detail_extend::row_offset(p, x.is_v, x.head, static_cast<int>(x.row)) + x.vector * 16;
    const std::int64_t to = (static_cast<std::int64_t>(x.is_v) * p.num_kv_heads + x.head) * p.tail_head_bytes +
                            row * p.head_dim * 2 + x.vector * 16;
    *reinterpret_cast<uint4*>(tail + to) = *reinterpret_cast<const uint4*>(page + from);
  }
}

}  // namespace kvmosaic::cuda::kernel
