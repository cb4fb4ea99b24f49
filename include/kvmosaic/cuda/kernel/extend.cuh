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

struct extend_params {
  std::byte* pages;
  std::byte* tails;
  std::int64_t page_slot_bytes;
  std::int64_t page_head_bytes;   ///< dense: page_size * head_dim * sizeof(T), K and V alike
  std::int64_t tail_slot_bytes;
  int num_kv_heads;
  int head_dim;
  int page_size;
  const extend_item* items;
  const std::int32_t* new_pages;
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

/// Byte offset of (K or V, head, row) inside a slot laid out [K heads][V heads] of `head_bytes`.
__device__ __forceinline__ std::int64_t row_offset(const extend_params& p, int is_v, int head, int row) {
  return (static_cast<std::int64_t>(is_v) * p.num_kv_heads + head) * p.page_head_bytes +
         static_cast<std::int64_t>(row) * p.head_dim * 2;  // 16-bit rows
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
    const std::int64_t offset = detail_extend::row_offset(p, x.is_v, x.head, static_cast<int>(x.row)) + x.vector * 16;
    *reinterpret_cast<uint4*>(page + offset) = *reinterpret_cast<const uint4*>(tail + offset);
  }
}

/// Writes each item's input rows (InT: float, half or bfloat16, [rows][heads][head_dim]) to their
/// page or to the tail, as T. Grid: (vectors of the largest item, items).
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
    std::byte* base = page_index < full_pages
                          ? p.pages + static_cast<std::int64_t>(p.new_pages[item.first_new_page + page_index]) * p.page_slot_bytes
                          : p.tails + static_cast<std::int64_t>(item.slot) * p.tail_slot_bytes;
    const InT* src = (is_v ? v : k) +
                     ((item.src_row + r) * p.num_kv_heads + head) * static_cast<std::int64_t>(p.head_dim) +
                     vector * detail::vector_elements;
    alignas(16) T converted[detail::vector_elements];
#pragma unroll
    for (int e = 0; e < detail::vector_elements; ++e) converted[e] = T(to_float(src[e]));
    *reinterpret_cast<uint4*>(base + detail_extend::row_offset(p, is_v, head, row) + vector * 16) =
        *reinterpret_cast<const uint4*>(converted);
  }
}

}  // namespace kvmosaic::cuda::kernel
