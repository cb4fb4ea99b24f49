// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::dense`: uncompressed pages, the baseline every compressed format is measured against.
///
/// A page of one KV head holds `page_size` rows of `head_dim` 16-bit values (the storage dtype),
/// row-major, for K and for V alike: `page_size * head_dim * 2` bytes each, nothing else. This is
/// the layout of vLLM-style paged caches with the KV head as the outer index of a block, so one
/// head's page is one contiguous run of memory. The dense tail of every format uses this layout too.

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/host/eigen.hpp"

namespace kvmosaic {
namespace format {

/// Uncompressed 16-bit K and V rows. Compression ratio 1 by definition. Source: the baseline.
///
/// `sink_tokens` and `recent_tokens` work as in every format (docs/architecture.md, "Exact
/// tokens"): the rows are kept again, exactly, in the sequence's tail slot and their page copies
/// masked. A dense page is exact already, so attention equals plain dense attention; the copies
/// exist so that every format and selector shares one mechanism (a read-less selector never
/// spends its budget on them and always reads them). Cost: sink_tokens + recent_tokens rows per
/// sequence.
struct dense {
  using policy_category = format_tag;
  int sink_tokens = 0;    ///< leading tokens always read (0 to 16)
  int recent_tokens = 0;  ///< latest sealed tokens always read (0 to 1024), besides the tail
};

}  // namespace format

namespace detail {

/// Converts `count` float values (already representable in T) to T.
template <class T>
void store_rows(const float* rows, std::size_t count, std::byte* out) {
  T* typed = reinterpret_cast<T*>(out);
  for (std::size_t i = 0; i < count; ++i) typed[i] = T(rows[i]);
}

template <class T>
void load_rows(const std::byte* in, std::size_t count, float* rows) {
  const T* typed = reinterpret_cast<const T*>(in);
  for (std::size_t i = 0; i < count; ++i) rows[i] = to_float(typed[i]);
}

/// Row-major 16-bit rows <-> float rows, dispatched on the run-time storage dtype.
inline void store_dense_rows(dtype storage, const float* rows, std::size_t count, std::byte* out) {
  if (storage == dtype::f16) store_rows<half>(rows, count, out);
  else store_rows<bfloat16>(rows, count, out);
}
inline void load_dense_rows(dtype storage, const std::byte* in, std::size_t count, float* rows) {
  if (storage == dtype::f16) load_rows<half>(in, count, rows);
  else load_rows<bfloat16>(in, count, rows);
}

/// Per-thread float scratch reused across pages by the host primitives (no allocation per page).
inline std::vector<float>& host_scratch(std::size_t count) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer;
}

}  // namespace detail

template <>
struct format_traits<format::dense> {
  static constexpr const char* name = "dense";

  static std::string describe(const format::dense& f) {
    const std::string exact = detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens);
    return exact.empty() ? "dense" : "dense(" + exact.substr(1) + ")";
  }

  static void validate(const format::dense& f, const page_shape& shape) {
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, "format::dense",
                    "storage", to_string(shape.storage), "f16 or bf16");
    detail::validate_exact_tokens("format::dense", f.sink_tokens, f.recent_tokens);
  }
  static int sink_rows(const format::dense& f) { return f.sink_tokens; }
  static int window_rows(const format::dense& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format::dense&, const page_shape& shape) {
    return static_cast<std::size_t>(shape.page_size) * shape.head_dim * size_of(shape.storage);
  }
  static std::size_t v_page_bytes(const format::dense& f, const page_shape& shape) {
    return k_page_bytes(f, shape);
  }

  static void encode_k(const format::dense&, const page_shape& shape, const float* rows, std::byte* page) {
    detail::store_dense_rows(shape.storage, rows, static_cast<std::size_t>(shape.page_size) * shape.head_dim, page);
  }
  static void encode_v(const format::dense& f, const page_shape& shape, const float* rows, std::byte* page) {
    encode_k(f, shape, rows, page);
  }
  static void decode_k(const format::dense&, const page_shape& shape, const std::byte* page, int n, float* rows) {
    detail::load_dense_rows(shape.storage, page, static_cast<std::size_t>(n) * shape.head_dim, rows);
  }
  static void decode_v(const format::dense& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode_k(f, shape, page, n, rows);
  }

  /// logits[g][t] = q[g] . k[t] for the first n rows of the page. Cost: n*G*D multiply-adds.
  static void score(const format::dense& f, const page_shape& shape, const std::byte* k_page, int n,
                    const float* q, int groups, float* logits) {
    const int d = shape.head_dim;
    std::vector<float>& keys = detail::host_scratch(static_cast<std::size_t>(n) * d);
    decode_k(f, shape, k_page, n, keys.data());
    host::row_matrix_map(logits, groups, n).noalias() =
        host::const_row_matrix_map(q, groups, d) * host::const_row_matrix_map(keys.data(), n, d).transpose();
  }

  /// o[g] += sum_t p[g][t] v[t] for the first n rows of the page. Cost: n*G*D multiply-adds.
  static void accumulate(const format::dense& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    const int d = shape.head_dim;
    std::vector<float>& values = detail::host_scratch(static_cast<std::size_t>(n) * d);
    decode_v(f, shape, v_page, n, values.data());
    host::row_matrix_map(o, groups, d).noalias() +=
        host::const_row_matrix_map(p, groups, n) * host::const_row_matrix_map(values.data(), n, d);
  }
};

namespace detail {
/// Compaction moves format::dense's tokens without changing a stored value: a page holds each
/// token's row as it is.
template <>
struct reencodes_moved_rows<format::dense> : std::false_type {};
}  // namespace detail

}  // namespace kvmosaic
