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
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#  include <emmintrin.h>
#endif

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

/// binary16 bits -> float, the same bits as `half_bits_to_float` for every input (NaN payloads
/// kept), with masks instead of branches so that a loop of it vectorizes: normal values rebias
/// the exponent, infinities and NaN rebias it twice (to 255), subnormals are mantissa x 2^-24
/// (an exact integer conversion and product). Host only; the device converts with __half2float.
inline float half_bits_to_float_select(std::uint16_t h) noexcept {
  const std::uint32_t magnitude = h & 0x7fffu;
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t normal = (magnitude << 13) + 0x38000000u;  // exponent + 112
  const std::uint32_t special = normal + 0x38000000u;             // exponent 31 + 224 = 255
  const std::uint32_t subnormal = float_bits(static_cast<float>(static_cast<std::int32_t>(magnitude)) * 5.9604644775390625e-08f);
  const std::uint32_t is_subnormal = 0u - static_cast<std::uint32_t>(magnitude < 0x0400u);  // all ones or 0
  const std::uint32_t is_special = 0u - static_cast<std::uint32_t>(magnitude >= 0x7c00u);
  const std::uint32_t bits = (subnormal & is_subnormal) | (((special & is_special) | (normal & ~is_special)) & ~is_subnormal);
  return bits_float(bits | sign);
}

template <class T>
void load_rows(const std::byte* in, std::size_t count, float* rows) {
  const T* typed = reinterpret_cast<const T*>(in);
  for (std::size_t i = 0; i < count; ++i) rows[i] = to_float(typed[i]);
}
/// f16 rows. With SSE2 (every x86-64), eight values at a time in 16-bit lanes: a normal value or
/// a zero has the float bits sign | (exponent + 112) << 23 | mantissa << 13 (no exponent added for
/// a zero), whose high half is one add and the low half one shift; a group of eight holding a
/// subnormal, an infinity or a NaN takes the scalar form above. Elsewhere the scalar form, which
/// the compiler vectorizes. Both give `to_float`'s bits.
template <>
inline void load_rows<half>(const std::byte* in, std::size_t count, float* rows) {
  std::size_t i = 0;
#if defined(__SSE2__)
  const __m128i magnitude_mask = _mm_set1_epi16(0x7fff), exponent_mask = _mm_set1_epi16(0x7c00);
  const __m128i sign_mask = _mm_set1_epi16(static_cast<short>(0x8000)), rebias = _mm_set1_epi16(112 << 7);
  const __m128i zero = _mm_setzero_si128();
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    const __m128i magnitude = _mm_and_si128(h, magnitude_mask), exponent = _mm_and_si128(h, exponent_mask);
    const __m128i is_zero = _mm_cmpeq_epi16(magnitude, zero);
    const __m128i special = _mm_or_si128(_mm_andnot_si128(is_zero, _mm_cmpeq_epi16(exponent, zero)),
                                         _mm_cmpeq_epi16(exponent, exponent_mask));
    if (_mm_movemask_epi8(special) != 0) {
      for (std::size_t j = i; j < i + 8; ++j) {
        std::uint16_t bits;
        std::memcpy(&bits, in + 2 * j, 2);
        rows[j] = half_bits_to_float_select(bits);
      }
      continue;
    }
    const __m128i high = _mm_or_si128(_mm_add_epi16(_mm_srli_epi16(magnitude, 3), _mm_andnot_si128(is_zero, rebias)),
                                      _mm_and_si128(h, sign_mask));
    const __m128i low = _mm_slli_epi16(h, 13);  // the mantissa's 3 low bits, at the top of the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows + i), _mm_unpacklo_epi16(low, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rows + i + 4), _mm_unpackhi_epi16(low, high));
  }
#endif
  for (; i < count; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, in + 2 * i, 2);
    rows[i] = half_bits_to_float_select(bits);
  }
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
