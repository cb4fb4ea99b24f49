// SPDX-License-Identifier: Apache-2.0
//
// single_include/kvmosaic/kvmosaic.hpp: kvmosaic as one file.
// kvmosaic's host part: <kvmosaic/kvmosaic.hpp> (every format, selector and compactor, the host
// backend, the fp64 oracle) and <kvmosaic/support/synthetic.hpp> (the synthetic KV generator).
// Needs a C++17 compiler and Eigen 3.3 or newer; no CUDA.
//
// GENERATED FILE: do not edit. Written by scripts/amalgamate.py from the headers in include/
// (each kvmosaic header inlined once, in dependency order); after changing include/, run
//     python3 scripts/amalgamate.py
// and commit the result (CTest single_include_up_to_date checks that it is current).
#pragma once

// ---- begin <kvmosaic/kvmosaic.hpp> ----
/// \file
/// kvmosaic, host part: every format, selector and compactor, the memory manager, the host backend
/// and the fp64 oracle. Compiles with a plain C++17 compiler and Eigen; no CUDA needed.
/// For the CUDA kernels include <kvmosaic/kvmosaic.cuh> instead (it includes this header).

// ---- begin <kvmosaic/core/config.hpp> ----
// kvmosaic: compressed KV-cache structures and decode-attention kernels.

/// \file
/// Library-wide configuration: version, the host/device function qualifiers, and the limits that
/// every part of the library shares (supported head_dim, GQA group sizes, page sizes). Those limits
/// live here, once, so compile-time checks (`static_assert`) and runtime checks (`kvmosaic::error`)
/// state the same allowed values.

#define KVMOSAIC_VERSION_MAJOR 0
#define KVMOSAIC_VERSION_MINOR 1
#define KVMOSAIC_VERSION_PATCH 0
#define KVMOSAIC_VERSION_STRING "0.1.0"

#if defined(__CUDACC__)
/// Marks functions usable from host code and from CUDA device code.
#  define KVMOSAIC_HOST_DEVICE __host__ __device__
#  define KVMOSAIC_DEVICE __device__
#  define KVMOSAIC_FORCEINLINE __forceinline__
#else
#  define KVMOSAIC_HOST_DEVICE
#  define KVMOSAIC_DEVICE
#  define KVMOSAIC_FORCEINLINE inline
#endif

#if defined(__CUDA_ARCH__)
#  define KVMOSAIC_IS_DEVICE_CODE 1
#else
#  define KVMOSAIC_IS_DEVICE_CODE 0
#endif

namespace kvmosaic {

/// The library version as "major.minor.patch".
inline const char* version_string() noexcept { return KVMOSAIC_VERSION_STRING; }

/// Shape limits every format, selector and kernel supports. A kernel specialized on a shape checks it
/// with `static_assert` against these predicates; a cache configured at run time checks it with a
/// `kvmosaic::error` naming the parameter. Both print the same allowed values.
namespace limits {

/// head_dim values with kernels: 64, 128 and 256 (the head sizes of current open models).
constexpr bool is_supported_head_dim(int head_dim) noexcept {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
constexpr const char* supported_head_dims = "64, 128 or 256";

/// Query heads per KV head (GQA group size), 1 (MHA) to 8.
constexpr int max_group_size = 8;
constexpr bool is_supported_group_size(int group_size) noexcept {
  return group_size >= 1 && group_size <= max_group_size;
}
constexpr const char* supported_group_sizes = "1 to 8";

/// Tokens per page: a positive multiple of 16 (the MMA tile height), at most 1024.
constexpr int page_size_multiple = 16;
constexpr int max_page_size = 1024;
constexpr int default_page_size = 64;
constexpr bool is_supported_page_size(int page_size) noexcept {
  return page_size > 0 && page_size <= max_page_size && page_size % page_size_multiple == 0;
}
constexpr const char* supported_page_sizes = "a multiple of 16 from 16 to 1024";

/// Capacity limits of one cache: every byte count derived from them (pool and tail arenas,
/// per-step metadata) fits in 64 bits and every index the kernels compute fits in their integer
/// types, so a configuration inside them fails, if at all, with a `kvmosaic::error` from an
/// allocation that cannot be served, never with an overflow.
constexpr int max_kv_heads = 1024;            ///< KV heads of one layer
constexpr int max_pool_pages = 1 << 24;       ///< pages in one pool (16M pages of up to 1024 tokens)
constexpr int max_sequences = 1 << 20;        ///< live sequences (tail slots) of one cache

}  // namespace limits
}  // namespace kvmosaic
// ---- end <kvmosaic/core/config.hpp> ----

// ---- begin <kvmosaic/core/dtype.hpp> ----
/// \file
/// 16-bit storage types usable from plain C++17 host code and from CUDA device code.
///
/// `kvmosaic::half` (IEEE binary16) and `kvmosaic::bfloat16` are 2-byte trivially copyable
/// structs with the same bit layout as CUDA's `__half` and `__nv_bfloat16`, so a kernel may
/// reinterpret a page of them as `__half2`/`__nv_bfloat162` for vector math, while a host-only
/// build (no CUDA toolkit) uses the same types and bytes. Conversions from float round to nearest,
/// ties to even, in both the host and the device path, so host and device encode identical bytes.
///
/// Values outside the storage range saturate: a finite float whose magnitude rounds beyond the
/// largest finite value of the type (f16: 65504, about 65520 and up; bf16: 3.3895e38, about
/// 3.3961e38 and up) is stored as that value with its sign, never as infinity. Infinities and NaN
/// stay infinities and NaN. So a finite input always stores as a finite value (a dense f16 cache
/// fed 1e5 stores 65504), on the host and on the device alike: the CUDA kernels convert through
/// these same types. (Why saturate rather than reject: the cache would have to scan every value of
/// every call, on the host, before storing; and an activation that large is an outlier whose
/// clipped value keeps attention finite where infinity would turn it into NaN.)

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>


#if defined(__CUDACC__)
#  include <cuda_bf16.h>
#  include <cuda_fp16.h>
#endif

namespace kvmosaic {

/// Storage dtype tag used by run-time configuration.
enum class dtype : std::uint8_t { f16, bf16, f32 };

/// Human-readable name of a dtype ("f16", "bf16", "f32").
inline const char* to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::f32: return "f32";
  }
  return "?";
}

namespace detail {

KVMOSAIC_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

KVMOSAIC_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/// float -> binary16, round to nearest even, with gradual underflow; a finite value beyond the
/// range saturates to +-65504 (0x7bff), infinities and NaN stay so.
KVMOSAIC_HOST_DEVICE inline std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan: keep nan quiet and non-zero
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7bffu);  // would round to >= 65520: saturate
  if (abs < 0x38800000u) {                                                      // below 2^-14: subnormal
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);             // below 2^-25: zero
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x007fffffu) | 0x00800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24 bits to drop
    const std::uint32_t kept = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    const std::uint32_t rounded = kept + ((rest > halfway || (rest == halfway && (kept & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // normal: rebias exponent, round the 13 dropped mantissa bits to nearest even
  const std::uint32_t rebased = abs - 0x38000000u;
  const std::uint32_t rounded = rebased + 0x0fffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

KVMOSAIC_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x03ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // subnormal: value = mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// float -> bfloat16, round to nearest even; a finite value beyond the range saturates to
/// +-3.3895e38 (0x7f7f), infinities stay infinities, nan stays nan.
KVMOSAIC_HOST_DEVICE inline std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  if ((x & 0x7fffffffu) == 0x7f800000u) return static_cast<std::uint16_t>(x >> 16);
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  const auto bits = static_cast<std::uint16_t>(rounded >> 16);
  return (bits & 0x7fffu) == 0x7f80u ? static_cast<std::uint16_t>((bits & 0x8000u) | 0x7f7fu) : bits;
}

/// 16-bit storage bits `rounded` (the device's round-to-nearest conversion of `f`), with the
/// saturation above: infinity from a finite `f` becomes the largest finite value `max_bits`.
KVMOSAIC_HOST_DEVICE inline std::uint16_t saturate_bits(std::uint16_t rounded, float f, std::uint16_t infinity_bits,
                                                        std::uint16_t max_bits) noexcept {
  const bool finite = (float_bits(f) & 0x7fffffffu) < 0x7f800000u;
  return finite && (rounded & 0x7fffu) == infinity_bits
             ? static_cast<std::uint16_t>((rounded & 0x8000u) | max_bits)
             : rounded;
}

KVMOSAIC_HOST_DEVICE inline float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE 754 binary16 storage value (1 sign, 5 exponent, 10 mantissa bits). Arithmetic is done in
/// float: convert with `static_cast<float>` or `kvmosaic::to_float`.
struct alignas(2) half {
  std::uint16_t bits;

  half() = default;
  KVMOSAIC_HOST_DEVICE explicit half(float f) noexcept : bits(from_float(f)) {}
  KVMOSAIC_HOST_DEVICE explicit operator float() const noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
    return __half2float(__ushort_as_half(bits));
#else
    return detail::half_bits_to_float(bits);
#endif
  }
  KVMOSAIC_HOST_DEVICE static half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }

 private:
  KVMOSAIC_HOST_DEVICE static std::uint16_t from_float(float f) noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
    return detail::saturate_bits(__half_as_ushort(__float2half_rn(f)), f, 0x7c00u, 0x7bffu);
#else
    return detail::float_to_half_bits(f);
#endif
  }
};

/// bfloat16 storage value (1 sign, 8 exponent, 7 mantissa bits): float's range, 8 bits of precision.
struct alignas(2) bfloat16 {
  std::uint16_t bits;

  bfloat16() = default;
  KVMOSAIC_HOST_DEVICE explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  KVMOSAIC_HOST_DEVICE explicit operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits);
  }
  KVMOSAIC_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }

 private:
  KVMOSAIC_HOST_DEVICE static std::uint16_t from_float(float f) noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
    return detail::saturate_bits(__bfloat16_as_ushort(__float2bfloat16_rn(f)), f, 0x7f80u, 0x7f7fu);
#else
    return detail::float_to_bfloat16_bits(f);
#endif
  }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types must be 2 bytes");

/// Widening conversion used throughout the kernels and the host backend.
KVMOSAIC_HOST_DEVICE inline float to_float(half h) noexcept { return static_cast<float>(h); }
KVMOSAIC_HOST_DEVICE inline float to_float(bfloat16 b) noexcept { return static_cast<float>(b); }
KVMOSAIC_HOST_DEVICE inline float to_float(float f) noexcept { return f; }

/// Compile-time facts about a storage element type.
/// `unit_roundoff` is u = 2^-p for p significand bits: round-to-nearest changes a value x in the
/// normal range by at most u*|x|. `min_normal` bounds the absolute error below it (half the
/// subnormal spacing). Tests derive their tolerances from these numbers.
template <class T>
struct dtype_traits {
  static_assert(sizeof(T) == 0,
                "kvmosaic: storage element type must be kvmosaic::half, kvmosaic::bfloat16 or float");
};
template <>
struct dtype_traits<half> {
  static constexpr dtype id = dtype::f16;
  static constexpr double unit_roundoff = 1.0 / 2048.0;             // 2^-11
  static constexpr double subnormal_half_spacing = 2.98023223876953125e-08;  // 2^-25
  static constexpr double max_finite = 65504.0;
};
template <>
struct dtype_traits<bfloat16> {
  static constexpr dtype id = dtype::bf16;
  static constexpr double unit_roundoff = 1.0 / 256.0;  // 2^-8
  static constexpr double subnormal_half_spacing = 4.591774807899561e-41;  // 2^-134
  static constexpr double max_finite = 3.3895313892515355e38;
};
template <>
struct dtype_traits<float> {
  static constexpr dtype id = dtype::f32;
  static constexpr double unit_roundoff = 5.9604644775390625e-08;  // 2^-24
  static constexpr double subnormal_half_spacing = 7.006492321624085e-46;  // 2^-150
  static constexpr double max_finite = 3.4028234663852886e38;
};

namespace detail {

/// Bits of `x` in the 16-bit storage dtype `t` (f16 or bf16), round to nearest even, saturating.
KVMOSAIC_HOST_DEVICE inline std::uint16_t storage_bits(float x, dtype t) noexcept {
  return t == dtype::f16 ? half(x).bits : bfloat16(x).bits;
}

/// The value of 16-bit storage bits `b` of dtype `t` (f16 or bf16).
KVMOSAIC_HOST_DEVICE inline float storage_value(std::uint16_t b, dtype t) noexcept {
  return t == dtype::f16 ? to_float(half::from_bits(b)) : to_float(bfloat16::from_bits(b));
}

/// The largest finite value of the 16-bit storage dtype `t` (f16: 65504, bf16: 3.3895e38).
KVMOSAIC_HOST_DEVICE inline float storage_max(dtype t) noexcept {
  return storage_value(t == dtype::f16 ? std::uint16_t{0x7bffu} : std::uint16_t{0x7f7fu}, t);
}

/// The neighbours of a finite 16-bit storage value (both formats are sign and magnitude, so a
/// step of the magnitude bits is one ulp): the next value toward +infinity and toward
/// -infinity (from +-0: the smallest subnormal of that sign). The caller keeps off the largest
/// finite magnitude, whose next step out is infinity.
KVMOSAIC_HOST_DEVICE inline std::uint16_t storage_next_up(std::uint16_t b) noexcept {
  if ((b & 0x7fffu) == 0) return 0x0001u;
  return static_cast<std::uint16_t>((b & 0x8000u) ? b - 1u : b + 1u);
}
KVMOSAIC_HOST_DEVICE inline std::uint16_t storage_next_down(std::uint16_t b) noexcept {
  if ((b & 0x7fffu) == 0) return 0x8001u;
  return static_cast<std::uint16_t>((b & 0x8000u) ? b + 1u : b - 1u);
}

/// `x` (finite, within +-storage_max(t)) rounded toward -infinity / +infinity to dtype `t`: the
/// largest storage value <= x / the smallest >= x.
KVMOSAIC_HOST_DEVICE inline std::uint16_t storage_bits_down(float x, dtype t) noexcept {
  const std::uint16_t b = storage_bits(x, t);
  return storage_value(b, t) > x ? storage_next_down(b) : b;
}
KVMOSAIC_HOST_DEVICE inline std::uint16_t storage_bits_up(float x, dtype t) noexcept {
  const std::uint16_t b = storage_bits(x, t);
  return storage_value(b, t) < x ? storage_next_up(b) : b;
}

}  // namespace detail

namespace detail {
/// The element types attention reads and writes (q, out): float, half and bfloat16.
template <class T>
struct is_io_type : std::integral_constant<bool, std::is_same<T, float>::value || std::is_same<T, half>::value ||
                                                     std::is_same<T, bfloat16>::value> {};
}  // namespace detail

/// Size in bytes of one element of a run-time dtype.
constexpr std::size_t size_of(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

/// Unit roundoff of a run-time dtype (see dtype_traits).
constexpr double unit_roundoff(dtype t) noexcept {
  return t == dtype::f16 ? dtype_traits<half>::unit_roundoff
                         : t == dtype::bf16 ? dtype_traits<bfloat16>::unit_roundoff
                                            : dtype_traits<float>::unit_roundoff;
}

}  // namespace kvmosaic
// ---- end <kvmosaic/core/dtype.hpp> ----

// ---- begin <kvmosaic/core/error.hpp> ----
/// \file
/// Errors. Every check on user input throws a `kvmosaic::error` whose message names the operation,
/// the parameter, the value it got and the values it allows, e.g.
/// `kvmosaic: cache_config: head_dim = 96; allowed: 64, 128 or 256`. Checks happen before any state
/// changes, and a failure after the writes began is rolled back, so a throwing call leaves the
/// cache exactly as it was (no token half-stored, no page leaked). Device code never throws;
/// everything a kernel relies on is checked on the host first.

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvmosaic {

/// Base of all kvmosaic exceptions; `parameter()` names the offending argument.
class error : public std::runtime_error {
 public:
  error(std::string parameter, const std::string& message)
      : std::runtime_error(message), parameter_(std::move(parameter)) {}
  const std::string& parameter() const noexcept { return parameter_; }

 private:
  std::string parameter_;
};

/// A parameter outside its allowed values.
class invalid_argument : public error {
 public:
  using error::error;
};

/// A fixed-size resource (page pool, sequence slots) cannot hold what was asked; nothing was changed.
class capacity_error : public error {
 public:
  using error::error;
};

namespace detail {

/// A value as text for a message: integers and strings as they are, floating-point values as
/// `%g` prints them (what a default `std::ostream` prints). Numbers and strings are formatted
/// without iostreams, so messages are the same, and building them is safe, in a process whose
/// other libraries install their own locale facets (seen with PyTorch extensions); other types
/// fall back to `operator<<`.
inline std::string to_text(const std::string& value) { return value; }
inline std::string to_text(const char* value) { return value != nullptr ? std::string(value) : std::string("(null)"); }
inline std::string to_text(bool value) { return value ? "1" : "0"; }
inline std::string to_text(char value) { return std::string(1, value); }
template <class Value>
std::enable_if_t<std::is_integral<Value>::value, std::string> to_text(Value value) {
  return std::to_string(value);
}
template <class Value>
std::enable_if_t<std::is_floating_point<Value>::value, std::string> to_text(Value value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
  return text;
}
template <class Value>
std::enable_if_t<!std::is_arithmetic<Value>::value && !std::is_convertible<const Value&, std::string>::value, std::string>
to_text(const Value& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

template <class Value>
std::string describe(const char* where, const char* parameter, const Value& value, const char* allowed) {
  return std::string("kvmosaic: ") + where + ": " + parameter + " = " + to_text(value) + "; allowed: " + allowed;
}

/// Throws `invalid_argument` naming `parameter`, its `value` and the `allowed` values unless `ok`.
template <class Value>
void require(bool ok, const char* where, const char* parameter, const Value& value, const char* allowed) {
  if (!ok) throw invalid_argument(parameter, describe(where, parameter, value, allowed));
}

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/core/error.hpp> ----

// ---- begin <kvmosaic/core/policy.hpp> ----
/// \file
/// Policy categories. Each policy struct (a format, a selector, a compactor) declares which kind of
/// policy it is with a member `using policy_category = kvmosaic::format_tag;` (or `selector_tag`,
/// `compactor_tag`). The composition checks the category of each template argument first, so a
/// misplaced or foreign type is rejected with one sentence rather than a page of template errors.


namespace kvmosaic {

struct format_tag {};     ///< how one page of K and V is stored
struct selector_tag {};   ///< which tokens a query reads (or which the cache keeps)
struct compactor_tag {};  ///< how evicted tokens turn into freed pages
struct backend_tag {};    ///< where the data lives and the kernels run (host or cuda)

namespace detail {
/// Maps (Backend, Format, Selector) to the backend's engine type; each backend specializes it.
template <class Backend, class Format, class Selector>
struct engine_for {
  static_assert(sizeof(Backend) == 0,
                "kvmosaic: no engine for this backend: include kvmosaic/kvmosaic.cuh for backend::cuda");
};

template <class T, class Category, class = void>
struct has_policy_category : std::false_type {};
template <class T, class Category>
struct has_policy_category<T, Category, std::void_t<typename T::policy_category>>
    : std::is_same<typename T::policy_category, Category> {};
}  // namespace detail

/// True when `T` is a storage format, a selector, a compactor, a backend.
template <class T>
inline constexpr bool is_format_v = detail::has_policy_category<T, format_tag>::value;
template <class T>
inline constexpr bool is_selector_v = detail::has_policy_category<T, selector_tag>::value;
template <class T>
inline constexpr bool is_compactor_v = detail::has_policy_category<T, compactor_tag>::value;
template <class T>
inline constexpr bool is_backend_v = detail::has_policy_category<T, backend_tag>::value;

}  // namespace kvmosaic
// ---- end <kvmosaic/core/policy.hpp> ----

// ---- begin <kvmosaic/core/softmax_state.hpp> ----
/// \file
/// The online-softmax state `(m, l, o)` and its merge: the one piece of arithmetic that every
/// attend path (host or device, any format, any split) shares.
///
/// For logits s_i over a subset of tokens with values v_i:
///   m = max_i s_i,   l = sum_i exp(s_i - m),   o = sum_i exp(s_i - m) v_i   (o unnormalized).
/// Two states over disjoint subsets merge exactly (flash-decoding):
///   m = max(m_a, m_b),  l = l_a e^{m_a-m} + l_b e^{m_b-m},  o = o_a e^{m_a-m} + o_b e^{m_b-m},
/// and attention over the union is o / l. The empty subset is m = -inf, l = 0, o = 0, and merges as
/// the identity. Source: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018);
/// Dao et al., flash-decoding (2023).

#include <cmath>


namespace kvmosaic {

namespace detail {
KVMOSAIC_HOST_DEVICE KVMOSAIC_FORCEINLINE float exp_(float x) noexcept {
#if KVMOSAIC_IS_DEVICE_CODE
  return __expf(x);
#else
  return std::exp(x);
#endif
}
KVMOSAIC_HOST_DEVICE KVMOSAIC_FORCEINLINE double exp_(double x) noexcept { return ::exp(x); }
/// -infinity of Acc, usable in device code (std::numeric_limits is host-only under nvcc).
template <class Acc>
KVMOSAIC_HOST_DEVICE KVMOSAIC_FORCEINLINE constexpr Acc negative_infinity() noexcept {
  return -static_cast<Acc>(HUGE_VALF);
}
}  // namespace detail

/// The two factors that rescale the `o` accumulators of a merge: o = a * o_self + b * o_other.
template <class Acc>
struct merge_weights {
  Acc self;
  Acc other;
};

/// The scalar part `(m, l)` of an online-softmax state; the caller keeps `o` (a vector per query
/// head, possibly spread over threads) and rescales it with the weights each update returns.
/// Cost: one exp per merged block, one exp per pushed logit.
template <class Acc = float>
struct softmax_state {
  Acc m = detail::negative_infinity<Acc>();  ///< running maximum logit
  Acc l = Acc(0);                                 ///< running sum of exp(s - m)

  /// True when no token has been folded in yet.
  KVMOSAIC_HOST_DEVICE bool empty() const noexcept { return l == Acc(0); }

  /// Folds another state over a disjoint set of tokens into this one and returns the factors that
  /// rescale the two `o` accumulators.
  KVMOSAIC_HOST_DEVICE merge_weights<Acc> merge(const softmax_state& other) noexcept {
    const Acc new_m = m > other.m ? m : other.m;
    if (new_m == detail::negative_infinity<Acc>()) return {Acc(0), Acc(0)};  // both empty
    const Acc w_self = m == detail::negative_infinity<Acc>() ? Acc(0) : detail::exp_(m - new_m);
    const Acc w_other =
        other.m == detail::negative_infinity<Acc>() ? Acc(0) : detail::exp_(other.m - new_m);
    m = new_m;
    l = l * w_self + other.l * w_other;
    return {w_self, w_other};
  }

  /// Folds one logit `s` in; `o` must become `o * w.self + v * w.other`.
  KVMOSAIC_HOST_DEVICE merge_weights<Acc> push(Acc s) noexcept {
    softmax_state single;
    single.m = s;
    single.l = Acc(1);
    return merge(single);
  }

  /// log-sum-exp of the logits folded so far (the `lse` that FlashInfer-style merges carry).
  KVMOSAIC_HOST_DEVICE Acc log_sum_exp() const noexcept {
    return empty() ? detail::negative_infinity<Acc>() : m + static_cast<Acc>(::log(l));
  }
};

/// Merges `(m_b, l_b, o_b)` into `(m_a, l_a, o_a)` for vectors of length `n` (any indexable type).
template <class Acc, class VecA, class VecB>
KVMOSAIC_HOST_DEVICE void merge_into(softmax_state<Acc>& a, VecA& o_a, const softmax_state<Acc>& b,
                                     const VecB& o_b, int n) noexcept {
  const merge_weights<Acc> w = a.merge(b);
  for (int i = 0; i < n; ++i) o_a[i] = o_a[i] * w.self + o_b[i] * w.other;
}

}  // namespace kvmosaic
// ---- end <kvmosaic/core/softmax_state.hpp> ----

// ---- begin <kvmosaic/core/view.hpp> ----
/// \file
/// Non-owning views over caller-owned memory (host or device). A view is a pointer plus extents
/// and strides in elements; it never allocates or frees, and it is trivially copyable so it can be
/// passed to a kernel by value. `tensor_view<T, Rank>` is a minimal, C++17 stand-in for
/// `std::mdspan` with a right-most-contiguous default layout.



namespace kvmosaic {

/// A strided view of `Rank` dimensions over elements of `T`. Index with `view(i, j, ...)`.
/// Cost: an index is a dot product of the indices with the strides; no bounds checks.
template <class T, int Rank>
class tensor_view {
  static_assert(Rank >= 1 && Rank <= 4, "kvmosaic: tensor_view Rank must be 1 to 4");

 public:
  using element_type = T;
  static constexpr int rank = Rank;

  tensor_view() = default;

  /// A contiguous (row-major) view: the last extent varies fastest.
  template <class... Extents, class = std::enable_if_t<sizeof...(Extents) == Rank>>
  KVMOSAIC_HOST_DEVICE tensor_view(T* data, Extents... extents) noexcept : data_(data) {
    const std::int64_t list[] = {static_cast<std::int64_t>(extents)...};
    std::int64_t stride = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      extents_[d] = list[d];
      strides_[d] = stride;
      if (d > 0) stride *= list[d];  // the outermost extent is never multiplied: any int64 count fits
    }
  }

  /// A view with explicit strides (in elements).
  KVMOSAIC_HOST_DEVICE static tensor_view strided(T* data, const std::int64_t (&extents)[Rank],
                                                  const std::int64_t (&strides)[Rank]) noexcept {
    tensor_view v;
    v.data_ = data;
    for (int d = 0; d < Rank; ++d) {
      v.extents_[d] = extents[d];
      v.strides_[d] = strides[d];
    }
    return v;
  }

  /// Views of `T` convert to views of `const T`.
  template <class U, class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_same<U, T>::value>>
  KVMOSAIC_HOST_DEVICE tensor_view(const tensor_view<U, Rank>& other) noexcept : data_(other.data()) {
    for (int d = 0; d < Rank; ++d) {
      extents_[d] = other.extent(d);
      strides_[d] = other.stride(d);
    }
  }

  KVMOSAIC_HOST_DEVICE T* data() const noexcept { return data_; }
  KVMOSAIC_HOST_DEVICE std::int64_t extent(int d) const noexcept { return extents_[d]; }
  KVMOSAIC_HOST_DEVICE std::int64_t stride(int d) const noexcept { return strides_[d]; }
  KVMOSAIC_HOST_DEVICE std::int64_t size() const noexcept {
    std::int64_t n = 1;
    for (int d = 0; d < Rank; ++d) n *= extents_[d];
    return n;
  }
  KVMOSAIC_HOST_DEVICE bool empty() const noexcept { return size() == 0; }

  /// True when the elements are packed row-major with no gaps.
  KVMOSAIC_HOST_DEVICE bool is_contiguous() const noexcept {
    std::int64_t stride = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      if (extents_[d] != 1 && strides_[d] != stride) return false;
      stride *= extents_[d];
    }
    return true;
  }

  template <class... Indices, class = std::enable_if_t<sizeof...(Indices) == Rank>>
  KVMOSAIC_HOST_DEVICE T& operator()(Indices... indices) const noexcept {
    const std::int64_t list[] = {static_cast<std::int64_t>(indices)...};
    std::int64_t offset = 0;
    for (int d = 0; d < Rank; ++d) offset += list[d] * strides_[d];
    return data_[offset];
  }

 private:
  T* data_ = nullptr;
  std::int64_t extents_[Rank] = {};
  std::int64_t strides_[Rank] = {};
};

/// A contiguous one-dimensional view.
template <class T>
using span = tensor_view<T, 1>;

namespace detail {

/// Whether two views can reach a common byte: their address ranges (from the lowest to the
/// highest element their extents and strides reach) intersect. Conservative for interleaved
/// strided views; exact for contiguous ones. Cost: O(Rank).
template <class A, int RankA, class B, int RankB>
bool views_overlap(const tensor_view<A, RankA>& a, const tensor_view<B, RankB>& b) noexcept {
  const auto range = [](const auto& v, std::uintptr_t& lo, std::uintptr_t& hi) {
    using E = std::remove_pointer_t<decltype(v.data())>;
    std::int64_t first = 0, last = 0;  // element offsets
    for (int d = 0; d < std::decay_t<decltype(v)>::rank; ++d) {
      if (v.extent(d) == 0) return false;
      const std::int64_t reach = (v.extent(d) - 1) * v.stride(d);
      (reach < 0 ? first : last) += reach;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(v.data());
    lo = base + static_cast<std::uintptr_t>(first * static_cast<std::int64_t>(sizeof(E)));
    hi = base + static_cast<std::uintptr_t>((last + 1) * static_cast<std::int64_t>(sizeof(E)));
    return true;
  };
  std::uintptr_t a_lo = 0, a_hi = 0, b_lo = 0, b_hi = 0;
  if (!range(a, a_lo, a_hi) || !range(b, b_lo, b_hi)) return false;
  return a_lo < b_hi && b_lo < a_hi;
}

}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/core/view.hpp> ----

// ---- begin <kvmosaic/format/format_traits.hpp> ----
/// \file
/// What a storage format is, and what it must provide.
///
/// A format is a small policy struct in `kvmosaic::format` (e.g. `format::dense`) that carries its
/// own parameters (a sparsity, a partition size) and declares `using policy_category = format_tag;`. Everything the library does with a format goes
/// through `kvmosaic::format_traits<Format>`, which a format specializes. The unspecialized primary
/// template is a `static_assert`, so using a type that is not a format fails with one sentence.
///
/// A specialization provides (see `format/dense.hpp` for the reference implementation):
///
///   static constexpr const char* name;                  // "dense", "bitmap_tiles", ...
///   static std::string describe(const Format&);         // name plus parameters, for reports
///   static void validate(const Format&, const page_shape&);  // throws kvmosaic::invalid_argument
///   // Exact byte accounting: bytes of one page (page_size tokens) of one KV head, everything
///   // counted (values, bitmaps, offsets, scales, sums, padding).
///   static std::size_t k_page_bytes(const Format&, const page_shape&);
///   static std::size_t v_page_bytes(const Format&, const page_shape&);
///   // Host reference, rows are float values already rounded to the storage dtype, [n][head_dim]:
///   static void encode_k(const Format&, const page_shape&, const float* rows, std::byte* page);
///   static void encode_v(const Format&, const page_shape&, const float* rows, std::byte* page);
///   static void decode_k(const Format&, const page_shape&, const std::byte* page, int n, float* rows);
///   static void decode_v(const Format&, const page_shape&, const std::byte* page, int n, float* rows);
///   // Host attend primitives on the stored form, for the first n tokens of a page and the G query
///   // heads of one KV head (q already multiplied by the softmax scale):
///   static void score(const Format&, const page_shape&, const std::byte* k_page, int n,
///                     const float* q /*[G][D]*/, int G, float* logits /*[G][n]*/);
///   static void accumulate(const Format&, const page_shape&, const std::byte* v_page, int n,
///                          const float* p /*[G][n]*/, int G, float* o /*[G][D], += */);
///
/// Optional: a format whose K pruning can weigh channels (output-aware scores) declares
///   static constexpr bool has_key_weights = true;
///   static void encode_k(const Format&, const page_shape&, const float* rows, const float* weights
///                        /*[head_dim] or null*/, std::byte* page);
/// and `cache::set_key_weights` becomes available for it.
///
/// Optional: a format whose pages are stored in a basis of their own segment (a run of
/// `segment_pages` pages of one sequence; format::packed_bitmap) declares
///   static constexpr bool has_segments = true;
///   using segment = ...;  // what one KV head's pages of a segment share (bases, strategy)
///   static int segment_pages(const Format&, const page_shape&);
///   static int basis_dim(const Format&, const page_shape&);      // channels of the segment space
///   static std::size_t segment_bytes(const Format&, const page_shape&);  // per segment, KV head
///   static segment plan_segment(const Format&, const page_shape&, const float* k, const float* v,
///                               std::int64_t n);                 // fit to a segment's rows
///   static void enter_segment(const Format&, const page_shape&, const segment&, const float* q,
///                             int G, float* q_basis /*[G][basis_dim]*/);
///   static void leave_segment(const Format&, const page_shape&, const segment&,
///                             const float* o_basis /*[G][basis_dim]*/, int G, float* o /*[G][D]*/);
/// and takes `const segment&` after the shape in encode_k/v, decode_k/v, score and accumulate,
/// whose queries and outputs are in the segment's space. The host engine keeps the segments per
/// sequence (planned when a segment's first page is sealed, from the rows it has of that segment),
/// folds each segment's pages into a state of its own and merges it back after `leave_segment`.
///
/// A format with segments may plan them from sums of their rows in one order that every backend
/// follows (so that a device can compute the sums and the host only the rest), declaring
///   static std::size_t segment_sum_count(const Format&, const page_shape&);  // doubles a segment
///   static constexpr int segment_sum_tile_rows;    // rows a tile's sums run over from zero
///   static void segment_sums(const Format&, const page_shape&, const float* k, const float* v,
///                            std::int64_t n, double* out);  // the tiles' sums added in order
///   static bool plan_reads_rows(const Format&);     // the plan needs the rows besides their sums
///   static segment plan_segment_from_sums(const Format&, const page_shape&, const double* sums,
///                                         std::int64_t n, const float* k, const float* v);
/// and the device part computes the sums itself (cuda/format/device_format.cuh).
///
/// Optional, for a format with segments: block keys in the format's own compressed space (the
/// mean key of a block of tokens, which `select::mean_keys` scores; MosaicKV's per-block keys,
/// channel-compressed with the keys) declares
///   static constexpr bool has_block_keys = true;
///   static std::size_t block_key_bytes(const Format&, const page_shape&);   // one block, KV head
///   static int block_key_values(const Format&, const page_shape&);          // N, the pairs it holds
///   static void encode_block_key(const Format&, const page_shape&, const segment&,
///                                const float* mean /*[D], fp32*/, std::byte* key);
///   static void block_key_query(const Format&, const page_shape&, const segment&, const float* q,
///                               int G, float* q_key /*[G][basis_dim]*/);
///   static float score_block_key(const Format&, const page_shape&, const float* q_key /*[basis_dim]*/,
///                                const std::byte* key);
/// in one fp32 order that every backend follows; the engines then keep those instead of 16-bit
/// dense mean rows. A block key is N (channel, value) pairs of the segment's rotated space laid
/// out as `block_key_layout` says, and scored as q'[channel] x value summed over the pairs in
/// their stored order by fused multiply-adds from 0: one thread's chain, the order the CUDA
/// engine's generic scoring kernel follows (`score_block_keys_kernel`, a thread per key).
///
/// Encoding always sees complete pages (page_size tokens): partial pages stay in the dense tail.
/// The CUDA parts (device encode, block-level attend collectives) are specialized in
/// `kvmosaic/cuda/` on the same tag.


namespace kvmosaic {

/// Geometry of one page of one KV head: what every format's byte accounting depends on.
struct page_shape {
  int page_size = 64;       ///< tokens per page
  int head_dim = 128;       ///< channels per head
  dtype storage = dtype::bf16;  ///< 16-bit element type of uncompressed values
};

template <class Format>
struct format_traits {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this type is not a storage format: use one of kvmosaic::format::dense, or "
                "specialize kvmosaic::format_traits<YourFormat> as described in "
                "kvmosaic/format/format_traits.hpp");
};

namespace detail {
/// format_traits<Format>::has_key_weights, false when a format does not declare it.
template <class Traits, class = void>
struct key_weights_of {
  static constexpr bool value = false;
};
template <class Traits>
struct key_weights_of<Traits, std::void_t<decltype(Traits::has_key_weights)>> {
  static constexpr bool value = Traits::has_key_weights;
};

/// format_traits<Format>::has_segments, false when a format does not declare it.
template <class Traits, class = void>
struct segments_of {
  static constexpr bool value = false;
};
template <class Traits>
struct segments_of<Traits, std::void_t<decltype(Traits::has_segments)>> {
  static constexpr bool value = Traits::has_segments;
};
}  // namespace detail

/// True when a format stores its pages in per-segment bases (`format_traits::has_segments`).
template <class Format>
inline constexpr bool has_segments_v = detail::segments_of<format_traits<Format>>::value;

namespace detail {
/// format_traits<Format>::segment_sum_count exists (a format with segments whose plan is made
/// of sums a device may compute: `plan_segment_from_sums`).
template <class Traits, class = void>
struct segment_sums_of : std::false_type {};
template <class Traits>
struct segment_sums_of<Traits, std::void_t<decltype(&Traits::segment_sum_count)>> : std::true_type {};
}  // namespace detail

/// True when a format with segments plans them from sums of their rows that a device may compute
/// (`format_traits::segment_sums`, `plan_segment_from_sums`).
template <class Format>
inline constexpr bool has_segment_sums_v = has_segments_v<Format> && detail::segment_sums_of<format_traits<Format>>::value;

namespace detail {
/// format_traits<Format>::segment_search_sum_count exists (a format whose plan reads rows, from
/// sums of them a device may compute: `search_segment_from_sums`).
template <class Traits, class = void>
struct segment_search_sums_of : std::false_type {};
template <class Traits>
struct segment_search_sums_of<Traits, std::void_t<decltype(&Traits::segment_search_sum_count)>> : std::true_type {};
}  // namespace detail

/// True when a format planned from sums (`has_segment_sums_v`) makes the part of its plan that
/// reads rows from other sums of them that a device may compute (`format_traits::
/// segment_search_sum_count`, `search_segment_from_sums`).
template <class Format>
inline constexpr bool has_segment_search_sums_v = has_segment_sums_v<Format> && detail::segment_search_sums_of<format_traits<Format>>::value;

namespace detail {
/// The segment type of a format with segments; an empty struct for the others.
struct no_segment {};
template <class Format, bool = has_segments_v<Format>>
struct segment_type {
  using type = no_segment;
};
template <class Format>
struct segment_type<Format, true> {
  using type = typename format_traits<Format>::segment;
};
}  // namespace detail

namespace detail {
/// format_traits<Format>::has_block_keys, false when a format does not declare it.
template <class Traits, class = void>
struct block_keys_of {
  static constexpr bool value = false;
};
template <class Traits>
struct block_keys_of<Traits, std::void_t<decltype(Traits::has_block_keys)>> {
  static constexpr bool value = Traits::has_block_keys;
};
}  // namespace detail

/// Where a block key's parts lie (formats with `has_block_keys`): its N 8-bit channel indices
/// from byte 0, padded to 16 bytes, then its N values in the storage dtype, padded to 16 bytes,
/// so that both parts are 16-byte aligned and a reader loads 8 pairs by two vector loads.
struct block_key_layout {
  int values;  ///< N, the (channel, value) pairs
  KVMOSAIC_HOST_DEVICE constexpr int values_offset() const noexcept { return (values + 15) / 16 * 16; }
  KVMOSAIC_HOST_DEVICE constexpr int bytes() const noexcept { return values_offset() + (2 * values + 15) / 16 * 16; }
};

/// True when a format keeps the mean key of a block in its own compressed space
/// (`format_traits::has_block_keys`).
template <class Format>
inline constexpr bool has_block_keys_v = detail::block_keys_of<format_traits<Format>>::value;

/// True when a format prunes K with per-channel weights (`cache::set_key_weights`).
template <class Format>
inline constexpr bool has_key_weights_v = detail::key_weights_of<format_traits<Format>>::value;

namespace detail {
/// Whether a compaction that moves a token into another page compresses it again (the page is
/// re-encoded, which can change stored values: counted as `compaction_report::pages_reencoded`).
/// False for formats whose pages hold each token's record as it is (format::dense,
/// format::bitmap_tiles); a format says so by specializing this to false.
template <class Format>
struct reencodes_moved_rows : std::true_type {};
template <class Format>
inline constexpr bool reencodes_moved_rows_v = reencodes_moved_rows<Format>::value;

/// How a compaction encodes the pages it writes, on both backends: `format`, the format it
/// encodes moved rows with (the cache's own unless its encoder has a mode that suits
/// already-decoded rows better); `key_weights`, whether a format with K weights prunes them with
/// the sequence's weights (else by plain magnitudes); and `limit`, the passes that may re-encode
/// one page of a format that `reencodes_moved_rows` (the cache leaves alone every page up to the
/// last one that reached it). A format states its own by specializing this (format::quant2:
/// nearest rounding, `max_reencodes`; format::bitmap_tiles: plain magnitudes).
template <class Format>
struct reencoding {
  static Format format(const Format& f) { return f; }
  static constexpr bool key_weights = true;
  static int limit(const Format&) noexcept { return 255; }
};

/// format_traits<Format>::sink_rows(format), 0 when a format does not declare it.
template <class Format, class = void>
struct sink_rows_of {
  static int get(const Format&) { return 0; }
};
template <class Format>
struct sink_rows_of<Format, std::void_t<decltype(format_traits<Format>::sink_rows(std::declval<const Format&>()))>> {
  static int get(const Format& f) { return format_traits<Format>::sink_rows(f); }
};
/// format_traits<Format>::window_rows(format), 0 when a format does not declare it.
template <class Format, class = void>
struct window_rows_of {
  static int get(const Format&) { return 0; }
};
template <class Format>
struct window_rows_of<Format, std::void_t<decltype(format_traits<Format>::window_rows(std::declval<const Format&>()))>> {
  static int get(const Format& f) { return format_traits<Format>::window_rows(f); }
};

/// Whether a format's encoder must not see the sink rows (their copies in the first page are
/// replaced by the first row after them before encoding): true for a format whose records span
/// several tokens, where one sink's large values would stretch its neighbours' ranges
/// (format::quant2's partitions). False by default: a per-token record of a sink is masked and
/// harms nobody.
template <class Format>
struct hides_sink_rows : std::false_type {};
template <class Format>
inline constexpr bool hides_sink_rows_v = hides_sink_rows<Format>::value;
}  // namespace detail

/// Most sink tokens a format keeps exact (`sink_tokens` of every built-in format).
inline constexpr int max_sink_tokens = 16;
/// Most recent-window tokens a format keeps exact (`recent_tokens` of every built-in format).
inline constexpr int max_recent_tokens = 1024;

/// The leading tokens of every sequence a format keeps as exact 16-bit rows besides its pages
/// (attention sinks, `sink_tokens`): copied into the sequence's tail slot when its first page is
/// sealed, masked out of that page, and always attended.
template <class Format>
int sink_rows(const Format& format) {
  return detail::sink_rows_of<Format>::get(format);
}

/// The most recent sealed tokens a format keeps as exact 16-bit rows besides its pages (the
/// recent window, `recent_tokens`, the dense tail not counted): a ring of that many rows in the
/// sequence's tail slot, written as pages are sealed; their page copies are masked.
template <class Format>
int window_rows(const Format& format) {
  return detail::window_rows_of<Format>::get(format);
}

/// Every exact row a sequence's tail slot can hold besides its tail: sinks plus the window.
template <class Format>
int exact_rows(const Format& format) {
  return sink_rows(format) + window_rows(format);
}

namespace detail {
/// Checks a format's `sink_tokens` and `recent_tokens` (throws `invalid_argument` naming them).
inline void validate_exact_tokens(const char* where, int sink_tokens, int recent_tokens) {
  require(sink_tokens >= 0 && sink_tokens <= max_sink_tokens, where, "sink_tokens", sink_tokens, "0 to 16");
  require(recent_tokens >= 0 && recent_tokens <= max_recent_tokens, where, "recent_tokens", recent_tokens, "0 to 1024");
}
/// ", sinks S, recent W" for a format's `describe` (empty for zeros).
inline std::string describe_exact_tokens(int sink_tokens, int recent_tokens) {
  std::string text;
  if (sink_tokens > 0) text += ",sinks" + std::to_string(sink_tokens);
  if (recent_tokens > 0) text += ",recent" + std::to_string(recent_tokens);
  return text;
}
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/format/format_traits.hpp> ----

// ---- begin <kvmosaic/format/dense.hpp> ----
/// \file
/// `format::dense`: uncompressed pages, the baseline every compressed format is measured against.
///
/// A page of one KV head holds `page_size` rows of `head_dim` 16-bit values (the storage dtype),
/// row-major, for K and for V alike: `page_size * head_dim * 2` bytes each, nothing else. This is
/// the layout of vLLM-style paged caches with the KV head as the outer index of a block, so one
/// head's page is one contiguous run of memory. The dense tail of every format uses this layout too.

#include <vector>

#if defined(__SSE2__)
#  include <emmintrin.h>
#endif

// ---- begin <kvmosaic/host/eigen.hpp> ----
/// \file
/// The one place kvmosaic configures and includes Eigen's core (format/packed_bitmap.hpp adds
/// Eigen/Eigenvalues after this header). The host backend runs Eigen on the CPU only, so when this
/// header is compiled by nvcc it asks Eigen not to annotate its functions for the device
/// (`EIGEN_NO_CUDA`): that keeps `.cu` files that include kvmosaic free of Eigen's device warnings.
/// Include kvmosaic before Eigen in a `.cu` file, or define `EIGEN_NO_CUDA` yourself.

#if defined(__CUDACC__) && !defined(EIGEN_NO_CUDA) && !defined(EIGEN_CORE_H)
#  define EIGEN_NO_CUDA
#endif
#include <Eigen/Core>

namespace kvmosaic::host {
/// Row-major float matrix views used by the host primitives.
using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_matrix_map = Eigen::Map<row_matrix>;
using const_row_matrix_map = Eigen::Map<const row_matrix>;
}  // namespace kvmosaic::host
// ---- end <kvmosaic/host/eigen.hpp> ----

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
// ---- end <kvmosaic/format/dense.hpp> ----

// ---- begin <kvmosaic/format/bitmap_tiles.hpp> ----
/// \file
/// `format::bitmap_tiles`: MUSTAFAR's unstructured KV sparsity (Joo et al., "MUSTAFAR: Promoting
/// Unstructured Sparsity for KV Cache Pruning in LLM Inference", sections 2-3, 4.3, appendix C).
///
/// Pruning: every token's K vector and V vector keeps exactly `head_dim - round(s * head_dim)`
/// elements of largest magnitude (per-token magnitude pruning, the paper's choice for both caches).
/// Ties in magnitude keep the lower channel. Optionally K is pruned output-aware (section 2.1): the
/// score of k_c is |k_c| * w_c, with w the sum of |q| over a window of queries (the GQA group
/// summed), set per sequence with `cache::set_key_weights` (`output_aware_key_weights` computes
/// w); scores are fp32 products on host and device alike.
///
/// Storage of one page (page_size tokens) of one KV head, K and V alike:
///   [bitmaps: tiles x uint64][tile offsets: tiles x uint32][non-zero values: 16-bit, packed]
/// with 1x64 tiles. The paper (appendix C) tiles K along tokens for each channel (tile (c, j) =
/// channel c, tokens 64 j .. 64 j + 63: the dimension q.k does not reduce over) and V along
/// channels for each token (tile (t, j) = token t, channels 64 j .. 64 j + 63). Bit b of a tile's
/// bitmap marks element b as kept; its values follow in bit order at its tile offset (values
/// before it in the page). Pages append without touching earlier pages.
///
/// Deliberate difference, the default (`k_layout = bitmap_k_layout::along_channels`): K is tiled as
/// V, along channels per token; the paper's orientation is `bitmap_k_layout::along_tokens`. Same
/// bytes. Why: our decode kernel expands tiles into a dense shared-memory tile, one tile per lane,
/// so a warp runs as long as its fullest tile. A K tile along tokens holds one channel's 64
/// tokens, and channels with outliers are kept for nearly every token: on K with outlier channels
/// (`synthetic::generate_kv`), a warp's fullest K tile holds 51 values along tokens against 24
/// along channels at s = 0.7 (mean 19); along channels was the faster default on K with outlier
/// channels at s = 0.7 (benchmark/README.md, "Decisions the code cites": "bitmap_tiles K layout").
///
/// Deliberate difference: the paper pads each tile's values to a multiple of 8 so a thread can
/// load a tile with aligned vector loads from global memory. Here the values of a page form one
/// run padded to 16 bytes at its end: kernels stage whole pages in shared memory, where any
/// offset is cheap, and since every token keeps the same count the page size is exact and fixed.
/// Bytes per page and head: tiles x 12 + align16(page_size x kept x 2), tiles = page_size x
/// head_dim / 64. At head_dim 128, pages of 64: 59% of dense at s = 0.5, 39% at s = 0.7 (the
/// paper: 65% and 45%, with its per-tile padding).

#include <algorithm>
#include <numeric>


namespace kvmosaic {
namespace format {

/// How bitmap_tiles tiles K (V is always tiled along channels, per token).
enum class bitmap_k_layout {
  along_tokens,    ///< tile = one channel, 64 tokens: the paper's orientation (appendix C)
  along_channels,  ///< tile = one token, 64 channels, as V: the default (faster decode, see the file comment)
};

/// Unstructured per-token magnitude pruning of K and V to sparsities `s_k`, `s_v` in [0, 0.95],
/// stored as 1x64 bitmap tiles. Cost per page: the kept values plus 12 bytes per 64 elements,
/// the same in either K layout.
struct bitmap_tiles {
  using policy_category = format_tag;
  float s_k = 0.5f;  ///< fraction of each K vector pruned
  float s_v = 0.5f;  ///< fraction of each V vector pruned
  bitmap_k_layout k_layout = bitmap_k_layout::along_channels;  ///< orientation of K's tiles (see the file comment)
  /// Attention sinks kept unpruned: the first `sink_tokens` (0 to 16) tokens of every sequence are
  /// also kept as dense 16-bit rows once its first page is sealed, attended exactly, and masked in
  /// that page. Cost: sink_tokens dense rows per sequence. Default 0 (MUSTAFAR's): on a real
  /// model 4 sinks changed nothing measurable here, unlike quant2's (docs/defaults.md).
  int sink_tokens = 0;
  /// The recent window kept unpruned (0 to 1024; MUSTAFAR keeps 32): the last `recent_tokens`
  /// sealed tokens are also kept as dense rows (a ring in the tail slot) and attended in place of
  /// their masked page copies. Cost: recent_tokens dense rows per sequence, written at seal. Not
  /// with a compactor that frees memory (the cache rejects it), hence 0 by default; 64 is worth
  /// setting where no compactor frees memory (docs/defaults.md).
  int recent_tokens = 0;
};

}  // namespace format

namespace detail {

constexpr int tile_length = 64;

/// Elements a vector of `head_dim` keeps at sparsity s.
inline int kept_per_vector(float sparsity, int head_dim) {
  return head_dim - static_cast<int>(std::lround(static_cast<double>(sparsity) * head_dim));
}

/// Indices of the `keep` largest scores |x_i| (times weights[i] when weights are given) of
/// x[0..n), ties to the lower index, in increasing order.
inline void largest_magnitudes(const float* x, int n, int keep, std::vector<int>& kept, const float* weights = nullptr) {
  kept.resize(static_cast<std::size_t>(n));
  std::iota(kept.begin(), kept.end(), 0);
  const auto score = [x, weights](int i) { return weights ? std::abs(x[i]) * weights[i] : std::abs(x[i]); };
  std::stable_sort(kept.begin(), kept.end(), [&score](int a, int b) { return score(a) > score(b); });
  kept.resize(static_cast<std::size_t>(keep));
  std::sort(kept.begin(), kept.end());
}

/// Layout of one bitmap-tiles page: where its bitmaps, offsets and values start.
struct bitmap_page_layout {
  int tiles;
  int values;  ///< kept values in the page
  std::size_t offsets_at() const { return static_cast<std::size_t>(tiles) * 8; }
  std::size_t values_at() const { return offsets_at() + static_cast<std::size_t>(tiles) * 4; }
  std::size_t bytes() const { return values_at() + (static_cast<std::size_t>(values) * 2 + 15) / 16 * 16; }
};

inline bitmap_page_layout bitmap_layout(float sparsity, const page_shape& shape) {
  return bitmap_page_layout{shape.page_size * shape.head_dim / tile_length,
                            shape.page_size * kept_per_vector(sparsity, shape.head_dim)};
}

/// Prunes rows [page_size][head_dim] per token (scores weighted by `weights` when given) and packs
/// them; `along_tokens` tiles each channel along tokens (K), otherwise each token along channels (V).
inline void encode_bitmap_page(float sparsity, const page_shape& shape, const float* rows, bool along_tokens,
                               std::byte* page, const float* weights = nullptr) {
  const int p = shape.page_size, d = shape.head_dim;
  const bitmap_page_layout layout = bitmap_layout(sparsity, shape);
  // Which elements each token keeps (the decision, not the value: a kept zero stays kept, so
  // every page holds exactly `layout.values` values).
  std::vector<std::uint8_t> keep_mask(static_cast<std::size_t>(p) * d, 0);
  std::vector<int> kept;
  for (int t = 0; t < p; ++t) {
    largest_magnitudes(rows + static_cast<std::size_t>(t) * d, d, kept_per_vector(sparsity, d), kept, weights);
    for (const int c : kept) keep_mask[static_cast<std::size_t>(t) * d + c] = 1;
  }
  std::vector<float> values;
  values.reserve(static_cast<std::size_t>(layout.values));
  auto* bitmaps = reinterpret_cast<std::uint64_t*>(page);
  auto* offsets = reinterpret_cast<std::uint32_t*>(page + layout.offsets_at());
  const int tiles_per_line = along_tokens ? p / tile_length : d / tile_length;
  for (int tile = 0; tile < layout.tiles; ++tile) {
    const int line = tile / tiles_per_line, part = tile % tiles_per_line;
    std::uint64_t bits = 0;
    offsets[tile] = static_cast<std::uint32_t>(values.size());
    for (int b = 0; b < tile_length; ++b) {
      const int t = along_tokens ? part * tile_length + b : line;
      const int c = along_tokens ? line : part * tile_length + b;
      const std::size_t index = static_cast<std::size_t>(t) * d + c;
      if (keep_mask[index]) {
        bits |= std::uint64_t{1} << b;
        values.push_back(rows[index]);
      }
    }
    std::memcpy(&bitmaps[tile], &bits, sizeof bits);
  }
  std::byte* value_bytes = page + layout.values_at();
  std::memset(value_bytes, 0, layout.bytes() - layout.values_at());
  store_dense_rows(shape.storage, values.data(), values.size(), value_bytes);
}

/// Index of the lowest set bit of a non-zero word.
inline int lowest_set_bit(std::uint64_t x) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctzll(x);
#else
  int i = 0;
  for (; (x & 1u) == 0; x >>= 1) ++i;
  return i;
#endif
}

/// Unpacks the first n tokens of a page into dense rows [n][head_dim] (pruned elements are 0).
/// The page's values are widened to float in one pass (`load_dense_rows`, vectorized), then each
/// tile's set bits place them. Cost: O(n x head_dim) to clear the rows, then one step per kept
/// value; no allocation once the per-thread scratch has grown to a page's values.
inline void decode_bitmap_page(float sparsity, const page_shape& shape, const std::byte* page, int n,
                               bool along_tokens, float* rows) {
  const int p = shape.page_size, d = shape.head_dim;
  const bitmap_page_layout layout = bitmap_layout(sparsity, shape);
  std::fill(rows, rows + static_cast<std::size_t>(n) * d, 0.0f);
  thread_local std::vector<float> values;
  if (values.size() < static_cast<std::size_t>(layout.values)) values.resize(static_cast<std::size_t>(layout.values));
  load_dense_rows(shape.storage, page + layout.values_at(), static_cast<std::size_t>(layout.values), values.data());
  const int tiles_per_line = along_tokens ? p / tile_length : d / tile_length;
  for (int tile = 0; tile < layout.tiles; ++tile) {
    std::uint64_t bits;
    std::memcpy(&bits, page + static_cast<std::size_t>(tile) * 8, sizeof bits);
    std::uint32_t offset;
    std::memcpy(&offset, page + layout.offsets_at() + static_cast<std::size_t>(tile) * 4, sizeof offset);
    const int line = tile / tiles_per_line, part = tile % tiles_per_line;
    if (!along_tokens && line >= n) continue;  // a token's tiles: past the rows asked for
    for (; bits != 0; bits &= bits - 1, ++offset) {
      const int b = lowest_set_bit(bits);
      const int t = along_tokens ? part * tile_length + b : line;
      const int c = along_tokens ? line : part * tile_length + b;
      if (t < n) rows[static_cast<std::size_t>(t) * d + c] = values[offset];
    }
  }
}

}  // namespace detail

/// MUSTAFAR's output-aware K weights (section 2.1): w[h][c] = sum over the window's queries and
/// the query heads of KV head h of |q[t][h * group_size + g][c]|. `queries`: [window][num_q_heads]
/// [head_dim] (the paper uses the 32 most recent). Returns [num_kv_heads][head_dim].
inline std::vector<float> output_aware_key_weights(tensor_view<const float, 3> queries, int group_size) {
  detail::require(group_size >= 1 && queries.extent(1) % group_size == 0, "output_aware_key_weights", "group_size",
                  group_size, "a divisor of queries.extent(1) (the query heads)");
  const std::int64_t kv_heads = queries.extent(1) / group_size, d = queries.extent(2);
  std::vector<float> w(static_cast<std::size_t>(kv_heads * d), 0.0f);
  for (std::int64_t t = 0; t < queries.extent(0); ++t)
    for (std::int64_t j = 0; j < queries.extent(1); ++j)
      for (std::int64_t c = 0; c < d; ++c) w[static_cast<std::size_t>((j / group_size) * d + c)] += std::abs(queries(t, j, c));
  return w;
}

template <>
struct format_traits<format::bitmap_tiles> {
  static constexpr const char* name = "bitmap_tiles";
  /// K may be pruned output-aware (cache::set_key_weights).
  static constexpr bool has_key_weights = true;

  static std::string describe(const format::bitmap_tiles& f) {
    return "bitmap_tiles(k" + detail::to_text(f.s_k) + ",v" + detail::to_text(f.s_v) +
           (f.k_layout == format::bitmap_k_layout::along_tokens ? ",k/tokens" : "") +
           detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens) + ")";
  }

  static void validate(const format::bitmap_tiles& f, const page_shape& shape) {
    const char* where = "format::bitmap_tiles";
    detail::require(f.s_k >= 0.0f && f.s_k <= 0.95f, where, "s_k", f.s_k, "0 to 0.95");
    detail::require(f.s_v >= 0.0f && f.s_v <= 0.95f, where, "s_v", f.s_v, "0 to 0.95");
    detail::require(shape.page_size % detail::tile_length == 0, where, "page_size", shape.page_size,
                    "a multiple of 64 (pages are whole 1x64 tiles along tokens)");
    detail::require(shape.head_dim % detail::tile_length == 0, where, "head_dim", shape.head_dim, "a multiple of 64");
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage",
                    to_string(shape.storage), "f16 or bf16");
    detail::require(f.k_layout == format::bitmap_k_layout::along_tokens || f.k_layout == format::bitmap_k_layout::along_channels,
                    where, "k_layout", static_cast<int>(f.k_layout), "bitmap_k_layout::along_tokens or along_channels");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
  }
  static int sink_rows(const format::bitmap_tiles& f) { return f.sink_tokens; }
  static int window_rows(const format::bitmap_tiles& f) { return f.recent_tokens; }
  static bool k_along_tokens(const format::bitmap_tiles& f) { return f.k_layout == format::bitmap_k_layout::along_tokens; }

  static std::size_t k_page_bytes(const format::bitmap_tiles& f, const page_shape& shape) {
    return detail::bitmap_layout(f.s_k, shape).bytes();
  }
  static std::size_t v_page_bytes(const format::bitmap_tiles& f, const page_shape& shape) {
    return detail::bitmap_layout(f.s_v, shape).bytes();
  }

  static void encode_k(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_bitmap_page(f.s_k, shape, rows, k_along_tokens(f), page);
  }
  /// As encode_k, each element scored |k_c| * weights[c] (weights: [head_dim], or null).
  static void encode_k(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, const float* weights,
                       std::byte* page) {
    detail::encode_bitmap_page(f.s_k, shape, rows, k_along_tokens(f), page, weights);
  }
  static void encode_v(const format::bitmap_tiles& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_bitmap_page(f.s_v, shape, rows, /*along_tokens=*/false, page);
  }
  static void decode_k(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* page, int n,
                       float* rows) {
    detail::decode_bitmap_page(f.s_k, shape, page, n, k_along_tokens(f), rows);
  }
  static void decode_v(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* page, int n,
                       float* rows) {
    detail::decode_bitmap_page(f.s_v, shape, page, n, /*along_tokens=*/false, rows);
  }

  /// Host reference: unpack, then the dense product (the CUDA kernels compute on the tiles).
  static void score(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* k_page, int n,
                    const float* q, int groups, float* logits) {
    const int d = shape.head_dim;
    std::vector<float>& keys = detail::host_scratch(static_cast<std::size_t>(shape.page_size) * d);
    decode_k(f, shape, k_page, n, keys.data());
    host::row_matrix_map(logits, groups, n).noalias() =
        host::const_row_matrix_map(q, groups, d) * host::const_row_matrix_map(keys.data(), n, d).transpose();
  }
  static void accumulate(const format::bitmap_tiles& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    const int d = shape.head_dim;
    std::vector<float>& values = detail::host_scratch(static_cast<std::size_t>(shape.page_size) * d);
    decode_v(f, shape, v_page, n, values.data());
    host::row_matrix_map(o, groups, d).noalias() +=
        host::const_row_matrix_map(p, groups, n) * host::const_row_matrix_map(values.data(), n, d);
  }
};

namespace detail {
/// Compaction moves format::bitmap_tiles' tokens without changing a stored value: both backends
/// unpack the pages a pass reads and prune and pack the pages it writes again, by the moved rows'
/// plain magnitudes. A moved row holds exactly the values its first encode kept (at most `keep`
/// nonzeros per vector, zeros elsewhere), so the magnitudes keep them all: zeros never outrank
/// them, whatever K weights the sequence has now. (Pruning with the current weights could drop
/// kept values where a weight is 0, or where the weights changed since the page was sealed.)
template <>
struct reencodes_moved_rows<format::bitmap_tiles> : std::false_type {};
template <>
struct reencoding<format::bitmap_tiles> {
  static format::bitmap_tiles format(const format::bitmap_tiles& f) { return f; }
  static constexpr bool key_weights = false;
  static int limit(const format::bitmap_tiles&) noexcept { return 255; }
};
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/format/bitmap_tiles.hpp> ----

// ---- begin <kvmosaic/format/quant.hpp> ----
/// \file
/// `format::quant<Bits, ValueAxis>` (`quant2`, `quant4`): HACK's asymmetric quantization with
/// attention computed on the codes (Zhang et al., "HACK: Homomorphic Acceleration via Compression
/// of the Key-Value Cache for Disaggregated LLM Inference", sections 5.2-5.3 and 6), at 2 bits
/// (the paper's width) or 4 (HACK's section 8 names wider codes as future work; KIVI's 4-bit
/// recipe is about lossless on a real model, docs/quantization.md). Host part: encode, decode,
/// and the host attend on codes (the reference the CUDA kernels are tested against).
///
/// Quantization: each partition of `partition` (Pi) elements keeps a min m and a scale
/// s >= (max - m) / L, L = 2^Bits - 1 (both 16-bit floats, as the paper stores them, in the
/// cache's storage dtype: f16 or bf16, so any value the cache stores has a representable range)
/// and codes c in {0..L} with x ~ m + s c. m is the partition's min rounded toward -infinity and
/// s the smallest storage value with m + L s >= max (evaluated in fp64): every value lies in
/// [m, m + L s], and the codes are computed against the stored m and s (`quant_range`). K is
/// partitioned per channel along tokens (`key_axis::tokens`, the default) or per token along
/// head_dim; V per channel along tokens (`value_axis::tokens`, the paper's Fig. 7: each
/// product's inner dimension) or per token along head_dim (`value_axis::head_dim`, KIVI's
/// choice). Rounding is to nearest or stochastic (to floor(t) + 1 with probability frac(t),
/// t = (x - m) / s, unbiased). The stochastic noise is a counter-based hash of (seed, the
/// element's index in its page, its value, its partition's m and s): a pure function of the
/// data, so the host and the device draw the same codes with no stream of positions, and
/// different seeds give independent roundings.
///
/// Summation elimination (5.3): each partition stores its code sum, so no step re-sums the cache.
/// Requantization elimination (5.3): V partitions run along tokens, and the newest ones stay
/// 16-bit until complete. Here the dense tail plays that part: a page is encoded when it is full,
/// and page_size must be a multiple of Pi, so a sealed page holds whole V partitions. (The paper
/// keeps at most Pi - 1 tokens unquantized; we keep up to page_size - 1.) Optional sink tokens
/// stay 16-bit (`sink_tokens`; not in the paper: our addition, for StreamingLLM's attention sinks).
///
/// Attention on codes (Eq. 4, which holds for any code width): for a partition of an inner
/// product sum_k (m_a + s_a a_k) (m_b + s_b b_k) = Pi m_a m_b + m_a s_b sum(b) + s_a m_b sum(a) +
/// s_a s_b sum(a b): q is quantized to 8 bits per partition of Pi channels (round to nearest, min
/// and scale in fp32: q is transient), the softmax numerators p to 8 bits per partition of Pi
/// tokens, and only the integer products sum(a b) touch the codes; sum(b) comes from the page.
/// Where a partition of the cache does not run along the product's inner dimension (K per
/// channel for q.k, V per token for p.v), its scales are folded into the transient operand
/// before that is quantized: q' = q s_K per channel, p' = p s_V per token and channel group, and
/// the mins contribute one term per (head, group); the page then stores the code sums along the
/// inner dimension instead (docs/quantization.md works both out).
///
/// Non-finite values and NaN: a partition holding a NaN or an infinity (only a NaN or infinite
/// input stores one: finite inputs saturate, core/dtype.hpp) stores NaN as its min and scale and
/// code 0 for every element. The outputs that read it (a K partition: every query head of its KV
/// head; a V partition: its channel (or, per token, its channel group) of those heads), and those
/// of a query head with a NaN in q, are unspecified: NaN on the host backend (as dense
/// attention's), NaN or another value on CUDA (its split merge does not propagate NaN). Other
/// heads and sequences are unaffected, and every float-to-integer conversion is clamped first (NaN
/// to code 0): no input is undefined behaviour, host or device.
///
/// Page layout (one head, K or V): [mins: partitions x 16-bit][scales: partitions x 16-bit]
/// [code sums: partitions x u8 (u16 where Pi L > 255)][codes: Bits each] padded to 16 bytes.
/// Partition c * (page_size / Pi) + j of a page partitioned along tokens holds tokens j Pi .. of
/// channel c; partition t * (head_dim / Pi) + j of one along head_dim holds channels j Pi .. of
/// token t. The codes are not stored partition by partition: they form the int8 tensor-core
/// operand the CUDA kernel multiplies (K as [tokens][channels], V as [channels][tokens], in
/// 16 x 32 tiles; see `quant_code_bit`), so a warp unpacks them with shifts and masks. At Pi = 64,
/// head_dim 128, pages of 64: 2688 bytes per page at 2 bits (16.4% of dense), 4864 at 4 (29.7%).

#include <limits>


namespace kvmosaic {
namespace format {

/// Along which axis K is partitioned.
enum class key_axis {
  head_dim,  ///< per token, Pi channels a partition: the paper's layout (the product's inner dimension)
  tokens,    ///< per channel, Pi tokens a partition: one range per channel, so outlier channels
             ///< do not stretch their neighbours' steps; the scales are folded into q
};

/// Along which axis V is partitioned.
enum class value_axis {
  tokens,    ///< per channel, Pi tokens a partition: the paper's layout (the product's inner dimension)
  head_dim,  ///< per token, Pi channels a partition (KIVI's choice): one range per token, so a
             ///< token's outlier channel does not stretch other tokens' steps; the scales are
             ///< folded into p, quantized per (token partition, channel group)
};

/// How a quantized format rounds a value to a code.
enum class rounding {
  stochastic,  ///< up with probability frac(t): unbiased (the paper's choice)
  nearest,     ///< to the nearest code (the default: a third of the loss on a real model, docs/defaults.md)
};

/// HACK's KV quantization with attention on the codes, `Bits` (2 or 4) bits a code, V partitioned
/// along `ValueAxis`. Both are template parameters because they change the kernel (its unpacking
/// and its p.v product), not only the bytes: a cache compiles the kernels of its own choice only.
/// Cost per page: Bits bits per element plus 5-6 bytes (min, scale, code sum) per partition of
/// `partition` elements; at Pi = 64, 16.4% of dense at 2 bits and 29.7% at 4.
template <int Bits, value_axis ValueAxis = value_axis::tokens>
struct quant {
  static_assert(Bits == 2 || Bits == 4, "kvmosaic::format::quant<Bits>: Bits (the code width) must be 2 or 4");
  static_assert(ValueAxis == value_axis::tokens || ValueAxis == value_axis::head_dim,
                "kvmosaic::format::quant<Bits, ValueAxis>: ValueAxis must be value_axis::tokens or value_axis::head_dim");
  using policy_category = format_tag;
  static constexpr int bits = Bits;                  ///< bits a code
  static constexpr int levels = (1 << Bits) - 1;     ///< L: the largest code
  static constexpr value_axis v_axis = ValueAxis;    ///< how V is partitioned (see value_axis)

  int partition = 64;                        ///< Pi: elements per partition, 32, 64 or 128
  rounding mode = rounding::nearest;         ///< HACK rounds stochastically; see docs/defaults.md
  std::uint64_t seed = 0;                    ///< seed of the stochastic rounding
  key_axis k_axis = key_axis::tokens;        ///< how K is partitioned (see key_axis)
  /// Attention sinks kept 16-bit: the first `sink_tokens` (0 to 16) tokens of every sequence are
  /// stored as dense rows too once the sequence's first page is sealed, and attended exactly;
  /// in that page they are masked, and quantized as copies of the first token after them so that
  /// their large values do not stretch the partitions' ranges. Cost: sink_tokens dense rows per
  /// sequence. Default 4 (StreamingLLM's count; HACK keeps none): docs/defaults.md.
  int sink_tokens = 4;
  /// The recent window kept 16-bit (0 to 1024; 0: only the dense tail): the last `recent_tokens`
  /// sealed tokens of every sequence are also kept as dense rows in a ring in its tail slot and
  /// attended exactly in place of their masked page copies, so the latest page_size - 1 +
  /// recent_tokens tokens or more are exact (KIVI keeps 128, MUSTAFAR 32). Cost: recent_tokens
  /// dense rows per sequence, written when a page is sealed. Not with a compactor that frees
  /// memory (the cache rejects it), hence 0 by default; 128 is worth setting where no compactor
  /// frees memory (docs/defaults.md).
  int recent_tokens = 0;
  /// Compaction passes that may re-encode a page (0 to 255): a pass quantizes the moved rows'
  /// dequantized values again, on the grid of their new partition, which adds error each time a
  /// partition's members change. A pass leaves alone every page up to the last one re-encoded this
  /// many times (its dead rows stay masked; pages that empty entirely are still freed at once), so
  /// no token is re-encoded more than this. 0: compaction never re-encodes (memory comes back by
  /// whole pages only). Cost of more: more memory freed under scattered eviction, more error
  /// (docs/eviction.md, "quant2 and re-encoding").
  int max_reencodes = 1;
};

/// HACK's 2-bit codes, V per channel: the paper's format.
using quant2 = quant<2>;
/// 4-bit codes, V per channel.
using quant4 = quant<4>;

/// True for every `quant<Bits, ValueAxis>` (quant2, quant4, either V axis): formats whose pages
/// hold codes, compared within the 8-bit bound and re-encoded by compaction.
template <class Format>
struct is_quant : std::false_type {};
template <int Bits, value_axis ValueAxis>
struct is_quant<quant<Bits, ValueAxis>> : std::true_type {};
template <class Format>
inline constexpr bool is_quant_v = is_quant<Format>::value;

}  // namespace format

namespace detail {

/// splitmix64's finalizer: a bijective 64-bit mix (Steele et al.), the counter-based generator of
/// the stochastic rounding (host and device compute it the same way).
KVMOSAIC_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform in [0, 1) with 24 bits, from the seed and a 64-bit key.
KVMOSAIC_HOST_DEVICE inline float rounding_noise(std::uint64_t seed, std::uint64_t key) {
  return static_cast<float>(mix64(mix64(seed) ^ key) >> 40) * (1.0f / 16777216.0f);
}

/// The extent of a partition's values, added in element order: lo and hi as std::min and
/// std::max keep them (the first of equals, so the same signed zero on host and device), and
/// whether every value is finite.
struct quant_extent {
  float lo, hi;
  bool finite;

  KVMOSAIC_HOST_DEVICE explicit quant_extent(float first) : lo(first), hi(first), finite(is_finite(first)) {}
  KVMOSAIC_HOST_DEVICE void add(float v) {
    lo = v < lo ? v : lo;
    hi = hi < v ? v : hi;
    finite = finite && is_finite(v);
  }
  KVMOSAIC_HOST_DEVICE static bool is_finite(float v) { return (float_bits(v) & 0x7fffffffu) < 0x7f800000u; }
};

/// A partition's stored min and scale: their bits in the storage dtype and their values.
struct quant_range_bits {
  std::uint16_t min_bits, scale_bits;
  float min, scale;
};

/// The stored min and scale of a partition with extent `e`, in the 16-bit storage dtype
/// `storage`, for codes 0..`levels`: m = lo rounded toward -infinity, s = the smallest storage
/// value with L s >= hi - m
/// (compared in fp64: exact unless hi and m differ in magnitude by more than 2^40, where the
/// rounding is below 2^-52 of the range), so every value lies in [m, m + 3 s] and a range up to
/// twice the dtype's largest value is representable. lo and hi are first clamped to the dtype's
/// finite range (the cache stores values already saturated to it; a raw float beyond it gets code
/// 0 or L). A non-finite value gives NaN for both. The codes are computed against these stored
/// values. Host and device compute it the same way (IEEE fp64 subtraction and division, no
/// contraction), so the bytes are the same.
KVMOSAIC_HOST_DEVICE inline quant_range_bits quant_range(const quant_extent& e, dtype storage, int levels) {
  quant_range_bits r{};
  if (!e.finite) {
    r.min_bits = r.scale_bits = storage == dtype::f16 ? std::uint16_t{0x7e00u} : std::uint16_t{0x7fc0u};
    r.min = r.scale = storage_value(r.min_bits, storage);
    return r;
  }
  const float top = storage_max(storage);
  const float lo = e.lo < -top ? -top : (e.lo > top ? top : e.lo);
  const float hi = e.hi < -top ? -top : (e.hi > top ? top : e.hi);
  r.min_bits = storage_bits_down(lo, storage);
  r.min = storage_value(r.min_bits, storage);
  const double range = static_cast<double>(hi) - static_cast<double>(r.min);  // >= 0, at most 2 top
  r.scale_bits = storage_bits_up(static_cast<float>(range / levels), storage);
  while (levels * static_cast<double>(storage_value(r.scale_bits, storage)) < range)
    r.scale_bits = storage_next_up(r.scale_bits);  // at most one step: the float rounding above
  r.scale = storage_value(r.scale_bits, storage);
  return r;
}

/// The code (0..`levels`) of v in a partition with stored min m and scale s (`quant_range`). Stochastic:
/// up with probability frac((v - m) / s), the noise a hash of (seed, the element's index in its
/// page, v, m, s); nearest: to the nearest code. One function for host and device: no product
/// feeds a sum here, so no compiler contracts an operation and both round alike. The code is
/// clamped to 0..L before the conversion to int; a NaN (v, m or s NaN) gives 0.
KVMOSAIC_HOST_DEVICE inline int quant_code(int levels, bool stochastic, std::uint64_t seed, std::uint64_t element_index, float v,
                                            float m, float s) {
  const float t = s > 0.0f ? (v - m) / s : 0.0f;
  float c;
  if (!stochastic) {
    c = floorf(t + 0.5f);
  } else {
    const std::uint64_t range_key =
        mix64((static_cast<std::uint64_t>(detail::float_bits(m)) << 32) | detail::float_bits(s));
    const std::uint64_t key = element_index ^ (static_cast<std::uint64_t>(detail::float_bits(v)) << 32) ^ range_key;
    const float below = floorf(t);
    c = below + (rounding_noise(seed, key) < t - below ? 1.0f : 0.0f);
  }
  return c >= static_cast<float>(levels) ? levels : (c > 0.0f ? static_cast<int>(c) : 0);
}

/// Bit of the code at (row, col) of a page's code matrix with `cols` columns, `bits` (2 or 4)
/// bits a code. The matrix is stored in tiles of 16 rows x 32 columns, row-major over tiles,
/// 64 bits bytes a tile. Register s (0..3) of lane 4 g + q's int8 A fragment of an m16n8k32
/// tensor-core product (PTX ISA, "mma.m16n8k32") holds in its byte b the code at row g + 8 (s % 2),
/// column 16 (s / 2) + 4 q + b. A lane's bits / 2 words are adjacent; a word packs 8 / bits
/// registers, register s in word s / (8 / bits) at bits (s % (8 / bits)) bits of every byte, so
/// `(word >> bits i) & mask` (mask 0x03030303 or 0x0f0f0f0f) is a register: a warp unpacks 16
/// codes per lane with four shift-and-mask pairs and no shuffles. At 2 bits a tile is one word per
/// lane.
KVMOSAIC_HOST_DEVICE constexpr std::size_t quant_code_bit(int bits, int cols, int row, int col) {
  const int tile = row / 16 * (cols / 32) + col / 32;
  const int r = row % 16, c = col % 32;
  const int lane = r % 8 * 4 + c % 16 / 4, s = r / 8 + 2 * (c / 16);
  const int per_word = 8 / bits;
  return static_cast<std::size_t>(tile) * 64 * bits * 8 + static_cast<std::size_t>(lane) * bits * 16 +
         static_cast<std::size_t>(s / per_word) * 32 + (c % 4) * 8 + static_cast<std::size_t>(s % per_word) * bits;
}

/// Geometry of one quantized page (one head, K or V): the byte layout, how partition elements map
/// to (token, channel), and how those map to the code matrix. The codes form the A operand of the
/// attention products on tensor cores: K as [tokens][channels] (S^T = K Q^T, an inner product
/// over channels), V as [channels][tokens] (O^T = V^T P^T, over tokens).
struct quant_layout {
  int partitions;     ///< partitions in the page
  int partition;      ///< Pi
  int bits;           ///< bits a code: 2 or 4
  int sum_bytes;      ///< 1 or 2: enough for Pi L
  int page_size;
  int head_dim;
  bool along_tokens;  ///< partitions run along tokens, one channel each (K and V per channel)
  bool is_key;        ///< code matrix rows are tokens (K) rather than channels (V)
  dtype storage;      ///< the dtype of the mins and scales: the cache's storage dtype (f16 or bf16)

  int levels() const { return (1 << bits) - 1; }
  std::size_t scales_at() const { return static_cast<std::size_t>(partitions) * 2; }
  std::size_t sums_at() const { return static_cast<std::size_t>(partitions) * 4; }
  std::size_t codes_at() const { return sums_at() + static_cast<std::size_t>(partitions) * sum_bytes; }
  std::size_t bytes() const {
    return (codes_at() + static_cast<std::size_t>(partitions) * partition * bits / 8 + 15) / 16 * 16;
  }
  /// Element i of partition `part`: (token, channel).
  void element(int part, int i, int& token, int& channel) const {
    if (along_tokens) {
      const int per_channel = page_size / partition;
      channel = part / per_channel;
      token = part % per_channel * partition + i;
    } else {
      const int per_token = head_dim / partition;
      token = part / per_token;
      channel = part % per_token * partition + i;
    }
  }
  /// The partition of (token, channel): `element`'s inverse.
  int partition_of(int token, int channel) const {
    return along_tokens ? channel * (page_size / partition) + token / partition
                        : token * (head_dim / partition) + channel / partition;
  }
  /// Bit of the code of (token, channel), counted from codes_at().
  std::size_t code_bit(int token, int channel) const {
    return is_key ? quant_code_bit(bits, head_dim, token, channel) : quant_code_bit(bits, page_size, channel, token);
  }
};

/// Bytes of a code sum of `partition` codes of `bits` bits: 1 while Pi L fits a byte, else 2.
KVMOSAIC_HOST_DEVICE constexpr int quant_sum_bytes(int bits, int partition) {
  return partition * ((1 << bits) - 1) > 255 ? 2 : 1;
}

template <int Bits, format::value_axis V>
quant_layout quant_layout_of(const format::quant<Bits, V>& f, const page_shape& shape, bool is_key) {
  return quant_layout{shape.page_size * shape.head_dim / f.partition,
                      f.partition,
                      Bits,
                      quant_sum_bytes(Bits, f.partition),
                      shape.page_size,
                      shape.head_dim,
                      is_key ? f.k_axis == format::key_axis::tokens : V == format::value_axis::tokens,
                      is_key,
                      shape.storage};
}

/// Quantizes `count` values x[i * stride] (one partition) into `codes` (0..L) against the stored
/// min and scale (`quant_range`, in `storage`); returns them. `key` numbers the elements within
/// the page. A partition with a non-finite value gets code 0 everywhere (and NaN min and scale).
template <int Bits, format::value_axis V>
quant_range_bits quantize_partition(const format::quant<Bits, V>& f, dtype storage, const float* x, int count, int stride,
                                    std::uint64_t key, std::uint8_t* codes) {
  constexpr int levels = format::quant<Bits, V>::levels;
  quant_extent extent(x[0]);
  for (int i = 1; i < count; ++i) extent.add(x[static_cast<std::size_t>(i) * stride]);
  const quant_range_bits range = quant_range(extent, storage, levels);
  const bool stochastic = f.mode == format::rounding::stochastic;
  for (int i = 0; i < count; ++i) {
    const float v = x[static_cast<std::size_t>(i) * stride];
    const std::uint64_t index = key + static_cast<std::uint64_t>(i);
    codes[i] = extent.finite ? static_cast<std::uint8_t>(quant_code(levels, stochastic, f.seed, index, v, range.min, range.scale))
                             : std::uint8_t{0};
  }
  return range;
}

/// Encodes rows [page_size][head_dim] into a K (`is_key`) or V page: each partition quantized
/// (`quantize_partition`), its min, scale and code sum stored, its codes placed in the code matrix.
template <int Bits, format::value_axis V>
void encode_quant_page(const format::quant<Bits, V>& f, const page_shape& shape, const float* rows, bool is_key,
                       std::byte* page) {
  const quant_layout layout = quant_layout_of(f, shape, is_key);
  const int d = shape.head_dim, pi = f.partition;
  std::memset(page, 0, layout.bytes());
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(pi));
  for (int part = 0; part < layout.partitions; ++part) {
    int token = 0, channel = 0;
    layout.element(part, 0, token, channel);
    const float* first = rows + static_cast<std::size_t>(token) * d + channel;
    const int stride = layout.along_tokens ? d : 1;
    const quant_range_bits range =
        quantize_partition(f, shape.storage, first, pi, stride, static_cast<std::uint64_t>(part) * pi, codes.data());
    std::memcpy(page + static_cast<std::size_t>(part) * 2, &range.min_bits, 2);
    std::memcpy(page + layout.scales_at() + static_cast<std::size_t>(part) * 2, &range.scale_bits, 2);
    unsigned sum = 0;
    for (int i = 0; i < pi; ++i) {
      sum += codes[static_cast<std::size_t>(i)];
      layout.element(part, i, token, channel);
      const std::size_t bit = layout.code_bit(token, channel);
      page[layout.codes_at() + bit / 8] |= static_cast<std::byte>(codes[static_cast<std::size_t>(i)] << (bit % 8));
    }
    if (layout.sum_bytes == 1) {
      page[layout.sums_at() + static_cast<std::size_t>(part)] = static_cast<std::byte>(sum);
    } else {
      const auto sum16 = static_cast<std::uint16_t>(sum);
      std::memcpy(page + layout.sums_at() + static_cast<std::size_t>(part) * 2, &sum16, 2);
    }
  }
}

/// The stored form of one page, read back: mins, scales, code sums and codes, as numbers.
struct quant_page_view {
  quant_layout layout;
  const std::byte* page;
  float min(int part) const { return load(page + static_cast<std::size_t>(part) * 2); }
  float scale(int part) const { return load(page + layout.scales_at() + static_cast<std::size_t>(part) * 2); }
  unsigned code_sum(int part) const {
    if (layout.sum_bytes == 1) return static_cast<unsigned>(page[layout.sums_at() + static_cast<std::size_t>(part)]);
    std::uint16_t sum16;
    std::memcpy(&sum16, page + layout.sums_at() + static_cast<std::size_t>(part) * 2, 2);
    return sum16;
  }
  /// The code of (token, channel).
  int code_at(int token, int channel) const {
    const std::size_t bit = layout.code_bit(token, channel);
    return (static_cast<int>(page[layout.codes_at() + bit / 8]) >> (bit % 8)) & layout.levels();
  }
  /// The code of element i of partition `part`.
  int code(int part, int i) const {
    int token = 0, channel = 0;
    layout.element(part, i, token, channel);
    return code_at(token, channel);
  }
  /// A min or scale, in the layout's storage dtype.
  float load(const std::byte* at) const {
    std::uint16_t bits;
    std::memcpy(&bits, at, 2);
    return storage_value(bits, layout.storage);
  }
};

/// The reciprocal of an 8-bit grid's step, 0 below the smallest normal float (a step of
/// subnormal softmax weights, whose reciprocal may overflow; every value then gets code 0 and the
/// error is below the step times 255, itself subnormal). The device computes the same.
inline float quantize8_inverse(float step) { return step >= 1.17549435e-38f ? 1.0f / step : 0.0f; }

/// 8-bit asymmetric quantization of a transient operand (q, or the softmax numerators), round to
/// nearest: x ~ m + s a, a in 0..255. Returns sum(a). A NaN among the values makes m and s NaN
/// (and every code 0), so what is computed from them is NaN; codes are clamped to 0..255 before
/// the conversion to int.
inline unsigned quantize8(const float* x, int count, int stride, float& m, float& s, int* a) {
  float lo = x[0], hi = x[0];
  bool nan = std::isnan(x[0]);
  for (int i = 1; i < count; ++i) {
    const float v = x[static_cast<std::size_t>(i) * stride];
    nan = nan || std::isnan(v);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (nan) {
    m = s = std::numeric_limits<float>::quiet_NaN();
    // An index loop, not std::fill over [a, a + count): g++ 13 cannot bound a pointer range of
    // an int count and warns (-Wstringop-overflow) where this is inlined.
    for (int i = 0; i < count; ++i) a[i] = 0;
    return 0;
  }
  m = lo;
  // A product, one reciprocal and one fused multiply-add per value, no division: what the
  // device kernels compute, rounding for rounding (fma is correctly rounded on both sides).
  s = (hi - lo) * (1.0f / 255.0f);
  const float inverse = quantize8_inverse(s);
  const float bias = std::fma(-lo, inverse, 0.5f);  // code = floor((x - lo) / s + 1/2)
  unsigned sum = 0;
  for (int i = 0; i < count; ++i) {
    const float y = std::fma(x[static_cast<std::size_t>(i) * stride], inverse, bias);
    a[i] = static_cast<int>(std::floor(std::fmin(std::fmax(y, 0.0f), 255.0f)));  // NaN (inf x) -> 0
    sum += static_cast<unsigned>(a[i]);
  }
  return sum;
}

/// The code sums a product needs where the page is not partitioned along the product's inner
/// dimension, in place of the per-partition sums (same count, same width):
///  - K per channel (q.k runs over channels): sums[t * (head_dim / Pi) + p] = the codes of token
///    t, channels p Pi ..;
///  - V per token (p.v runs over tokens): sums[c * (page_size / Pi) + j] = the codes of channel c,
///    tokens j Pi ..
/// Either is the sum over the other axis's partition, indexed as that axis's partitions are.
inline void store_inner_code_sums(const quant_layout& layout, std::byte* page) {
  const quant_page_view view{layout, page};
  const int d = layout.head_dim, pi = layout.partition;
  std::vector<unsigned> sums(static_cast<std::size_t>(layout.partitions), 0u);
  for (int c = 0; c < d; ++c)
    for (int t = 0; t < layout.page_size; ++t) {
      const int index = layout.is_key ? t * (d / pi) + c / pi : c * (layout.page_size / pi) + t / pi;
      sums[static_cast<std::size_t>(index)] += static_cast<unsigned>(view.code_at(t, c));
    }
  for (int i = 0; i < layout.partitions; ++i) {
    if (layout.sum_bytes == 1) {
      page[layout.sums_at() + static_cast<std::size_t>(i)] = static_cast<std::byte>(sums[static_cast<std::size_t>(i)]);
    } else {
      const auto sum16 = static_cast<std::uint16_t>(sums[static_cast<std::size_t>(i)]);
      std::memcpy(page + layout.sums_at() + static_cast<std::size_t>(i) * 2, &sum16, 2);
    }
  }
}

/// Eq. 4 for one partition: sum_k (m_a + s_a a_k)(m_b + s_b b_k) from the integer dot sum(a b),
/// the code sums and the partition length.
inline double homomorphic_dot(int length, double m_a, double s_a, double sum_a, double m_b, double s_b, double sum_b,
                              double dot) {
  return length * m_a * m_b + m_a * s_b * sum_b + s_a * m_b * sum_a + s_a * s_b * dot;
}

/// Unpacks every code of a page into a byte matrix, row-major: K as [page_size][head_dim]
/// (tokens x channels), V as [head_dim][page_size] (channels x tokens), the code matrix of
/// `quant_code_bit`: one shift and mask of a stored word gives four adjacent codes of a row.
/// Cost: per 16 codes bits / 2 loads, four shifts and four 4-byte stores; no allocation.
inline void quant_unpack_codes(const quant_layout& layout, const std::byte* page, std::uint8_t* out) {
  const int rows = layout.is_key ? layout.page_size : layout.head_dim;
  const int cols = layout.is_key ? layout.head_dim : layout.page_size;
  const int tiles_per_row = cols / 32, tiles = rows / 16 * tiles_per_row;
  const int bits = layout.bits, per_word = 8 / bits, words = bits / 2;
  const std::uint32_t mask = bits == 2 ? 0x03030303u : 0x0f0f0f0fu;
  const std::byte* codes = page + layout.codes_at();
  for (int tile = 0; tile < tiles; ++tile) {
    const int r0 = tile / tiles_per_row * 16, c0 = tile % tiles_per_row * 32;
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, q = lane % 4;
      for (int w = 0; w < words; ++w) {
        std::uint32_t word;
        std::memcpy(&word, codes + (static_cast<std::size_t>(tile) * 32 + static_cast<std::size_t>(lane)) * words * 4 +
                               static_cast<std::size_t>(w) * 4, 4);
        for (int i = 0; i < per_word; ++i) {
          const int s = w * per_word + i;
          const std::uint32_t four = (word >> (bits * i)) & mask;  // bytes b = 0..3: columns 4 q + b
          std::memcpy(out + static_cast<std::size_t>(r0 + g + 8 * (s % 2)) * cols + c0 + 16 * (s / 2) + 4 * q, &four, 4);
        }
      }
    }
  }
}

/// sum_i a[i] b[i] over `count` bytes: the integer dot product of Eq. 4 (8-bit q or p codes
/// times 2- or 4-bit codes; at most 255 x 15 x 256, exact in int). Written for the vectorizer.
inline int byte_dot(const std::uint8_t* a, const std::uint8_t* b, int count) noexcept {
  int dot = 0;
  for (int i = 0; i < count; ++i) dot += static_cast<int>(a[i]) * static_cast<int>(b[i]);
  return dot;
}

/// Per-thread working memory of the host attend on codes, reused across pages and calls (no
/// allocation once it has grown to a page's size).
struct quant_host_scratch {
  std::vector<std::uint8_t> codes;  ///< the page's code matrix (`quant_unpack_codes`)
  std::vector<float> mins, scales;  ///< every partition's stored min and scale, as floats
  std::vector<int> a;               ///< 8-bit codes of q, q' or p, as quantize8 writes them
  std::vector<std::uint8_t> a8;     ///< the same as bytes, for `byte_dot`
  std::vector<float> folded, m_a, s_a;
  std::vector<unsigned> sum_a;

  /// Unpacks the codes, mins and scales of `page`.
  void load(const quant_page_view& view) {
    const quant_layout& l = view.layout;
    codes.resize(static_cast<std::size_t>(l.page_size) * l.head_dim);
    quant_unpack_codes(l, view.page, codes.data());
    mins.resize(static_cast<std::size_t>(l.partitions));
    scales.resize(mins.size());
    for (int part = 0; part < l.partitions; ++part) {
      mins[static_cast<std::size_t>(part)] = view.min(part);
      scales[static_cast<std::size_t>(part)] = view.scale(part);
    }
  }
  /// Sizes the 8-bit operand buffers for `count` values and `parts` partitions of them.
  void size_operands(int count, int parts) {
    a.resize(static_cast<std::size_t>(count));
    a8.resize(a.size());
    folded.resize(a.size());
    m_a.resize(static_cast<std::size_t>(parts));
    s_a.resize(m_a.size());
    sum_a.resize(m_a.size());
  }
  /// Copies a[from, from + count) into a8 (every code is 0..255).
  void to_bytes(int from, int count) {
    for (int i = from; i < from + count; ++i) a8[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(a[static_cast<std::size_t>(i)]);
  }
};

inline quant_host_scratch& quant_scratch() {
  thread_local quant_host_scratch scratch;
  return scratch;
}

}  // namespace detail

namespace detail {
/// The name a quantized format goes by in messages: format::quant2, format::quant4, and
/// format::quant<B, value_axis::head_dim> for V per token.
template <int Bits, format::value_axis V>
constexpr const char* quant_where() {
  if constexpr (V == format::value_axis::tokens) return Bits == 2 ? "format::quant2" : "format::quant4";
  else return Bits == 2 ? "format::quant<2, value_axis::head_dim>" : "format::quant<4, value_axis::head_dim>";
}
}  // namespace detail

template <int Bits, format::value_axis V>
struct format_traits<format::quant<Bits, V>> {
  using format_type = format::quant<Bits, V>;
  static constexpr const char* name = Bits == 2 ? "quant2" : "quant4";

  static std::string describe(const format_type& f) {
    std::string text = std::string(name) + "(pi" + std::to_string(f.partition) + "," +
                       (f.mode == format::rounding::stochastic ? "stochastic" : "nearest") +
                       (f.k_axis == format::key_axis::tokens ? ",k/channel" : ",k/token") +
                       (V == format::value_axis::head_dim ? ",v/token" : "") +
                       detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens);
    if (f.max_reencodes != 1) text += ",reencodes" + std::to_string(f.max_reencodes);
    return text + ")";
  }

  static void validate(const format_type& f, const page_shape& shape) {
    const char* where = detail::quant_where<Bits, V>();
    detail::require(f.partition == 32 || f.partition == 64 || f.partition == 128, where, "partition", f.partition,
                    "32, 64 or 128");
    // q.k runs over channels in groups of Pi with either key axis: K per token partitions them,
    // and K per channel quantizes q' = q s per Pi channels and keeps per-token code sums of Pi
    // channels in the partitions' sum slots (page_size x head_dim / Pi of them). So Pi divides
    // head_dim whatever k_axis is; the CUDA kernels are compiled for Pi <= head_dim alone.
    if (shape.head_dim % f.partition != 0) {
      std::string allowed;
      for (const int pi : {32, 64, 128})
        if (shape.head_dim % pi == 0) allowed += (allowed.empty() ? "" : ", ") + std::to_string(pi);
      const std::size_t last = allowed.rfind(", ");
      if (last != std::string::npos) allowed.replace(last, 2, " or ");
      allowed = (allowed.empty() ? std::string("none") : allowed) + " at head_dim = " + std::to_string(shape.head_dim) +
                " (a divisor of head_dim with either k_axis: q.k sums channels in groups of partition; K per channel "
                "stores per-token code sums of partition channels)";
      detail::require(false, where, "partition", f.partition, allowed.c_str());
    }
    detail::require(shape.page_size % f.partition == 0, where, "page_size", shape.page_size,
                    "a multiple of partition (a sealed page holds whole V partitions)");
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage",
                    to_string(shape.storage), "f16 or bf16");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
    detail::require(f.max_reencodes >= 0 && f.max_reencodes <= 255, where, "max_reencodes", f.max_reencodes, "0 to 255");
    // Enumerations arrive from configuration as integers: a value outside the enumerators would
    // otherwise pick a branch silently.
    const int mode = static_cast<int>(f.mode), axis = static_cast<int>(f.k_axis);
    detail::require(f.mode == format::rounding::stochastic || f.mode == format::rounding::nearest, where, "mode", mode,
                    "rounding::stochastic (0) or rounding::nearest (1)");
    detail::require(f.k_axis == format::key_axis::head_dim || f.k_axis == format::key_axis::tokens, where, "k_axis",
                    axis, "key_axis::head_dim (0) or key_axis::tokens (1)");
  }

  /// At most this many sink tokens (StreamingLLM keeps 4); fewer than any partition.
  static constexpr int max_sink_tokens = kvmosaic::max_sink_tokens;
  static int sink_rows(const format_type& f) { return f.sink_tokens; }
  static int window_rows(const format_type& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format_type& f, const page_shape& shape) {
    return detail::quant_layout_of(f, shape, true).bytes();
  }
  static std::size_t v_page_bytes(const format_type& f, const page_shape& shape) { return k_page_bytes(f, shape); }

  static void encode_k(const format_type& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant_page(f, shape, rows, /*is_key=*/true, page);
    if (f.k_axis == format::key_axis::tokens) detail::store_inner_code_sums(detail::quant_layout_of(f, shape, true), page);
  }
  static void encode_v(const format_type& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant_page(f, shape, rows, /*is_key=*/false, page);
    if constexpr (V == format::value_axis::head_dim) detail::store_inner_code_sums(detail::quant_layout_of(f, shape, false), page);
  }
  static void decode_k(const format_type& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/true, rows);
  }
  static void decode_v(const format_type& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/false, rows);
  }

  /// logits[g][t] = q[g] . k[t] on the codes (Eq. 4): q quantized to 8 bits per partition, one
  /// integer dot product per (token, partition) plus the correction terms. The page's codes are
  /// unpacked once for all G query heads. Cost: page_size x head_dim code unpacks, n G D integer
  /// multiply-adds, 4 n G D / Pi floating-point operations; no allocation.
  static void score(const format_type& f, const page_shape& shape, const std::byte* k_page, int n, const float* q,
                    int groups, float* logits) {
    if (f.k_axis == format::key_axis::tokens) {
      score_channel_partitioned(f, shape, k_page, n, q, groups, logits);
      return;
    }
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_token = d / pi;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(d, per_token);
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per_token; ++j)
        s.sum_a[static_cast<std::size_t>(j)] = detail::quantize8(q + static_cast<std::size_t>(g) * d + j * pi, pi, 1,
                                                                 s.m_a[static_cast<std::size_t>(j)], s.s_a[static_cast<std::size_t>(j)],
                                                                 s.a.data() + static_cast<std::size_t>(j) * pi);
      s.to_bytes(0, d);
      for (int t = 0; t < n; ++t) {
        const std::uint8_t* codes = s.codes.data() + static_cast<std::size_t>(t) * d;
        double logit = 0;
        for (int j = 0; j < per_token; ++j) {
          const int part = t * per_token + j;
          const int dot = detail::byte_dot(s.a8.data() + static_cast<std::size_t>(j) * pi, codes + static_cast<std::size_t>(j) * pi, pi);
          logit += detail::homomorphic_dot(pi, s.m_a[static_cast<std::size_t>(j)], s.s_a[static_cast<std::size_t>(j)],
                                           s.sum_a[static_cast<std::size_t>(j)], s.mins[static_cast<std::size_t>(part)],
                                           s.scales[static_cast<std::size_t>(part)], view.code_sum(part), static_cast<double>(dot));
        }
        logits[static_cast<std::size_t>(g) * n + t] = static_cast<float>(logit);
      }
    }
  }

  /// o[g] += sum_t p[g][t] v[t] on the codes (Eq. 4): p quantized to 8 bits per partition of Pi
  /// tokens (V per token: p' = p s_V per partition of Pi tokens and group of Pi channels). Pages
  /// are full (n = page_size): tails are dense. The page's codes are unpacked once for all G query
  /// heads. Cost as `score` (V per token: head_dim / Pi quantizations of p per partition instead of
  /// one).
  static void accumulate(const format_type& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    if constexpr (V == format::value_axis::head_dim) {
      accumulate_token_partitioned(f, shape, v_page, n, p, groups, o);
      return;
    }
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, false), v_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi;
    detail::require(n == shape.page_size, detail::quant_where<Bits, V>(), "accumulate's n", n, "page_size (sealed pages are full)");
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(pi, 1);
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per_channel; ++j) {
        float m_p = 0, s_p = 0;
        const unsigned sum_p = detail::quantize8(p + static_cast<std::size_t>(g) * n + j * pi, pi, 1, m_p, s_p, s.a.data());
        s.to_bytes(0, pi);
        for (int c = 0; c < d; ++c) {
          const int part = c * per_channel + j;
          const int dot = detail::byte_dot(s.a8.data(), s.codes.data() + static_cast<std::size_t>(c) * n + static_cast<std::size_t>(j) * pi, pi);
          o[static_cast<std::size_t>(g) * d + c] += static_cast<float>(detail::homomorphic_dot(
              pi, m_p, s_p, sum_p, s.mins[static_cast<std::size_t>(part)], s.scales[static_cast<std::size_t>(part)],
              view.code_sum(part), static_cast<double>(dot)));
        }
      }
    }
  }

 private:
  /// score with K partitioned along tokens: for the tokens of partition j, k_tc = m_cj + s_cj b_tc,
  /// so q.k_t = sum_c q_c m_cj + sum_c (q_c s_cj) b_tc. The first term is one number per j; the
  /// scales fold into q' = q * s_j, quantized to 8 bits per group of Pi channels, and Eq. 4 runs
  /// over channels with the stored per-token code sums (no m_b term: the mins are in the first).
  static void score_channel_partitioned(const format_type& f, const page_shape& shape, const std::byte* k_page, int n,
                                        const float* q, int groups, float* logits) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi, groups_of_channels = d / pi;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(d, groups_of_channels);
    for (int g = 0; g < groups; ++g) {
      const float* q_g = q + static_cast<std::size_t>(g) * d;
      for (int j = 0; j < per_channel && j * pi < n; ++j) {
        double base = 0;
        for (int c = 0; c < d; ++c) {
          const int part = c * per_channel + j;
          base += static_cast<double>(q_g[c]) * s.mins[static_cast<std::size_t>(part)];
          s.folded[static_cast<std::size_t>(c)] = q_g[c] * s.scales[static_cast<std::size_t>(part)];
        }
        for (int p = 0; p < groups_of_channels; ++p)
          detail::quantize8(s.folded.data() + static_cast<std::size_t>(p) * pi, pi, 1, s.m_a[static_cast<std::size_t>(p)],
                            s.s_a[static_cast<std::size_t>(p)], s.a.data() + static_cast<std::size_t>(p) * pi);
        s.to_bytes(0, d);
        for (int t = j * pi; t < std::min(n, (j + 1) * pi); ++t) {
          const std::uint8_t* codes = s.codes.data() + static_cast<std::size_t>(t) * d;
          double logit = base;
          for (int p = 0; p < groups_of_channels; ++p) {
            const int dot = detail::byte_dot(s.a8.data() + static_cast<std::size_t>(p) * pi, codes + static_cast<std::size_t>(p) * pi, pi);
            logit += static_cast<double>(s.m_a[static_cast<std::size_t>(p)]) * view.code_sum(t * groups_of_channels + p) +
                     static_cast<double>(s.s_a[static_cast<std::size_t>(p)]) * static_cast<double>(dot);
          }
          logits[static_cast<std::size_t>(g) * n + t] = static_cast<float>(logit);
        }
      }
    }
  }

  /// accumulate with V partitioned along head_dim: for the channels of group j, v_tc = m_tj +
  /// s_tj b_tc, so sum_t p_t v_tc = sum_t p_t m_tj + sum_t (p_t s_tj) b_tc. The first term is one
  /// number per (head, token partition, j); the scales fold into p' = p s_j, quantized to 8 bits
  /// per partition of Pi tokens, and Eq. 4 runs over tokens with the stored per-channel code sums
  /// (no m_b term: the mins are in the first).
  static void accumulate_token_partitioned(const format_type& f, const page_shape& shape, const std::byte* v_page, int n,
                                           const float* p, int groups, float* o) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, false), v_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi, channel_groups = d / pi;
    detail::require(n == shape.page_size, detail::quant_where<Bits, V>(), "accumulate's n", n,
                    "page_size (sealed pages are full)");
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(pi, 1);
    for (int g = 0; g < groups; ++g) {
      const float* p_g = p + static_cast<std::size_t>(g) * n;
      for (int j = 0; j < per_channel; ++j)
        for (int cg = 0; cg < channel_groups; ++cg) {
          double base = 0;
          for (int i = 0; i < pi; ++i) {
            const int t = j * pi + i, part = t * channel_groups + cg;
            base += static_cast<double>(p_g[t]) * s.mins[static_cast<std::size_t>(part)];
            s.folded[static_cast<std::size_t>(i)] = p_g[t] * s.scales[static_cast<std::size_t>(part)];
          }
          float m_p = 0, s_p = 0;
          detail::quantize8(s.folded.data(), pi, 1, m_p, s_p, s.a.data());
          s.to_bytes(0, pi);
          for (int c = cg * pi; c < (cg + 1) * pi; ++c) {
            const int dot = detail::byte_dot(s.a8.data(), s.codes.data() + static_cast<std::size_t>(c) * n + static_cast<std::size_t>(j) * pi, pi);
            o[static_cast<std::size_t>(g) * d + c] +=
                static_cast<float>(base + static_cast<double>(m_p) * view.code_sum(c * per_channel + j) +
                                   static_cast<double>(s_p) * static_cast<double>(dot));
          }
        }
    }
  }

  /// Dequantizes the first n tokens: x = m + s c for every element, from the unpacked codes.
  static void decode(const format_type& f, const page_shape& shape, const std::byte* page, int n, bool is_key,
                     float* rows) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, is_key), page};
    const detail::quant_layout& layout = view.layout;
    const int d = shape.head_dim, p = shape.page_size;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) {
        // the partition of (t, c) and the code matrix entry
        const int part = layout.partition_of(t, c);
        const int code = s.codes[is_key ? static_cast<std::size_t>(t) * d + c : static_cast<std::size_t>(c) * p + t];
        rows[static_cast<std::size_t>(t) * d + c] =
            s.mins[static_cast<std::size_t>(part)] + s.scales[static_cast<std::size_t>(part)] * static_cast<float>(code);
      }
  }
};

namespace detail {
/// A compaction re-encodes quantized pages from their dequantized rows with nearest rounding
/// whatever the cache's mode (values already on a partition's grid keep their codes when the
/// partition's members are unchanged; a changed partition gains at most half a step of its new
/// grid per element), at most `max_reencodes` times per page (docs/eviction.md, "quant2 and
/// re-encoding").
template <int Bits, format::value_axis V>
struct reencoding<format::quant<Bits, V>> {
  static format::quant<Bits, V> format(const format::quant<Bits, V>& f) {
    format::quant<Bits, V> nearest = f;
    nearest.mode = format::rounding::nearest;
    return nearest;
  }
  static int limit(const format::quant<Bits, V>& f) noexcept { return f.max_reencodes; }
};
/// A quantized format's first page is encoded with its sinks replaced by the first row after
/// them: a sink's large values would stretch the range of every partition it falls in.
template <int Bits, format::value_axis V>
struct hides_sink_rows<format::quant<Bits, V>> : std::true_type {};
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/format/quant.hpp> ----

// ---- begin <kvmosaic/format/packed_bitmap.hpp> ----
/// \file
/// `format::packed_bitmap`: MosaicKV's stage-1 two-D compression, per-vector channel compression
/// in a rotated basis (Qiang et al., "MosaicKV: Serving Long-Context LLM with Dynamic Two-D KV
/// Cache Compression", sections 4.2, 5.1, 5.2, 5.3 and 5.5). Host part: the segment basis and
/// strategy, encode, decode, and the host attend on the packed form (PackedAttention's math).
///
/// Segments. A sequence's pages are cut into segments of `segment_tokens` tokens (64K by
/// default, the paper's prefill segment). Per segment and KV head, K and V each get a basis: the
/// eigenvectors of the segment's uncentered covariance sum_t x_t x_t^T (the right singular
/// vectors of the segment's matrix, the paper's "SVD rotation"), by decreasing eigenvalue, each
/// signed so that its largest-magnitude component is positive (one answer for one input). The
/// last `truncated` fraction of the rotated channels (the least variance) is never stored and has
/// no bit in the bitmap (channel truncation, 5.2); the first `kept` = head_dim (1 - truncated)
/// columns are the basis B ([head_dim][kept], fp32).
///
/// Per vector (5.1). y = x B; the kept channels form kept / g groups of g adjacent channels; the
/// r / g groups of largest energy sum y_c^2 (ties: the lower group) are kept, the others are
/// zero. A token's record is a bitmap of one bit per group (bit j of 32-bit word j / 32) and its
/// r retained values, in group order, rounded to the storage dtype (16-bit). Decode is
/// x^ = y^ B^T. Energy rather than the sum of |y_c| ranks groups of g > 1: it is the choice that
/// minimizes ||y - y^||, and equals magnitude order at g = 1.
///
/// Strategy (5.5). `strategy::fixed` (the default) uses `retained` and `group` for every segment.
/// `strategy::search` picks, per segment, KV head and K or V, the highest compression rate among
/// 87.5%, 75%, 62.5% retaining at most `retained`, then the largest g in {4, 2, 1}, whose loss
/// stays at or below `loss_threshold`; none passing, it keeps `retained` at g = 1. The loss of a
/// candidate is the segment's relative squared error, sum_t ||x_t - x^_t||^2 / sum_t ||x_t||^2
/// (truncated energy included), before the 16-bit rounding. The token block size of the mean
/// keys (stage 2, `block_tokens` of the segment) is the largest of 16, 8, 4 whose mean
/// intra-block key variance, relative to the mean squared key norm, is at most
/// `block_variance_threshold`. Differences from the paper (docs/packed_bitmap.md): channels keep
/// eigenvalue order (no reordering by selection pattern before grouping); a pool slot is sized
/// for `retained` at the smallest group, so a searched segment that keeps less reads fewer bytes
/// but frees no memory.
///
/// PackedAttention's math (5.3). The query is rotated once per segment, q' = q B_k; a score is
/// q' . y^_k over a record's set bits (no unpacked tile); p . y^_v accumulates in the rotated V
/// space ([G][kept]); the output is rotated back once per segment, o = o' B_v^T. Equal to
/// attention over the decoded vectors, up to fp32 rounding.
///
/// Page layout (one head, K or V): [bitmaps: page_size x words x u32][values: page_size x r_slot
/// x 16-bit] padded to 16 bytes; words = ceil(kept / g_slot / 32), where r_slot = `retained` x
/// head_dim and g_slot = `group` (fixed) or 1 (search). A record shorter than the slot (a
/// searched strategy) leaves the rest zero. Per segment and KV head: B_k and B_v in fp32 and the
/// strategy, `format_traits::segment_bytes`. At head_dim 128, 25% retained, 25% truncated, g = 1:
/// 76 bytes a token for K or V against dense 256 (3.37x), plus 2 x 48 KB of bases per 64K-token
/// segment and KV head (0.3% of the dense bytes).
///
/// Non-finite inputs: a NaN or infinity in a segment makes its covariance non-finite; the
/// segment then uses the identity basis (no rotation) and the non-finite values stay in the
/// records that select them, so only the outputs that read them are affected.

#include <functional>

// ---- begin <kvmosaic/core/fused.hpp> ----
/// \file
/// Host fp32 loops in a fixed order of fused multiply-adds (`std::fma`: one rounding a step), the
/// order the CUDA kernels' FFMA chains follow, so that both backends compute the same bits.
///
/// x86 builds that do not target FMA hardware (the default) would call the C library's `fmaf` at
/// each step, several times slower; there a loop is also compiled for FMA hardware
/// (`__attribute__((target("fma")))`) and chosen at run time (`fma_hardware`). Both are exact:
/// the same bits.


#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && !defined(__FMA__) && \
    !defined(__CUDACC__)
#define KVMOSAIC_FMA_DISPATCH 1
#endif

namespace kvmosaic {
namespace detail {

#ifdef KVMOSAIC_FMA_DISPATCH
/// Whether this CPU has FMA instructions (checked once).
inline bool fma_hardware() noexcept {
  static const bool fma = __builtin_cpu_supports("fma") != 0;
  return fma;
}
#endif

namespace fused_detail {
template <int = 0>
inline void rotate(const float* x, int rows, const float* matrix, int cols, float* y) {
  std::fill(y, y + cols, 0.0f);
  for (int c = 0; c < rows; ++c) {
    const float xc = x[c];
    const float* row = matrix + static_cast<std::size_t>(c) * cols;
    for (int j = 0; j < cols; ++j) y[j] = std::fma(xc, row[j], y[j]);
  }
}
#ifdef KVMOSAIC_FMA_DISPATCH
__attribute__((target("fma"))) inline void rotate_fma(const float* x, int rows, const float* matrix, int cols, float* y) {
  rotate(x, rows, matrix, cols, y);  // inlined: std::fma is one instruction under this target
}
#endif
}  // namespace fused_detail

/// y = x M for x [rows] and M [rows][cols] (row-major, fp32): y_j accumulates x_c M_cj over
/// c = 0, 1, ... by fused multiply-adds from 0, the order of a device thread that owns y_j.
/// Cost: rows x cols fused multiply-adds.
inline void fused_rotate(const float* x, int rows, const float* matrix, int cols, float* y) {
#ifdef KVMOSAIC_FMA_DISPATCH
  if (fma_hardware()) {
    fused_detail::rotate_fma(x, rows, matrix, cols, y);
    return;
  }
#endif
  fused_detail::rotate(x, rows, matrix, cols, y);
}

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/core/fused.hpp> ----

#include <Eigen/Eigenvalues>

namespace kvmosaic {
namespace format {

/// How `packed_bitmap` chooses each segment's channel strategy.
enum class strategy {
  fixed,   ///< `retained` and `group` for every segment
  search,  ///< per segment, KV head, K and V: MosaicKV's candidate search (section 5.5)
};

/// MosaicKV's packed bitmap (sections 4-5): per segment a rotated basis, channel truncation,
/// and per vector the top groups by energy, stored as a bitmap and packed 16-bit values. Cost
/// per token (K or V): ceil(kept / g / 32) x 4 + retained x head_dim x 2 bytes. Encode: one
/// head_dim x kept product and a partial sort of kept / g groups per vector, plus per segment a
/// covariance (n x head_dim^2) and one eigendecomposition (head_dim^3). Attend: per segment one
/// rotation of the G queries and one of the G outputs (G x head_dim x kept each), per token r
/// multiply-adds per query head for q.k and for p.v. Source: MosaicKV, sections 4.2, 5.1-5.3, 5.5.
struct packed_bitmap {
  using policy_category = format_tag;
  float retained = 0.25f;        ///< channels a vector keeps, a fraction of head_dim (the paper: 25%); the slot's bound with `strategy::search`
  int group = 1;                 ///< g: adjacent rotated channels per bitmap bit, 1, 2 or 4
  float truncated = 0.25f;       ///< rotated channels never stored, a fraction of head_dim (the paper: the bottom 25%)
  int segment_tokens = 65536;    ///< tokens per segment (one basis per segment and KV head), a multiple of page_size
  strategy mode = strategy::fixed;
  float loss_threshold = 0.05f;  ///< `strategy::search`: the largest relative squared error a candidate may lose
  float block_variance_threshold = 0.5f;  ///< the largest relative intra-block key variance of a mean-key block
  int sink_tokens = 4;           ///< leading tokens always read exactly (0 to 16); 4 by measurement (docs/defaults.md)
  int recent_tokens = 0;         ///< latest sealed tokens always read exactly (0 to 1024), besides the tail
};

}  // namespace format

namespace detail {

/// One segment's choice for K or for V: r retained channels in groups of g.
struct packed_strategy {
  int retained = 0;  ///< r, a multiple of `group`
  int group = 1;     ///< g: 1, 2 or 4
};

/// A segment of one KV head: its K and V bases ([head_dim][kept], row-major, fp32), strategies,
/// and the token block size of its mean keys.
struct packed_segment {
  int kept = 0;
  std::vector<float> basis[2];  ///< [0]: K, [1]: V
  packed_strategy strategy[2];
  int block_tokens = 16;
};

/// Channel counts a format's fractions give at one head_dim.
struct packed_geometry {
  int head_dim = 0;
  int kept = 0;          ///< rotated channels stored (head_dim minus the truncated ones)
  int retained = 0;      ///< r of the slot
  int slot_group = 1;    ///< the smallest g the slot holds a bitmap for
  int words = 0;         ///< 32-bit bitmap words per record of the slot
  int page_size = 0;

  static packed_geometry of(const format::packed_bitmap& f, const page_shape& shape) {
    packed_geometry g;
    g.head_dim = shape.head_dim;
    g.page_size = shape.page_size;
    g.kept = shape.head_dim - static_cast<int>(std::lround(static_cast<double>(f.truncated) * shape.head_dim));
    g.retained = static_cast<int>(std::lround(static_cast<double>(f.retained) * shape.head_dim));
    g.slot_group = f.mode == format::strategy::fixed ? f.group : 1;
    g.words = bitmap_words(g.kept, g.slot_group);
    return g;
  }
  static int bitmap_words(int kept, int group) { return (kept / group + 31) / 32; }
  std::size_t bitmap_bytes() const { return static_cast<std::size_t>(page_size) * words * 4; }
  std::size_t page_bytes() const {
    const std::size_t bytes = bitmap_bytes() + static_cast<std::size_t>(page_size) * retained * 2;
    return (bytes + 15) / 16 * 16;
  }
  const std::uint32_t* bitmap(const std::byte* page, int t) const {
    return reinterpret_cast<const std::uint32_t*>(page) + static_cast<std::size_t>(t) * words;
  }
  std::uint32_t* bitmap(std::byte* page, int t) const {
    return reinterpret_cast<std::uint32_t*>(page) + static_cast<std::size_t>(t) * words;
  }
  std::size_t values_offset(int t) const { return bitmap_bytes() + static_cast<std::size_t>(t) * retained * 2; }
};

/// A segment's plan is made of sums over its rows that every backend computes in one order, so
/// that every backend fits the same bases, bit for bit: the segment's rows are cut into tiles of
/// `packed_sum_tile_rows` from its first row, each tile's sums run from zero in token order, and
/// the tiles' sums add up in tile order. Per KV head (`packed_sum_count` doubles, this layout):
///   [0, d^2)           K's covariance sum_t k_t k_t^T, row-major, the lower triangle (i >= j)
///                      (the upper one is zero);
///   [d^2, 2 d^2)       V's, the same;
///   [2 d^2, 2 d^2 + d) K's per-channel squared norms sum_t k_tc^2;
///   then 3 x d         K's per-channel intra-block squared deviations sum_t (k_tc - mean_c)^2 of
///                      the whole blocks of 16, 8 and 4 rows (blocks from the segment's first row;
///                      mean_c the block's fp64 sum in token order over its count; each term one
///                      fused multiply-add).
/// Every other term is a product of two fp32 values, exact in fp64, so a fused and an unfused
/// multiply-add give the same sum. The CUDA engine computes these sums on the device
/// (cuda/format/packed_bitmap/segment_sums.cuh) and only the eigendecompositions on the host.
inline constexpr int packed_sum_tile_rows = 2048;

KVMOSAIC_HOST_DEVICE constexpr std::size_t packed_sum_count(int head_dim) {
  return 2 * static_cast<std::size_t>(head_dim) * head_dim + 4 * static_cast<std::size_t>(head_dim);
}

/// The sums of one tile (`rows` <= packed_sum_tile_rows rows from a multiple of the tile size;
/// K and V [rows][head_dim]) into `out` (`packed_sum_count` doubles, overwritten), each from zero
/// in token order. Cost: head_dim (head_dim + 1) multiply-adds a row for each covariance, four
/// passes over K for the norms and deviations.
inline void packed_tile_sums(const float* k, const float* v, std::int64_t rows, int head_dim, double* out) {
  const std::size_t d = static_cast<std::size_t>(head_dim);  // unsigned offsets
  const auto n = static_cast<std::size_t>(std::min<std::int64_t>(rows, packed_sum_tile_rows));  // a tile at most
  std::fill(out, out + packed_sum_count(head_dim), 0.0);
  std::vector<double> x(4 * d);
  for (std::size_t which = 0; which < 2; ++which) {
    const float* in = which == 0 ? k : v;
    double* covariance = out + which * d * d;
    for (std::size_t t = 0; t < n; t += 4) {  // four rows at a time: each entry still adds them in token order
      const std::size_t m = std::min<std::size_t>(4, n - t);
      std::copy(in + t * d, in + (t + m) * d, x.begin());
      const double *x0 = x.data(), *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
      for (std::size_t i = 0; i < d; ++i) {
        double* row = covariance + i * d;
        if (m == 4) {
          for (std::size_t j = 0; j <= i; ++j) {
            double a = row[j];
            a += x0[i] * x0[j];
            a += x1[i] * x1[j];
            a += x2[i] * x2[j];
            a += x3[i] * x3[j];
            row[j] = a;
          }
        } else {
          for (std::size_t r = 0; r < m; ++r)
            for (std::size_t j = 0; j <= i; ++j) row[j] += x[r * d + i] * x[r * d + j];
        }
      }
    }
  }
  double* norms = out + 2 * d * d;
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t c = 0; c < d; ++c) norms[c] += static_cast<double>(k[t * d + c]) * k[t * d + c];
  const std::size_t sizes[3] = {16, 8, 4};
  for (std::size_t s = 0; s < 3; ++s) {
    const std::size_t b = sizes[s];
    double* deviations = norms + (1 + s) * d;
    for (std::size_t first = 0; first + b <= n; first += b)
      for (std::size_t c = 0; c < d; ++c) {
        double mean = 0;
        for (std::size_t t = 0; t < b; ++t) mean += k[(first + t) * d + c];
        mean /= static_cast<double>(b);
        for (std::size_t t = 0; t < b; ++t) {
          const double e = k[(first + t) * d + c] - mean;
          deviations[c] = std::fma(e, e, deviations[c]);
        }
      }
  }
}

/// A segment's sums (`out`: `packed_sum_count` doubles) from its K and V rows ([n][head_dim]):
/// the tiles' sums added in tile order to zero.
inline void packed_segment_sums(const float* k, const float* v, std::int64_t n, int head_dim, double* out) {
  const std::size_t count = packed_sum_count(head_dim);
  std::fill(out, out + count, 0.0);
  std::vector<double> tile(count);
  for (std::int64_t first = 0; first < n; first += packed_sum_tile_rows) {
    const std::int64_t offset = first * head_dim;
    packed_tile_sums(k + offset, v + offset, std::min<std::int64_t>(packed_sum_tile_rows, n - first), head_dim, tile.data());
    for (std::size_t e = 0; e < count; ++e) out[e] += tile[e];
  }
}

/// The basis of a segment of n rows from their covariance (`covariance`: [head_dim][head_dim],
/// the lower triangle read): the first `kept` eigenvectors (fp64) by decreasing eigenvalue, each
/// with its largest-magnitude component positive; [head_dim][kept] row-major. A non-finite
/// covariance or n = 0: the first `kept` columns of the identity.
/// A template (Real is double at every call), as are `packed_search` and `plan_segment`, so that
/// Eigen's eigensolver and products are instantiated only in the units that encode this format,
/// not in every unit that includes the library.
template <class Real>
std::vector<float> packed_basis(const Real* covariance, std::int64_t n, int head_dim, int kept) {
  using real_matrix = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>;
  std::vector<float> basis(static_cast<std::size_t>(head_dim) * kept, 0.0f);
  real_matrix sigma(head_dim, head_dim);
  bool finite = true;
  for (int i = 0; i < head_dim; ++i)
    for (int j = 0; j <= i; ++j) {
      const Real value = covariance[static_cast<std::size_t>(i) * head_dim + j];
      finite = finite && std::isfinite(value);
      sigma(i, j) = value;
      sigma(j, i) = value;
    }
  if (n == 0 || !finite) {
    for (int j = 0; j < kept; ++j) basis[static_cast<std::size_t>(j) * kept + j] = 1.0f;
    return basis;
  }
  const Eigen::SelfAdjointEigenSolver<real_matrix> solver(sigma);
  for (int j = 0; j < kept; ++j) {
    Eigen::Matrix<Real, Eigen::Dynamic, 1> column = solver.eigenvectors().col(head_dim - 1 - j);  // ascending eigenvalues
    Eigen::Index largest = 0;
    column.cwiseAbs().maxCoeff(&largest);
    if (column(largest) < 0) column = -column;
    for (int c = 0; c < head_dim; ++c) basis[static_cast<std::size_t>(c) * kept + j] = static_cast<float>(column(c));
  }
  return basis;
}

/// Each group's energy: energy[j] = the squares of y[j g .. j g + g) added in order from 0, for
/// the kept / g groups of y ([kept]). Each square is rounded to fp32 before it is added (the
/// product of two fp32 values is exact in fp64), so that no contraction into a fused
/// multiply-add changes the bits a device computes.
inline void packed_group_energies(const float* y, int kept, int group, std::vector<float>& energy) {
  energy.assign(static_cast<std::size_t>(kept / group), 0.0f);
  for (int j = 0; j < kept / group; ++j)
    for (int i = 0; i < group; ++i) {
      const double value = y[j * group + i];
      energy[static_cast<std::size_t>(j)] += static_cast<float>(value * value);
    }
}

/// The order a record ranks its groups in (a strict total order): NaN first (a record keeps what
/// it cannot judge), then higher energy, then the lower group.
struct packed_group_order {
  const float* energy;
  bool operator()(int a, int b) const {
    const float ea = energy[a], eb = energy[b];
    if (std::isnan(ea) != std::isnan(eb)) return std::isnan(ea);
    return ea > eb || (!(ea < eb) && a < b);
  }
};

/// The groups a record keeps: of the kept / g groups of y ([kept]), the r / g first in
/// `packed_group_order`, in increasing order, into `chosen`.
inline void packed_choose_groups(const float* y, int kept, const packed_strategy& s, std::vector<int>& order,
                                 std::vector<float>& energy, std::vector<int>& chosen) {
  const int keep = s.retained / s.group;
  packed_group_energies(y, kept, s.group, energy);
  order.resize(energy.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), packed_group_order{energy.data()});
  chosen.assign(order.begin(), order.begin() + keep);
  std::sort(chosen.begin(), chosen.end());
}

/// Adds to `stored[m]`, for each of `count` rates keeping `keep[m]` groups, the energies of the
/// groups that `packed_choose_groups` keeps of one row (`energy`, `groups` of them, no NaN), in
/// increasing group order. A rate keeps every group above its threshold, the keep-th largest
/// energy, and of those equal to it the lowest-numbered (`packed_group_order`). Up to 128 groups
/// each group's place in that order is counted without branches (G^2 comparisons, which the
/// compiler vectorizes); past that the thresholds come from selections (`std::nth_element`, from
/// the deepest rate down, each on the prefix the one before left), O(G) but branchy: each is the
/// faster there by measurement (benchmark/README.md, "packed_bitmap's strategy search without
/// branches"). The sums skip no group: a group a rate leaves adds 0, which leaves a sum of
/// non-negative energies as it was, bit for bit.
inline void packed_add_kept(const float* energy, int groups, const int* keep, int count, double* stored,
                            std::vector<int>& rank, std::vector<float>& selected) {
  if (groups <= 128) {
    rank.resize(static_cast<std::size_t>(groups));
    for (int j = 0; j < groups; ++j) {  // before j: higher or equal energy; from j on: higher
      const float ej = energy[j];
      int before = 0;
      for (int i = 0; i < j; ++i) before += static_cast<int>(energy[i] >= ej);
      for (int i = j + 1; i < groups; ++i) before += static_cast<int>(energy[i] > ej);
      rank[static_cast<std::size_t>(j)] = before;
    }
    for (int m = 0; m < count; ++m) {
      double sum = stored[m];
      for (int j = 0; j < groups; ++j) sum += rank[static_cast<std::size_t>(j)] < keep[m] ? static_cast<double>(energy[j]) : 0.0;
      stored[m] = sum;
    }
    return;
  }
  selected.assign(energy, energy + groups);
  int prefix = groups;
  for (int m = 0; m < count; ++m) {
    const auto nth = selected.begin() + (keep[m] - 1);
    std::nth_element(selected.begin(), nth, selected.begin() + prefix, std::greater<float>());
    const float threshold = *nth;
    // The groups equal to the threshold it keeps: keep less those above it.
    int ties = keep[m] - static_cast<int>(std::count_if(selected.begin(), nth, [&](float e) { return e > threshold; }));
    prefix = keep[m];
    double sum = stored[m];
    for (int j = 0; j < groups; ++j) {
      const bool tie = energy[j] == threshold;
      const bool take = energy[j] > threshold || (tie && ties > 0);
      ties -= static_cast<int>(tie);
      sum += take ? static_cast<double>(energy[j]) : 0.0;
    }
    stored[m] = sum;
  }
}

/// The strategy search's sums are made, like the plan's, in one order that every backend follows,
/// so that a device computes them in parallel and both backends choose the same strategies: the
/// segment's rows are cut into chunks of `packed_search_chunk_rows` from its first; each row is
/// rotated by `fused_rotate` (the device's chains), and its squared norm and, per candidate, the
/// energies of the groups it keeps are summed from zero (channels, then groups, in order); a
/// chunk adds its rows in order from zero, and the chunks add up in order. Per K or V matrix and
/// chunk, `packed_search_sum_count` doubles: the rows' squared norms, then each candidate's kept
/// energy in `packed_candidates`' order (zeros past its last).
inline constexpr int packed_search_chunk_rows = 64;
inline constexpr int packed_max_candidates = 9;  ///< `packed_candidates`: three rates, three group sizes
inline constexpr int packed_search_sum_count = 1 + packed_max_candidates;

/// A row's squared norm: sum_c x_c^2 from zero in channel order (fp64; each square exact).
inline double packed_row_norm(const float* x, int head_dim) {
  double sum = 0;
  for (int c = 0; c < head_dim; ++c) sum += static_cast<double>(x[c]) * x[c];
  return sum;
}

/// Sets `stored[i]`, for every candidate i of group size `group` (`candidates[i].group`), to the
/// energy it keeps of one chunk's rotated rows y ([rows][kept]) in the search's order: per row
/// what `packed_choose_groups` keeps, its groups' energies added in increasing group order from
/// zero, the rows added in order from zero. One pass over the rows for all rates of a group size
/// (`packed_add_kept`); a row with a NaN energy makes every rate's sum NaN. Cost per row: G^2
/// vectorized comparisons (G = kept / group <= 128) or three selections of G, and G steps a rate.
inline void packed_chunk_stored(const float* y, int rows, int kept, const std::vector<packed_strategy>& candidates, int group,
                                double* stored) {
  constexpr int max_rates = 3;  // `packed_candidates`: three rates at most a group size
  std::size_t rates[max_rates] = {};
  int keep[max_rates] = {}, count = 0;
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (candidates[i].group == group) {
      require(count < max_rates, "packed_chunk_stored", "candidates of one group size", count + 1, "at most 3");
      rates[count++] = i;
    }
  // Deepest first: the selections narrow from its groups (an insertion sort of at most three).
  for (int m = 1; m < count; ++m)
    for (int k = m; k > 0 && candidates[rates[k - 1]].retained < candidates[rates[k]].retained; --k) std::swap(rates[k - 1], rates[k]);
  for (int m = 0; m < count; ++m) keep[m] = candidates[rates[m]].retained / group;
  const int groups = kept / group;
  std::vector<float> energy, selected;
  std::vector<int> rank;
  double chunk[max_rates] = {};
  for (int t = 0; t < rows; ++t) {
    double row[max_rates] = {};
    packed_group_energies(y + static_cast<std::size_t>(t) * kept, kept, group, energy);
    if (std::any_of(energy.begin(), energy.end(), [](float e) { return std::isnan(e); }))
      for (double& sum : row) sum = std::numeric_limits<double>::quiet_NaN();
    else
      packed_add_kept(energy.data(), groups, keep, count, row, rank, selected);
    for (int m = 0; m < count; ++m) chunk[m] += row[m];
  }
  for (int m = 0; m < count; ++m) stored[rates[m]] = chunk[m];
}

/// A candidate's loss, the relative squared error (total - kept) / total, from the rows' squared
/// norms (the truncated energy counts as lost) and the energy it keeps: 0 for a zero segment.
inline double packed_loss(double total, double kept) { return total > 0 ? std::max(0.0, (total - kept) / total) : 0.0; }

/// The strategies `strategy::search` tries, in the order it tries them: rate first (87.5%, 75%,
/// 62.5% compression: 1/8, 2/8, 3/8 of head_dim retained, none above the slot's r), then g = 4,
/// 2, 1 (a g that does not divide kept, r and the slot's r is skipped: a record then starts on a
/// whole group, which the CUDA kernel loads at once).
inline std::vector<packed_strategy> packed_candidates(const packed_geometry& g) {
  std::vector<packed_strategy> candidates;
  for (const int eighths : {1, 2, 3}) {
    const int r = g.head_dim * eighths / 8;
    if (r > g.retained) continue;
    for (const int group : {4, 2, 1})
      if (g.kept % group == 0 && r % group == 0 && g.retained % group == 0) candidates.push_back({r, group});
  }
  return candidates;
}

/// The search's first pass over one K or V matrix of a segment (n rows [n][head_dim], its basis
/// [head_dim][kept]): the rows rotated into y ([n][kept], `fused_rotate`), and each chunk's sums
/// (`sums`: [chunks][stride]) set to its rows' squared norms, then zeros. Cost per row: head_dim x
/// kept fused multiply-adds.
template <class Float>
void packed_search_rotate(const packed_geometry& g, const Float* rows, std::int64_t n, const std::vector<float>& basis, float* y,
                          double* sums, std::size_t stride) {
  for (std::int64_t first = 0, chunk = 0; first < n; first += packed_search_chunk_rows, ++chunk) {
    double* out = sums + static_cast<std::size_t>(chunk) * stride;
    std::fill(out, out + packed_search_sum_count, 0.0);
    for (std::int64_t t = first; t < std::min<std::int64_t>(n, first + packed_search_chunk_rows); ++t) {
      out[0] += packed_row_norm(rows + static_cast<std::size_t>(t) * g.head_dim, g.head_dim);
      fused_rotate(rows + static_cast<std::size_t>(t) * g.head_dim, g.head_dim, basis.data(), g.kept, y + static_cast<std::size_t>(t) * g.kept);
    }
  }
}

/// The search's pass for the candidates of group size `group` over rotated rows y ([n][kept]):
/// each chunk's sums (`packed_chunk_stored`) into its entries 1 + i. Cost per row: as
/// `packed_chunk_stored`'s.
inline void packed_search_pass(const float* y, std::int64_t n, int kept, const std::vector<packed_strategy>& candidates, int group,
                               double* sums, std::size_t stride) {
  for (std::int64_t first = 0, chunk = 0; first < n; first += packed_search_chunk_rows, ++chunk)
    packed_chunk_stored(y + static_cast<std::size_t>(first) * kept, static_cast<int>(std::min<std::int64_t>(packed_search_chunk_rows, n - first)),
                        kept, candidates, group, sums + static_cast<std::size_t>(chunk) * stride + 1);
}

/// Entry `index` of every chunk's sums (`sums` [chunks][stride]) added in chunk order.
inline double packed_chunks_added(const double* sums, std::size_t stride, std::int64_t chunks, int index) {
  double sum = 0;
  for (std::int64_t c = 0; c < chunks; ++c) sum += sums[static_cast<std::size_t>(c) * stride + index];
  return sum;
}

/// The search's sums of one K or V matrix of a segment for every candidate of
/// `packed_candidates(g)`, into `sums` ([chunks][stride]: each chunk's `packed_search_sum_count`
/// doubles at its start), in the search's order: what a device computes
/// (cuda/format/packed_bitmap/search_sums.cuh). Cost: `packed_search_rotate` and a pass per group
/// size; n x kept floats of scratch.
template <class Float>
void packed_search_sums(const packed_geometry& g, const Float* rows, std::int64_t n, const std::vector<float>& basis, double* sums,
                        std::size_t stride) {
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  std::vector<float> y(static_cast<std::size_t>(n) * g.kept);
  packed_search_rotate(g, rows, n, basis, y.data(), sums, stride);
  for (const int group : {4, 2, 1})
    if (std::any_of(candidates.begin(), candidates.end(), [&](const packed_strategy& c) { return c.group == group; }))
      packed_search_pass(y.data(), n, g.kept, candidates, group, sums, stride);
}

/// The strategy of one K or V matrix of a segment from its search's sums (`packed_search_sums`,
/// or a device's: [chunks][stride], the chunks of n rows): `strategy::fixed`'s, or the first
/// candidate whose loss (the chunks' sums added in order) is at most `loss_threshold`, else the
/// slot's (r, g = 1).
inline packed_strategy packed_search_from_sums(const format::packed_bitmap& f, const packed_geometry& g, std::int64_t n,
                                               const double* sums, std::size_t stride) {
  if (f.mode == format::strategy::fixed) return {g.retained, f.group};
  const packed_strategy fallback{g.retained, 1};
  if (n == 0) return fallback;
  const std::int64_t chunks = (n + packed_search_chunk_rows - 1) / packed_search_chunk_rows;
  const double total = packed_chunks_added(sums, stride, chunks, 0);
  if (!std::isfinite(total)) return fallback;
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (packed_loss(total, packed_chunks_added(sums, stride, chunks, 1 + static_cast<int>(i))) <= f.loss_threshold) return candidates[i];
  return fallback;
}

/// The strategy of one K or V matrix of a segment from its rows: what `packed_search_from_sums`
/// chooses from `packed_search_sums`, bit for bit, with each group size's pass made only when one
/// of its candidates is tried.
template <class Float>
packed_strategy packed_search(const format::packed_bitmap& f, const packed_geometry& g, const Float* rows,
                              std::int64_t n, const std::vector<float>& basis) {
  if (f.mode == format::strategy::fixed || n == 0) return packed_search_from_sums(f, g, n, nullptr, 0);
  const packed_strategy fallback{g.retained, 1};
  const std::int64_t chunks = (n + packed_search_chunk_rows - 1) / packed_search_chunk_rows;
  constexpr std::size_t stride = packed_search_sum_count;
  std::vector<double> sums(static_cast<std::size_t>(chunks) * stride);
  std::vector<float> y(static_cast<std::size_t>(n) * g.kept);
  packed_search_rotate(g, rows, n, basis, y.data(), sums.data(), stride);
  const double total = packed_chunks_added(sums.data(), stride, chunks, 0);
  if (!std::isfinite(total)) return fallback;
  const std::vector<packed_strategy> candidates = packed_candidates(g);
  bool passed[5] = {};  // by group size
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const int group = candidates[i].group;
    if (!passed[group]) packed_search_pass(y.data(), n, g.kept, candidates, group, sums.data(), stride);
    passed[group] = true;
    if (packed_loss(total, packed_chunks_added(sums.data(), stride, chunks, 1 + static_cast<int>(i))) <= f.loss_threshold) return candidates[i];
  }
  return fallback;
}

/// The mean-key block size of a segment of n rows from its K sums (`norms` [head_dim], then
/// `deviations` [3][head_dim] for blocks of 16, 8, 4; `packed_segment_sums`): the largest of 16, 8,
/// 4 whose intra-block variance (the deviations summed over channels in order, over the rows of
/// whole blocks), relative to the mean squared key norm, is at most `threshold` (4 when none; 16
/// for fewer than 4 rows or a zero segment).
inline int packed_block_tokens(const double* norms, std::int64_t n, int head_dim, float threshold) {
  double norm = 0;
  for (int c = 0; c < head_dim; ++c) norm += norms[c];
  if (n < 4 || !(norm > 0) || !std::isfinite(norm)) return 16;
  norm /= static_cast<double>(n);
  const int sizes[3] = {16, 8, 4};
  for (int s = 0; s < 3; ++s) {
    double variance = 0;
    for (int c = 0; c < head_dim; ++c) variance += norms[static_cast<std::size_t>(1 + s) * head_dim + c];
    const std::int64_t counted = n / sizes[s] * sizes[s];
    if (counted > 0 && variance / static_cast<double>(counted) / norm <= threshold) return sizes[s];
  }
  return 4;
}

}  // namespace detail

template <>
struct format_traits<format::packed_bitmap> {
  using format_type = format::packed_bitmap;
  using segment = detail::packed_segment;
  static constexpr const char* name = "packed_bitmap";
  static constexpr bool has_segments = true;

  static std::string describe(const format_type& f) {
    char text[160];
    std::snprintf(text, sizeof(text), "packed_bitmap(retained%g,g%d,truncated%g,segment%d%s", static_cast<double>(f.retained),
                  f.group, static_cast<double>(f.truncated), f.segment_tokens, f.mode == format::strategy::search ? ",search" : "");
    return std::string(text) + detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens) + ")";
  }

  static void validate(const format_type& f, const page_shape& shape) {
    const char* where = "format::packed_bitmap";
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage", to_string(shape.storage), "f16 or bf16");
    detail::require(f.group == 1 || f.group == 2 || f.group == 4, where, "group", f.group, "1, 2 or 4");
    detail::require(f.truncated >= 0.0f && f.truncated < 1.0f, where, "truncated", f.truncated,
                    "0 <= truncated < 1 (a truncation of every channel leaves nothing)");
    const double kept_exact = (1.0 - static_cast<double>(f.truncated)) * shape.head_dim;
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    detail::require(std::abs(kept_exact - g.kept) < 1e-3 && g.kept >= 1, where, "truncated", f.truncated,
                    "a fraction leaving a whole number (>= 1) of head_dim's channels");
    detail::require(g.kept % f.group == 0, where, "group", f.group, "a divisor of the kept channel count");
    detail::require(f.retained > 0.0f && std::abs(static_cast<double>(f.retained) * shape.head_dim - g.retained) < 1e-3 &&
                        g.retained >= 1, where, "retained", f.retained, "a fraction giving a whole number (>= 1) of channels");
    detail::require(g.retained <= g.kept, where, "retained", f.retained, "at most 1 - truncated (the kept channels)");
    detail::require(g.retained % f.group == 0, where, "retained", f.retained, "a whole number of groups of `group` channels");
    detail::require(f.segment_tokens >= shape.page_size && f.segment_tokens % shape.page_size == 0, where, "segment_tokens",
                    f.segment_tokens, "a positive multiple of page_size");
    detail::require(f.mode == format::strategy::fixed || f.mode == format::strategy::search, where, "mode",
                    static_cast<int>(f.mode), "strategy::fixed or strategy::search");
    detail::require(f.loss_threshold >= 0.0f && f.loss_threshold <= 1.0f, where, "loss_threshold", f.loss_threshold, "0 to 1");
    detail::require(f.block_variance_threshold >= 0.0f, where, "block_variance_threshold", f.block_variance_threshold, ">= 0");
    detail::require(shape.head_dim <= 256, where, "head_dim", shape.head_dim, "at most 256 (block keys index channels in 8 bits)");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
  }
  static int sink_rows(const format_type& f) { return f.sink_tokens; }
  static int window_rows(const format_type& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format_type& f, const page_shape& shape) {
    return detail::packed_geometry::of(f, shape).page_bytes();
  }
  static std::size_t v_page_bytes(const format_type& f, const page_shape& shape) { return k_page_bytes(f, shape); }

  /// Pages per segment.
  static int segment_pages(const format_type& f, const page_shape& shape) { return f.segment_tokens / shape.page_size; }
  /// Channels of the rotated space (the query and output of a segment's attend have this many).
  static int basis_dim(const format_type& f, const page_shape& shape) { return detail::packed_geometry::of(f, shape).kept; }
  /// Bytes one segment keeps per KV head besides its pages: B_k and B_v in fp32 and the two
  /// strategies and block size (3 x 2 x 4 bytes).
  static std::size_t segment_bytes(const format_type& f, const page_shape& shape) {
    return 2 * static_cast<std::size_t>(shape.head_dim) * basis_dim(f, shape) * 4 + 24;
  }

  /// The segment of one KV head from its K and V rows ([n][head_dim], the rows the basis is fit
  /// to): bases, strategies (searched or fixed) and mean-key block size, from the rows' sums
  /// (`segment_sums`) and, with `strategy::search`, the rows. Cost: the sums (2 n head_dim^2
  /// multiply-adds), 2 eigendecompositions, and with `strategy::search` up to 9 candidate passes
  /// over the n rotated rows.
  template <class Float>  // float: a template only to defer Eigen's instantiation (detail::packed_basis)
  static segment plan_segment(const format_type& f, const page_shape& shape, const Float* k, const Float* v, std::int64_t n) {
    std::vector<double> sums(segment_sum_count(f, shape));
    detail::packed_segment_sums(k, v, n, shape.head_dim, sums.data());
    return plan_segment_from_sums(f, shape, sums.data(), n, k, v);
  }

  // A plan from sums (an optional part of a format with segments, which a device may compute):
  // the CUDA engine computes a segment's sums on the device, in the order `segment_sums`
  // defines, and copies back only them (and the rows, when `plan_reads_rows`).

  /// Doubles of one segment's sums per KV head (`detail::packed_segment_sums` says what they are).
  static std::size_t segment_sum_count(const format_type&, const page_shape& shape) { return detail::packed_sum_count(shape.head_dim); }
  /// Rows of a tile of the sums: each tile's sums run from zero, and tiles add up in order.
  static constexpr int segment_sum_tile_rows = detail::packed_sum_tile_rows;
  /// The sums of a segment's rows K and V ([n][head_dim]) into `out` (`segment_sum_count`).
  static void segment_sums(const format_type&, const page_shape& shape, const float* k, const float* v, std::int64_t n, double* out) {
    detail::packed_segment_sums(k, v, n, shape.head_dim, out);
  }
  /// Whether the plan reads the rows besides their sums: `strategy::search` (its candidate passes).
  static bool plan_reads_rows(const format_type& f) { return f.mode == format::strategy::search; }
  /// The segment of one KV head from its n rows' sums (`segment_sums`) and, when
  /// `plan_reads_rows`, its rows. With k and v null the strategies a search would choose are left
  /// to `search_segment_from_sums` (the slot's r at g = 1 until then). Cost: 2 eigendecompositions
  /// (head_dim^3) and the search's passes.
  template <class Float>
  static segment plan_segment_from_sums(const format_type& f, const page_shape& shape, const double* sums, std::int64_t n,
                                        const Float* k, const Float* v) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const int d = shape.head_dim;
    segment s;
    s.kept = g.kept;
    for (int which = 0; which < 2; ++which) {
      s.basis[which] = detail::packed_basis(sums + static_cast<std::size_t>(which) * d * d, n, d, g.kept);
      const Float* rows = which == 0 ? k : v;
      s.strategy[which] = plan_reads_rows(f) && rows == nullptr ? detail::packed_strategy{g.retained, 1}
                                                                : detail::packed_search(f, g, rows, n, s.basis[which]);  // fixed: reads no row
    }
    s.block_tokens = detail::packed_block_tokens(sums + 2 * static_cast<std::size_t>(d) * d, n, d, f.block_variance_threshold);
    return s;
  }

  // The search from sums (an optional part of a format whose plan reads rows): a device computes
  // the search's sums over a segment's rows in the segment's bases, in the order
  // `detail::packed_search_chunk_rows` defines, and copies back only them.

  /// Rows of a chunk of the search's sums.
  static constexpr int segment_search_chunk_rows = detail::packed_search_chunk_rows;
  /// Doubles of the search's sums per KV head and chunk: K's, then V's
  /// (`detail::packed_search_sum_count` each).
  static std::size_t segment_search_sum_count(const format_type&, const page_shape&) { return 2 * detail::packed_search_sum_count; }
  /// The strategies of a segment planned without rows (`plan_segment_from_sums`) from the search's
  /// sums of its n rows (`sums`: [chunks][segment_search_sum_count]): those `plan_segment_from_sums`
  /// chooses from the rows, bit for bit. Cost: 2 x 10 sums over the chunks.
  static void search_segment_from_sums(const format_type& f, const page_shape& shape, segment& s, std::int64_t n, const double* sums) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const std::size_t stride = segment_search_sum_count(f, shape);
    for (int which = 0; which < 2; ++which)
      s.strategy[which] = detail::packed_search_from_sums(f, g, n, sums + static_cast<std::size_t>(which) * detail::packed_search_sum_count, stride);
  }

  static void encode_k(const format_type& f, const page_shape& shape, const segment& s, const float* rows, std::byte* page) {
    encode(f, shape, s, 0, rows, page);
  }
  static void encode_v(const format_type& f, const page_shape& shape, const segment& s, const float* rows, std::byte* page) {
    encode(f, shape, s, 1, rows, page);
  }
  /// x^ = y^ B^T for the first n records.
  static void decode_k(const format_type& f, const page_shape& shape, const segment& s, const std::byte* page, int n, float* rows) {
    decode(f, shape, s, 0, page, n, rows);
  }
  static void decode_v(const format_type& f, const page_shape& shape, const segment& s, const std::byte* page, int n, float* rows) {
    decode(f, shape, s, 1, page, n, rows);
  }

  /// q' = q B_k: the G queries ([G][head_dim]) in the segment's K basis ([G][kept]).
  static void enter_segment(const format_type&, const page_shape& shape, const segment& s, const float* q, int groups, float* q_basis) {
    host::row_matrix_map(q_basis, groups, s.kept).noalias() =
        host::const_row_matrix_map(q, groups, shape.head_dim) * host::const_row_matrix_map(s.basis[0].data(), shape.head_dim, s.kept);
  }
  /// o = o' B_v^T: the G outputs of a segment ([G][kept], rotated V space) back in head_dim.
  static void leave_segment(const format_type&, const page_shape& shape, const segment& s, const float* o_basis, int groups, float* o) {
    host::row_matrix_map(o, groups, shape.head_dim).noalias() =
        host::const_row_matrix_map(o_basis, groups, s.kept) *
        host::const_row_matrix_map(s.basis[1].data(), shape.head_dim, s.kept).transpose();
  }

  /// logits[g][t] = q'[g] . y^_t over record t's set bits, for the first n records. Cost: r
  /// multiply-adds per token and query head, plus one pass over the bitmap.
  static void score(const format_type& f, const page_shape& shape, const segment& s, const std::byte* k_page, int n,
                    const float* q_basis, int groups, float* logits) {
    for_each_record(f, shape, s, 0, k_page, n, [&](int t, int channel, float value) {
      for (int g = 0; g < groups; ++g) logits[static_cast<std::size_t>(g) * n + t] += q_basis[static_cast<std::size_t>(g) * s.kept + channel] * value;
    }, [&](int t) {
      for (int g = 0; g < groups; ++g) logits[static_cast<std::size_t>(g) * n + t] = 0.0f;
    });
  }
  /// o'[g] += sum_t p[g][t] y^_t (rotated V space, [G][kept]) for the first n records.
  static void accumulate(const format_type& f, const page_shape& shape, const segment& s, const std::byte* v_page, int n,
                         const float* p, int groups, float* o_basis) {
    for_each_record(f, shape, s, 1, v_page, n, [&](int t, int channel, float value) {
      for (int g = 0; g < groups; ++g)
        o_basis[static_cast<std::size_t>(g) * s.kept + channel] += p[static_cast<std::size_t>(g) * n + t] * value;
    }, [](int) {});
  }

  // Block keys: MosaicKV's per-block keys, "channel-compressed together with the original K
  // vectors" (section 5.2), which `select::mean_keys` keeps and scores in place of dense rows.
  static constexpr bool has_block_keys = true;

  /// Bytes of one block key of one KV head (`block_key_layout` of the slot's r pairs): 96 at
  /// head_dim 128 and 25% retained, against 256 for a dense mean row.
  static std::size_t block_key_bytes(const format_type& f, const page_shape& shape) {
    return static_cast<std::size_t>(block_key_layout{detail::packed_geometry::of(f, shape).retained}.bytes());
  }

  /// The (channel, value) pairs a block key holds: the slot's r.
  static int block_key_values(const format_type& f, const page_shape& shape) { return detail::packed_geometry::of(f, shape).retained; }

  /// The block key of a block's fp32 mean key ([head_dim]) in segment `s`: y = mean B_k (each
  /// rotated channel summed over the head_dim channels in order by fused multiply-adds:
  /// `detail::fused_rotate`, the device's order), the r / g groups of largest energy under the
  /// segment's K strategy (`packed_choose_groups`, as a key's record), stored as each kept
  /// channel's index and value in channel order, the values rounded to the storage dtype; a
  /// strategy with fewer than the slot's r leaves the rest zero (index 0, value 0). Cost: head_dim
  /// x kept fused multiply-adds and a partial sort of kept / g groups.
  static void encode_block_key(const format_type& f, const page_shape& shape, const segment& s, const float* mean, std::byte* key) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const detail::packed_strategy& st = s.strategy[0];
    std::vector<float> y(static_cast<std::size_t>(s.kept)), values(static_cast<std::size_t>(g.retained), 0.0f);
    detail::fused_rotate(mean, shape.head_dim, s.basis[0].data(), s.kept, y.data());
    std::vector<int> order, chosen;
    std::vector<float> energy;
    detail::packed_choose_groups(y.data(), s.kept, st, order, energy, chosen);
    std::memset(key, 0, block_key_bytes(f, shape));
    auto* channels = reinterpret_cast<std::uint8_t*>(key);
    std::size_t at = 0;
    for (const int j : chosen)
      for (int i = 0; i < st.group; ++i, ++at) {
        channels[at] = static_cast<std::uint8_t>(j * st.group + i);
        values[at] = y[static_cast<std::size_t>(j * st.group + i)];
      }
    detail::store_dense_rows(shape.storage, values.data(), values.size(), key + block_key_layout{g.retained}.values_offset());
  }

  /// The G queries ([G][head_dim]) in segment `s`'s K basis for scoring its block keys
  /// ([G][kept]): q' = q B_k in `encode_block_key`'s order. Cost: G x head_dim x kept fused
  /// multiply-adds.
  static void block_key_query(const format_type&, const page_shape& shape, const segment& s, const float* q, int groups,
                              float* q_key) {
    for (int g = 0; g < groups; ++g)
      detail::fused_rotate(q + static_cast<std::size_t>(g) * shape.head_dim, shape.head_dim, s.basis[0].data(), s.kept,
                           q_key + static_cast<std::size_t>(g) * s.kept);
  }

  /// q' . y^ of one query (`block_key_query`'s, [kept]) and a block key: q'[channel] x value
  /// over the slot's r pairs (zeros included) in stored order by fused multiply-adds from 0.
  /// Cost: r fused multiply-adds.
  static float score_block_key(const format_type& f, const page_shape& shape, const float* q_key, const std::byte* key) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    float values[256];  // r <= head_dim <= 256 (validate)
    detail::load_dense_rows(shape.storage, key + block_key_layout{g.retained}.values_offset(), static_cast<std::size_t>(g.retained),
                            values);
    const auto* channels = reinterpret_cast<const std::uint8_t*>(key);
    float sum = 0.0f;
    for (int v = 0; v < g.retained; ++v) sum = std::fma(q_key[channels[v]], values[v], sum);
    return sum;
  }

 private:
  static void encode(const format_type& f, const page_shape& shape, const segment& s, int which, const float* rows, std::byte* page) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const detail::packed_strategy& st = s.strategy[which];
    const int p = shape.page_size;
    std::memset(page, 0, g.page_bytes());
    std::vector<float> y(static_cast<std::size_t>(p) * g.kept);
    host::row_matrix_map(y.data(), p, g.kept).noalias() =
        host::const_row_matrix_map(rows, p, shape.head_dim) * host::const_row_matrix_map(s.basis[which].data(), shape.head_dim, g.kept);
    std::vector<int> order, chosen;
    std::vector<float> energy, values(static_cast<std::size_t>(st.retained));
    for (int t = 0; t < p; ++t) {
      const float* row = y.data() + static_cast<std::size_t>(t) * g.kept;
      detail::packed_choose_groups(row, g.kept, st, order, energy, chosen);
      std::uint32_t* bits = g.bitmap(page, t);
      std::size_t at = 0;
      for (const int j : chosen) {
        bits[j / 32] |= std::uint32_t{1} << (j % 32);
        for (int i = 0; i < st.group; ++i) values[at++] = row[j * st.group + i];
      }
      detail::store_dense_rows(shape.storage, values.data(), values.size(), page + g.values_offset(t));
    }
  }

  static void decode(const format_type& f, const page_shape& shape, const segment& s, int which, const std::byte* page, int n, float* rows) {
    std::vector<float> y(static_cast<std::size_t>(n) * s.kept, 0.0f);
    for_each_record(f, shape, s, which, page, n,
                    [&](int t, int channel, float value) { y[static_cast<std::size_t>(t) * s.kept + channel] = value; }, [](int) {});
    host::row_matrix_map(rows, n, shape.head_dim).noalias() =
        host::const_row_matrix_map(y.data(), n, s.kept) *
        host::const_row_matrix_map(s.basis[which].data(), shape.head_dim, s.kept).transpose();
  }

  /// Calls start(t) then visit(t, channel, value) for every stored value of records [0, n).
  template <class Visit, class Start>
  static void for_each_record(const format_type& f, const page_shape& shape, const segment& s, int which, const std::byte* page,
                              int n, Visit&& visit, Start&& start) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    const int group = s.strategy[which].group, words = detail::packed_geometry::bitmap_words(g.kept, group);
    std::vector<float>& values = detail::host_scratch(static_cast<std::size_t>(s.strategy[which].retained));
    for (int t = 0; t < n; ++t) {
      start(t);
      detail::load_dense_rows(shape.storage, page + g.values_offset(t), static_cast<std::size_t>(s.strategy[which].retained), values.data());
      const std::uint32_t* bits = g.bitmap(page, t);
      std::size_t at = 0;
      for (int w = 0; w < words; ++w)
        for (std::uint32_t word = bits[w]; word != 0; word &= word - 1) {
          const int j = w * 32 + lowest_bit(word);
          for (int i = 0; i < group; ++i) visit(t, j * group + i, values[at++]);
        }
    }
  }
  static int lowest_bit(std::uint32_t word) noexcept {
#if defined(__GNUC__)
    return __builtin_ctz(word);
#else
    int bit = 0;
    while ((word & 1u) == 0) {
      word >>= 1;
      ++bit;
    }
    return bit;
#endif
  }
};

namespace detail {
/// A moved token is re-encoded in its new page's segment basis.
template <>
struct reencodes_moved_rows<format::packed_bitmap> : std::true_type {};
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/format/packed_bitmap.hpp> ----

// ---- begin <kvmosaic/select/selector_traits.hpp> ----
/// \file
/// What a selector is, and what it must provide.
///
/// A selector is a policy struct in `kvmosaic::select` declaring `using policy_category =
/// selector_tag;` and carrying its parameters (a budget, a window). It decides which tokens a
/// decode query sees. There are two kinds, and the difference matters to memory:
///   - *read less*: the cache keeps every token; the selector picks the pages (or token ranges)
///     one step reads. Memory is not freed. (`all`, `quest`, `sentence_chunks`.)
///   - *keep less*: tokens are evicted for good, and a compactor returns their memory.
///     (`streaming`, `h2o`, `snapkv`.)
///
/// `kvmosaic::selector_traits<Selector>` provides, as a description:
///   static constexpr const char* name;
///   static std::string describe(const Selector&);   // name plus parameters, for reports
///   static constexpr bool reads_all_pages;          // true: kernels read every page, no page list
///   static constexpr bool evicts;                   // true: a keep-less selector
///   static constexpr bool needs_token_ids;          // true: prefill and append take token ids
///   static void validate(const Selector&, int page_size);  // throws invalid_argument
///   static int bounds_block_tokens(const Selector&, int page_size);  // key bounds kept per block
///                                                   // of a page (0: none)
///   static constexpr block_summary summary;         // optional, default block_summary::bounds:
///                                                   // what each block keeps (span_score.hpp)
///   static constexpr bool keeps_token_ranges;       // optional, default false: true when the
///                                                   // selector's metadata names runs of slots
///                                                   // (sentence chunks), which a compaction
///                                                   // would move under it
///
/// and, as behaviour, the host hooks the cache calls for every selector without naming one
/// (`stateless_selector_hooks` below is the set for a selector that keeps nothing per sequence;
/// a selector's traits derive from it and replace what they need). `OnDevice` is true when the
/// backend keeps K and V rows in device memory (backend::cuda): then `k` must not be read on the
/// host, and work on the keys is the selector's device part (`cuda::selection_stage<Selector,
/// Shapes>`, cuda/select/selection_stage.cuh, reached as `engine.selection()`; the `write`,
/// `fork`, `release` hooks drive it).
///
///   using sequence_state = ...;   // per sequence, held by the cache: default-constructed by
///                                 // add_sequence (may throw), copied by fork_sequence (may throw)
///   using update = ...;           // what some rows add to a sequence_state, staged
///   template <class Cache> struct cache_members;  // public members the selector adds to the
///                                 // cache (a base of cache<...>, CRTP; they read the state with
///                                 // Cache::selector_state(seq))
///   template <bool OnDevice, class T>
///   static update stage(const Selector&, const selector_shape&, const sequence_state&,
///                       const tensor_view<const T, 3>& k, span<const std::int32_t> ids,
///                       std::int64_t first, std::int64_t n);
///                                 // what rows [first, first + n) of k (and their ids, host
///                                 // memory; empty unless needs_token_ids) add; may throw, must
///                                 // not change the state
///   static void reserve(sequence_state&, const update&);  // room, so that commit cannot throw;
///                                 // may throw (allocation), changes no observable value
///   static void commit(sequence_state&, update&) noexcept;  // applies a staged update
///   template <bool OnDevice, class Engine, class T>
///   static void write(Engine&, std::int32_t slot, const update&, const tensor_view<const T, 3>& k,
///                     std::int64_t first, std::int64_t n);
///                                 // the engine's part of an update, after the rows' write and
///                                 // before commit; may throw (the engine's rollback undoes it)
///   template <bool OnDevice, class Engine>
///   static void fork(Engine&, std::int32_t from, std::int32_t to);  // the engine's part of a
///                                 // fork (pending until the engine's commit, as write)
///   template <bool OnDevice, class Engine>
///   static void release(Engine&, std::int32_t slot);  // the engine's part of remove_sequence
///   static std::int64_t extra_bytes(const selector_shape&, const sequence_state&);  // bytes the
///                                 // selector keeps for the sequence (memory_stats)
///   static std::int64_t always_from(const sequence_state&, std::int64_t sealed);  // the first
///                                 // sealed token every step reads whatever the selection (the
///                                 // selection statistics' reuse); `sealed` when none
///   // keep-less selectors (evicts == true) also provide:
///   static std::vector<std::int64_t> evictions(const Selector&, sequence_state&,
///                       std::int64_t length, std::int64_t open_from, const eviction_view&);
///                                 // after each write: the positions to evict now (sealed, below
///                                 // `open_from`; the cache passes over those already evicted)
///   static bool compaction_due(const Selector&, sequence_state&, std::int64_t written);
///                                 // whether `written` more tokens bring the next compaction pass
///   static constexpr score_use token_scores;        // optional, default score_use::none: the
///                                 // attend path's per-token scores the selector reads
///                                 // (select/token_scores.hpp); with it
///   static group_combine score_combine(const Selector&);   // how the group's probabilities combine
///   static detail::token_score_buffer& scores(sequence_state&);  // where steps write them (and
///                                 // the const overload)
///   static score_eviction eviction_quota(const Selector&, const sequence_state&,
///                       std::int64_t length, std::int64_t open_from, std::int64_t stored);
///                                 // how many of the lowest-scored tokens below which position
///                                 // to evict after a write (`evictions` ranks them on the host;
///                                 // a device backend ranks them where its scores are)
///   // read-less selectors (reads_all_pages == false) also provide:
///   static detail::selection_request start_request(const Selector&, const selector_shape&);
///                                 // the step's fields (score combination, span kind)
///   static void request(const Selector&, const selector_shape&, const sequence_state&,
///                       std::int64_t length, std::int64_t tail_rows, detail::selection_request&);
///                                 // appends one sequence's entry (budget, always_from, spans)
///
/// A read-less selector turns each step's queries into *spans* (runs of tokens with the min and
/// max of their keys, see select/span_score.hpp), scores them and picks some within a token
/// budget. What the attend path consumes is the same for every such selector: per (sequence, KV
/// head), the pages holding a selected token and, per page, which of its tokens are selected
/// (docs/selectors.md). The dense tail (and a format's exact sink and window rows) is always read.


// ---- begin <kvmosaic/select/selection_request.hpp> ----
/// \file
/// What one decode step of a read-less selector asks of an engine (`detail::selection_request`):
/// per batch entry, the token budget, the first token read whatever the selection, and the spans
/// to score (the engine's page blocks, or a list of token ranges with their key bounds). A
/// selector's host hooks fill it (`selector_traits::start_request`, `request`); both backends'
/// engines read it.


// ---- begin <kvmosaic/select/span_score.hpp> ----
/// \file
/// What the read-less selectors share: the token budget, Quest's upper-bound score of a span of
/// tokens from its per-channel key bounds, the combination of a GQA group's scores, and the
/// reference selection (the longest prefix of the spans in score order that fits the budget).
///
/// A *span* is a run of tokens with the channel-wise min and max of their keys: a fixed block of a
/// page for `select::quest`, a sentence chunk for `select::sentence_chunks`. Both selectors score
/// spans the same way and select them the same way; they differ in how spans are cut.
///
/// The score's fp32 arithmetic has one fixed order (`span_score`), written so that the host and
/// the CUDA scoring kernel (lane l accumulates its head_dim / 32 contiguous channels in turn by
/// fused multiply-adds, read with one vector load per bound row, then a butterfly over the 32
/// lanes) round identically: both backends select the same spans.



namespace kvmosaic {

/// How the scores of the query heads of a GQA group become the one score per span that selects
/// for their shared KV head (one selection per KV head: the group shares every K/V load).
///   - `max` (the default): the largest of the group's scores: a span any head of the group ranks
///     high is kept.
///   - `sum`: the sum of the group's scores, Quest's bound of the group's summed logits.
/// On the synthetic workload (32K, budget 1/8) `max` keeps more of the exact attention mass (0.72
/// against 0.69) and gives the lower output error; `sum` recalls each query head's own top pages a
/// little better. docs/selectors.md has the measurements.
enum class group_combine { max, sum };

inline const char* to_string(group_combine c) noexcept { return c == group_combine::max ? "max" : "sum"; }

/// What a read-less selector keeps per block of a page to score it, and how it scores it:
///   - `bounds` (select::quest): the channel-wise min and max rows of the block's keys; the score is
///     Quest's upper bound of q . k, sum_c q_c (q_c >= 0 ? hi_c : lo_c). Two rows per block.
///   - `mean` (select::mean_keys): the mean key row (MosaicKV's per-block key); the score is
///     q . mean. One row per block.
/// Both are scored by `span_score`, `mean` as bounds with lo = hi = mean: the same canonical order
/// on both backends.
enum class block_summary { bounds, mean };

/// Stored rows per block of a summary.
constexpr int summary_rows(block_summary s) noexcept { return s == block_summary::bounds ? 2 : 1; }

namespace select {

/// The tokens a read-less selector may pick per (sequence, KV head) and step: `tokens` when it is
/// >= 0, else floor(`ratio` x the sequence's length). The dense tail, exact sink and window rows and (for sentence
/// chunks) the open chunk are read on top of it. A budget of 0 reads only those; a budget of the
/// whole context or more reads every token.
struct token_budget {
  double ratio = 1.0 / 16.0;  ///< fraction of the context, in [0, 1]
  std::int64_t tokens = -1;   ///< absolute budget in tokens; >= 0 overrides `ratio` (any value:
                              ///< one past the context reads it all)

  /// The budget for a sequence of `length` (>= 0) tokens: in [0, length] for a ratio (the
  /// product is clamped before its conversion to an integer, so no ratio or length overflows).
  std::int64_t resolve(std::int64_t length) const noexcept {
    if (tokens >= 0) return tokens;
    const double share = std::floor(ratio * static_cast<double>(length));
    if (!(share > 0.0)) return 0;  // also a NaN ratio (rejected by validate)
    return share >= static_cast<double>(length) ? length : static_cast<std::int64_t>(share);
  }
  /// Throws `invalid_argument` naming `budget.ratio` unless it is in [0, 1] (NaN is not). Every
  /// `tokens` is valid.
  void validate(const char* where) const {
    detail::require(ratio >= 0.0 && ratio <= 1.0, where, "budget.ratio", ratio, "0 to 1");
  }
  /// For `describe`: "N tokens"; "1/n" for a ratio that is the reciprocal of an integer n up to
  /// 2^31 - 1 (1/16); else "ratio x" (x to 6 significant digits, so "ratio 0" and "ratio 0.3").
  std::string describe() const {
    if (tokens >= 0) return std::to_string(tokens) + " tokens";
    if (ratio > 0.0 && ratio <= 1.0) {
      const double n = std::floor(1.0 / ratio + 0.5);  // infinite for a tiny ratio: then no n
      if (n <= 2147483647.0 && std::abs(ratio * n - 1.0) <= 1e-12) return "1/" + std::to_string(static_cast<long>(n));
    }
    return "ratio " + detail::to_text(ratio);
  }
};

}  // namespace select

namespace detail {

/// Lanes of the canonical score order (a warp).
inline constexpr int span_score_lanes = 32;

namespace span_score_detail {
/// The canonical order's lane sums (`span_score`): lane[l] for l < 32.
template <class Load>
inline void lane_sums(const float* q, int head_dim, Load& load, float* lane) {
  const int width = head_dim / span_score_lanes;
  for (int l = 0; l < span_score_lanes; ++l) {
    float s = 0.0f;
    for (int c = l * width; c < (l + 1) * width; ++c) {
      const auto bounds = load(c);
      s = std::fma(q[c], q[c] >= 0.0f ? bounds.second : bounds.first, s);  // rounded once, as the device's FFMA
    }
    lane[l] = s;
  }
}

// Where `std::fma` would be a C library call (core/fused.hpp), `lane_sums` is also compiled for FMA
// hardware and chosen at run time: the same bits.
#ifdef KVMOSAIC_FMA_DISPATCH
template <class Load>
__attribute__((target("fma"))) inline void lane_sums_fma(const float* q, int head_dim, Load& load, float* lane) {
  lane_sums(q, head_dim, load, lane);  // inlined: std::fma is one instruction under this target
}
#endif
}  // namespace span_score_detail

/// Quest's upper bound of q . k over keys k with lo[c] <= k[c] <= hi[c]:
///   sum_c max(q[c] * hi[c], q[c] * lo[c]) = sum_c q[c] * (q[c] >= 0 ? hi[c] : lo[c]),
/// computed as the right-hand side (one product per channel, the bound chosen by q's sign), in the
/// canonical order: lane l accumulates its channels l * w .. (l + 1) * w - 1 in turn by fused
/// multiply-adds (fp32, s = fma(q[c], bound, s) from s = 0), w = head_dim / 32, then lanes combine
/// by a butterfly (offsets 16, 8, 4, 2, 1). `load(c)` returns the pair (lo[c], hi[c]) as floats.
/// Cost: head_dim fused multiply-adds (one instruction each on FMA hardware, a C library call
/// elsewhere) and 31 additions.
template <class Load>
inline float span_score(const float* q, int head_dim, Load&& load) {
  float lane[span_score_lanes];
#ifdef KVMOSAIC_FMA_DISPATCH
  if (fma_hardware())
    span_score_detail::lane_sums_fma(q, head_dim, load, lane);
  else
#endif
    span_score_detail::lane_sums(q, head_dim, load, lane);
  for (int offset = span_score_lanes / 2; offset >= 1; offset /= 2) {
    float next[span_score_lanes];
    for (int l = 0; l < span_score_lanes; ++l) next[l] = lane[l] + lane[l ^ offset];
    std::copy(next, next + span_score_lanes, lane);
  }
  return lane[0];
}

/// Combines per-head scores of a group in the canonical order (heads 0, 1, ... in turn).
inline float combine_scores(const float* scores, int group, group_combine how) noexcept {
  float total = scores[0];
  for (int g = 1; g < group; ++g) total = how == group_combine::max ? (scores[g] > total ? scores[g] : total) : total + scores[g];
  return total;
}

/// The reference selection, which the device selection reproduces exactly: order the spans by
/// score (higher first; equal scores by lower index), take the longest prefix of that order whose
/// `weights` (token counts) sum to at most `budget`. Returns the chosen indices, ascending. NaN
/// scores sort last. Cost: O(n log n).
inline std::vector<std::int32_t> budget_prefix(const std::vector<float>& scores, const std::vector<std::int32_t>& weights,
                                               std::int64_t budget) {
  std::vector<std::int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](std::int32_t i) {
    const float s = scores[static_cast<std::size_t>(i)];
    return std::isnan(s) ? -INFINITY : s;
  };
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return key(a) > key(b); });
  std::vector<std::int32_t> chosen;
  std::int64_t used = 0;
  for (const std::int32_t i : order) {
    used += weights[static_cast<std::size_t>(i)];
    if (used > budget) break;
    chosen.push_back(i);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/select/span_score.hpp> ----

namespace kvmosaic {
namespace detail {

/// Spans of one sequence given as token ranges (`select::sentence_chunks`' final chunks): span i
/// is tokens [starts[i], starts[i+1]), its key bounds at bounds + (i * num_kv_heads + head) * 2 *
/// head_dim (storage dtype bits: the lo row, then the hi row). Read on the host backend only (a
/// device engine keeps these bounds itself).
struct chunk_list {
  const std::int64_t* starts = nullptr;
  std::int32_t count = 0;
  const std::uint16_t* bounds = nullptr;
};

/// What a read-less selector asks of one step (select/selector_traits.hpp): per batch entry, the
/// token budget and the first token of the region read whatever the selection (the open chunk);
/// the spans are the engine's page blocks (`block_tokens` > 0) or the given chunks.
struct selection_request {
  group_combine combine = group_combine::max;
  int block_tokens = 0;
  std::vector<std::int64_t> budget;        ///< [batch] tokens
  std::vector<std::int64_t> always_from;   ///< [batch] tokens from here on are always read
  /// [batch] spans starting here or later are not scored or picked (the format's recent window,
  /// read from its exact rows: set by the cache, not the selector); spans come in token order, so
  /// the candidates are a prefix.
  std::vector<std::int64_t> candidates_before;
  std::vector<chunk_list> chunks;          ///< [batch] (block_tokens == 0)
};

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/select/selection_request.hpp> ----

// ---- begin <kvmosaic/select/token_scores.hpp> ----
/// \file
/// What the score-based keep-less selectors share (`select::tova`, `select::h2o`): the attention
/// probability each attended token received at a decode step, per (sequence, KV head), computed
/// by the attend path itself (no eager attention, no N x N matrix), and the per-sequence buffer
/// that keeps it by logical position. Source: the eviction and compaction notes ("Wall 1": a fused
/// kernel never writes the scores; H2O's reference code falls back to eager attention for them).
///
/// A token's score at a step is, for each query head j of the KV head's group, its probability
/// p_j = exp(s_j - m_j) / l_j under the step's whole softmax (every page, sink and tail row the
/// step reads: normalized after the merge of the blocks, as the split-KV merge would), combined
/// over the group by `group_combine` (sum: the group's attention mass on the token; max). A token
/// the step does not read (evicted, or masked by a read-less selection) gets no score that step.



namespace kvmosaic {

/// How a selector uses the attend path's token scores (`selector_traits<S>::token_scores`):
///   - `none`: it reads none, and the attend path computes none (every selector but the two below);
///   - `last_step`: each step overwrites the scores of the tokens it reads (TOVA);
///   - `cumulative`: each step adds them (H2O's accumulated attention).
enum class score_use { none, last_step, cumulative };

/// What an attend step records: how the group's probabilities combine and whether they replace
/// or add to the buffer. `use == score_use::none`: nothing is recorded.
struct score_settings {
  score_use use = score_use::none;
  group_combine combine = group_combine::sum;
};

/// What a score-based selector evicts after a write: the `count` live sealed tokens with the
/// lowest shared score (`token_score_buffer::shared`; ties to the earlier position, NaN highest)
/// among positions [first_evictable, before), or every such token when there are fewer.
struct score_eviction {
  std::int64_t count = 0;
  std::int64_t before = 0;
};

namespace detail {

/// One sequence's token scores, by logical position: [position][num_kv_heads] fp32, zero until a
/// step reads the token. Evicted positions keep their last value and are never read again. Cost:
/// 4 bytes per token and KV head (counted by the selector's `extra_bytes`), in host memory on
/// backend::host; on a device backend (`on_device`) the values live with the selector's device
/// part (cuda/select/scored_eviction.cuh) and this buffer keeps only the length.
struct token_score_buffer {
  std::vector<float> values;  ///< host memory; empty when `on_device`
  int heads = 0;
  std::int64_t length = 0;         ///< positions held
  std::int64_t scored_tokens = 0;  ///< tokens the sequence held at its last step with scores
  bool on_device = false;          ///< the values live in device memory (backend::cuda)

  std::int64_t tokens() const noexcept { return length; }
  float at(std::int64_t position, int head) const noexcept {
    return values[static_cast<std::size_t>(position) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(head)];
  }
  /// Room for `tokens` positions of `num_heads` heads (growing geometrically: appends cost
  /// amortized O(1)); may throw (allocation), changes no score.
  void reserve(std::int64_t tokens, int num_heads) {
    if (on_device) return;
    const std::size_t needed = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (needed > values.capacity()) values.reserve(std::max(needed, 2 * values.capacity()));
  }
  /// Grows to `tokens` positions (new ones 0) within the room `reserve` made: cannot throw.
  void grow_to(std::int64_t tokens, int num_heads) noexcept {
    heads = num_heads;
    length = std::max(length, tokens);
    if (on_device) return;
    const std::size_t size = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (size > values.size()) values.resize(size, 0.0f);  // capacity reserved: no allocation
  }
  /// The score of `position` for the eviction decision of one slot layout shared by every KV
  /// head: the sum over the heads in head order, in fp32 (their mean, up to a constant factor that
  /// no ranking sees). The device ranking (cuda/kernel/token_scores.cuh) sums in the same order.
  float shared(std::int64_t position) const noexcept {
    float total = 0.0f;
    for (int h = 0; h < heads; ++h) total += at(position, h);
    return total;
  }
};

/// The `count` positions of `candidates` with the lowest `score_of(position)` (float or double),
/// lowest first; ties to the earlier position (the same order on every backend); a NaN score (a
/// NaN query) ranks highest, so it never evicts. Cost: O(n log count).
template <class ScoreOf>
std::vector<std::int64_t> lowest_ranked(const std::vector<std::int64_t>& candidates, std::int64_t count, ScoreOf score_of) {
  using score = decltype(score_of(std::int64_t{}));
  count = std::max<std::int64_t>(0, std::min<std::int64_t>(count, static_cast<std::int64_t>(candidates.size())));
  std::vector<std::pair<score, std::int64_t>> ranked;
  ranked.reserve(candidates.size());
  for (const std::int64_t p : candidates) {
    const score x = score_of(p);
    ranked.emplace_back(std::isnan(x) ? std::numeric_limits<score>::infinity() : x, p);
  }
  std::partial_sort(ranked.begin(), ranked.begin() + count, ranked.end());
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) out.push_back(ranked[static_cast<std::size_t>(i)].second);
  return out;
}

/// The attention an observation window pays the tokens before it (SnapKV's vote; the window
/// families of the eviction notes), in fp64: for every position t < `window_start` that holds a
/// live token and every KV head h,
///
///     vote(t, h) = sum over w < window of combine over the group's query heads j of softmax_w,j(t)
///
/// where window query w (position window_start + w) attends causally to every live stored token up
/// to its own position. `keys(i, h, c)` is the key of stored row i, `positions[i]` its logical
/// position (-1: evicted, skipped), `queries(w, j, c)` query head j of window query w, already
/// multiplied by the softmax scale. Returns [window_start][num_kv_heads], -inf where no live
/// token is. Cost: one pass over the keys per (query, query head), keeping its logits (8 bytes a
/// row); no W x N matrix.
template <class Keys, class Queries>
std::vector<double> window_votes(const Keys& keys, const std::vector<std::int64_t>& positions, const Queries& queries,
                                 std::int64_t window_start, int window, int num_kv_heads, int group, int head_dim,
                                 group_combine combine) {
  const std::size_t rows = positions.size(), prefix = static_cast<std::size_t>(window_start);
  const double none = -std::numeric_limits<double>::infinity();
  std::vector<double> vote(prefix * static_cast<std::size_t>(num_kv_heads), none);  // [position][head]
  for (std::size_t i = 0; i < rows; ++i)
    if (positions[i] >= 0 && positions[i] < window_start)
      for (int h = 0; h < num_kv_heads; ++h) vote[static_cast<std::size_t>(positions[i]) * num_kv_heads + h] = 0.0;
  std::vector<double> logits(rows), combined(rows);
  for (int h = 0; h < num_kv_heads; ++h) {
    for (int w = 0; w < window; ++w) {
      const std::int64_t last = window_start + w;  // causal: the query sees positions up to its own
      std::fill(combined.begin(), combined.end(), 0.0);
      for (int g = 0; g < group; ++g) {
        const int j = h * group + g;
        double m = none;
        for (std::size_t i = 0; i < rows; ++i) {
          if (positions[i] < 0 || positions[i] > last) continue;
          double dot = 0.0;
          for (int c = 0; c < head_dim; ++c)
            dot += static_cast<double>(queries(w, j, c)) * static_cast<double>(keys(static_cast<std::int64_t>(i), h, c));
          logits[i] = dot;
          m = std::max(m, dot);
        }
        double l = 0.0;
        for (std::size_t i = 0; i < rows; ++i)
          if (positions[i] >= 0 && positions[i] <= last) l += std::exp(logits[i] - m);
        for (std::size_t i = 0; i < rows; ++i) {
          if (positions[i] < 0 || positions[i] >= window_start) continue;
          const double p = std::exp(logits[i] - m) / l;
          combined[i] = combine == group_combine::sum ? combined[i] + p : (g == 0 ? p : std::max(combined[i], p));
        }
      }
      for (std::size_t i = 0; i < rows; ++i)
        if (positions[i] >= 0 && positions[i] < window_start)
          vote[static_cast<std::size_t>(positions[i]) * num_kv_heads + h] += combined[i];
    }
  }
  return vote;
}

/// `lowest_ranked` by the shared score of `scores` (the sum over the KV heads).
inline std::vector<std::int64_t> lowest_scored(const token_score_buffer& scores, const std::vector<std::int64_t>& candidates,
                                               std::int64_t count) {
  return lowest_ranked(candidates, count, [&scores](std::int64_t p) { return scores.shared(p); });
}

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/select/token_scores.hpp> ----

namespace kvmosaic {

template <class Selector>
struct selector_traits {
  static_assert(sizeof(Selector) == 0,
                "kvmosaic: this type is not a selector: use one of kvmosaic::select::all, or "
                "specialize kvmosaic::selector_traits<YourSelector> as described in "
                "kvmosaic/select/selector_traits.hpp");
};

/// What a selector's hooks know of the cache they serve (from its validated cache_config).
struct selector_shape {
  int num_kv_heads;
  int head_dim;
  int page_size;
  dtype storage;  ///< f16 or bf16: the dtype keys are stored (and bounded) in
};

/// What a keep-less selector's `evictions` may read of its sequence besides its own state.
struct eviction_view {
  std::int64_t stored = 0;                  ///< live tokens, the tail's rows included
  const std::int64_t* slot_positions = nullptr;  ///< per sealed slot, its logical position (-1: evicted)
  std::int64_t slots = 0;                   ///< sealed slots
  std::int64_t first_evictable = 0;         ///< the format's sink tokens (always kept) end here

  /// The live sealed positions in [first_evictable, before), ascending. Cost: O(slots log slots).
  std::vector<std::int64_t> evictable(std::int64_t before) const {
    std::vector<std::int64_t> out;
    for (std::int64_t i = 0; i < slots; ++i) {
      const std::int64_t p = slot_positions[i];
      if (p >= first_evictable && p < before) out.push_back(p);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

/// The host hooks of a selector that keeps nothing per sequence (`select::all`, `select::quest`):
/// an empty state, nothing staged, nothing kept in the engine, no bytes counted. Cost: none.
struct stateless_selector_hooks {
  struct sequence_state {};
  struct update {};
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class Selector, class T>
  static update stage(const Selector&, const selector_shape&, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t, std::int64_t) noexcept {
    return {};
  }
  static void reserve(sequence_state&, const update&) noexcept {}
  static void commit(sequence_state&, update&) noexcept {}
  template <bool OnDevice, class Engine, class T>
  static void write(Engine&, std::int32_t, const update&, const tensor_view<const T, 3>&, std::int64_t,
                    std::int64_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void fork(Engine&, std::int32_t, std::int32_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void release(Engine&, std::int32_t) noexcept {}
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state&) noexcept { return 0; }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }
};

namespace detail {
/// The members `Selector` adds to `Cache` (`selector_traits<Selector>::cache_members<Cache>`), or
/// none when `Selector` is not a selector (the cache then fails with one sentence naming it).
template <class Selector, class Cache, bool = is_selector_v<Selector>>
struct selector_cache_members {
  struct type {};
};
template <class Selector, class Cache>
struct selector_cache_members<Selector, Cache, true> {
  using type = typename selector_traits<Selector>::template cache_members<Cache>;
};

/// `selector_traits<Selector>::summary`, block_summary::bounds when the traits do not declare it.
template <class Selector, class = void>
struct block_summary_of {
  static constexpr block_summary value = block_summary::bounds;
};
template <class Selector>
struct block_summary_of<Selector, std::void_t<decltype(selector_traits<Selector>::summary)>> {
  static constexpr block_summary value = selector_traits<Selector>::summary;
};

/// `selector_traits<Selector>::token_scores`, score_use::none when the traits do not declare it.
template <class Selector, class = void>
struct token_scores_of {
  static constexpr score_use value = score_use::none;
};
template <class Selector>
struct token_scores_of<Selector, std::void_t<decltype(selector_traits<Selector>::token_scores)>> {
  static constexpr score_use value = selector_traits<Selector>::token_scores;
};

/// `selector_traits<Selector>::reads_window_votes` (the selector ranks by `cache::window_votes`:
/// select::snapkv), false when the traits do not declare it. An engine takes the kernels that
/// write logits for such a selector, so that the votes are computed where the keys are.
template <class Selector, class = void>
struct reads_window_votes : std::false_type {};
template <class Selector>
struct reads_window_votes<Selector, std::void_t<decltype(selector_traits<Selector>::reads_window_votes)>>
    : std::bool_constant<selector_traits<Selector>::reads_window_votes> {};

/// `selector_traits<Selector>::keeps_token_ranges`, false when the traits do not declare it.
template <class Selector, class = void>
struct keeps_token_ranges : std::false_type {};
template <class Selector>
struct keeps_token_ranges<Selector, std::void_t<decltype(selector_traits<Selector>::keeps_token_ranges)>>
    : std::bool_constant<selector_traits<Selector>::keeps_token_ranges> {};

/// Whether `Selector` has a `budget` member of type `select::token_budget` (every selector of this
/// library but select::all): what a per-sequence budget replaces.
template <class Selector, class = void>
struct has_token_budget : std::false_type {};
template <class Selector>
struct has_token_budget<Selector, std::void_t<decltype(std::declval<Selector&>().budget)>>
    : std::is_same<std::remove_reference_t<decltype(std::declval<Selector&>().budget)>, select::token_budget> {};
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/select/selector_traits.hpp> ----

// ---- begin <kvmosaic/select/all.hpp> ----
/// \file
/// `select::all`: every token is read at every step (exact attention over the stored cache).



namespace kvmosaic {
namespace select {

/// Reads every page and the tail. Cost: none beyond the attention itself. Source: the baseline.
struct all {
  using policy_category = selector_tag;
};

}  // namespace select

template <>
struct selector_traits<select::all> : stateless_selector_hooks {
  static constexpr const char* name = "all";
  static constexpr bool reads_all_pages = true;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = false;
  static std::string describe(const select::all&) { return "all"; }
  static void validate(const select::all&, int /*page_size*/) {}
  static int bounds_block_tokens(const select::all&, int) noexcept { return 0; }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/all.hpp> ----

// ---- begin <kvmosaic/select/quest.hpp> ----
/// \file
/// `select::quest`: query-aware block selection (Quest, Tang et al., ICML 2024; the stage-2 page
/// selection of MosaicKV, section 4.2; "page selection without eviction" in the eviction notes).



namespace kvmosaic {
namespace select {

/// Reads, per (sequence, KV head) and step, the blocks of sealed pages with the highest upper
/// bound of q . k, within a token budget, plus the dense tail (always read).
///
/// What it computes: each block of `block_tokens` tokens of a page keeps the channel-wise min and
/// max of its keys (`lo`, `hi`, in the storage dtype: exact), written when the page is sealed (at
/// prefill or when an append fills the tail), never recomputed. A step scores every block with
/// sum_c max(q_c hi_c, q_c lo_c), combines the group's query heads (`combine`), and reads the
/// top floor(budget / block_tokens) blocks (higher score first, ties to the earlier block). The
/// keys are the exact rows before the format encodes them, so for lossy formats the bound is on
/// the original keys (as in Quest, whose metadata is taken before anything else).
///
/// Cost: 2 x head_dim 16-bit values per block and KV head of memory (1/32 of a dense K page at
/// block 64: counted in `memory_stats`); per step, reading those bounds (1/64 of the dense K+V
/// bytes at block 64) and a top-k per (sequence, KV head). Memory is not freed: a read-less
/// selector (size the pool as if uncompressed).
///
/// Blocks: `block_tokens` tokens (default 16, Quest's own block; 0 = the page size). A block
/// smaller than a page makes the selection token-granular: both backends read the selected pages
/// with the unselected tokens masked, which costs more time per step than whole-page blocks and
/// recovers most of the fidelity whole pages lose at small budgets (docs/defaults.md,
/// docs/selectors.md).
struct quest {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int block_tokens = 16;                      ///< tokens per block: 0 = the page size, or a multiple of 8
                                              ///< dividing it
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head

  /// The block size for pages of `page_size` tokens.
  int block_for(int page_size) const noexcept { return block_tokens == 0 ? page_size : block_tokens; }
};

}  // namespace select

namespace detail {
/// The traits of a selector that scores fixed blocks of every page from a summary kept with the
/// page (`select::quest`, `select::mean_keys`): a `Selector` with `budget`, `block_tokens`,
/// `combine` and `block_for`; `Name` its name ("quest"). Keeps nothing per sequence: the
/// summaries live with each page, in the engine.
template <class Selector, const char* Name, block_summary Summary>
struct page_block_selector_traits : stateless_selector_hooks {
  static constexpr const char* name = Name;
  static constexpr bool reads_all_pages = false;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = false;
  static constexpr block_summary summary = Summary;
  static std::string describe(const Selector& s) {
    std::string text = std::string(Name) + "(";
    text += s.budget.describe();
    if (s.block_tokens != 0) text += ", block " + std::to_string(s.block_tokens);
    text += std::string(", ") + to_string(s.combine) + ")";
    return text;
  }
  /// Checks the parameters against the cache's page size (throws `invalid_argument` naming
  /// select::<name>).
  static void validate(const Selector& s, int page_size) {
    const std::string where = std::string("select::") + Name;
    s.budget.validate(where.c_str());
    const int block = s.block_for(page_size);
    require(block >= 8 && block % 8 == 0 && page_size % block == 0, where.c_str(), "block_tokens", s.block_tokens,
            "0 (the page size) or a multiple of 8 that divides page_size");
  }
  /// Tokens per block whose summary the cache keeps with each page.
  static int bounds_block_tokens(const Selector& s, int page_size) noexcept { return s.block_for(page_size); }
  /// A step scores the page blocks of every sequence.
  static selection_request start_request(const Selector& s, const selector_shape& shape) {
    selection_request r;
    r.combine = s.combine;
    r.block_tokens = s.block_for(shape.page_size);
    return r;
  }
  /// One sequence's entry: the budget for its length, and nothing read besides the selection but
  /// the tail. A sequence whose tail is empty reads at least one block, so that every step attends
  /// to a token. Cost: O(1).
  static void request(const Selector& s, const selector_shape&, const sequence_state&, std::int64_t length,
                      std::int64_t tail_rows, selection_request& r) {
    const std::int64_t budget = s.budget.resolve(length);
    r.budget.push_back(tail_rows == 0 ? std::max<std::int64_t>(budget, r.block_tokens) : budget);
    r.always_from.push_back(length);
  }
};
inline constexpr char quest_name[] = "quest";
}  // namespace detail

/// Quest's bounds live with each page, in the engine.
template <>
struct selector_traits<select::quest>
    : detail::page_block_selector_traits<select::quest, detail::quest_name, block_summary::bounds> {};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/quest.hpp> ----

// ---- begin <kvmosaic/select/mean_keys.hpp> ----
/// \file
/// `select::mean_keys`: MosaicKV's stage-2 dynamic sequence compression (Qiang et al.,
/// "MosaicKV", sections 4.2 and 5.3): blocks of a page scored by the query against the block's
/// mean key, the top blocks read within a token budget.


namespace kvmosaic {
namespace select {

/// Reads, per (sequence, KV head) and step, the blocks of sealed pages whose mean key scores
/// highest against the query, within a token budget, plus the dense tail and the exact rows
/// (sinks, recent window) that every selector reads.
///
/// What it computes: each block of `block_tokens` tokens of a page keeps the mean of its keys
/// (one row, in the storage dtype; per channel an fp32 sum in token order divided by the count),
/// written when the page is sealed from its exact rows, before the format encodes them. A step
/// scores every block with q . mean (`span_score` with lo = hi = mean: both backends round alike),
/// combines the group's query heads (`combine`, as `select::quest`), and reads the top
/// floor(budget / block_tokens) blocks (higher score first, ties to the earlier block).
///
/// Against `select::quest`: half its metadata (one row per block instead of two) and a score that
/// estimates the block's logits instead of bounding them; MosaicKV pairs it with its packed
/// format. Differences from the paper (docs/selectors.md): the mean row is 16-bit and dense for
/// every format (the paper packs it with the keys of its format), and the block size is the
/// selector's parameter, not the segment strategy's (`format::packed_bitmap` computes the
/// strategy's block size per segment; using it here is future work).
///
/// Cost: head_dim 16-bit values per block and KV head of memory (1/block_tokens of the dense K
/// bytes; counted in `memory_stats`); per step, reading those rows and a top-k per (sequence, KV
/// head). Memory is not freed: a read-less selector.
struct mean_keys {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int block_tokens = 16;                      ///< tokens per block (MosaicKV: 4, 8 or 16): 0 = the
                                              ///< page size, or a multiple of 8 dividing it
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head

  /// The block size for pages of `page_size` tokens.
  int block_for(int page_size) const noexcept { return block_tokens == 0 ? page_size : block_tokens; }
};

}  // namespace select

namespace detail {
inline constexpr char mean_keys_name[] = "mean_keys";
}  // namespace detail

/// The mean rows live with each page, in the engine.
template <>
struct selector_traits<select::mean_keys>
    : detail::page_block_selector_traits<select::mean_keys, detail::mean_keys_name, block_summary::mean> {};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/mean_keys.hpp> ----

// ---- begin <kvmosaic/select/sentence_chunks.hpp> ----
/// \file
/// `select::sentence_chunks`: sentence-level selection (SentKVCompress: the sentence split of its
/// Algorithm 2, the per-sentence min and max key of section 4.1.2, selection within a token budget
/// and reuse across steps of section 4.2).



namespace kvmosaic {
namespace select {

/// A boundary token of the caller's vocabulary and its semantic weight S(b) in [0, 1].
struct boundary {
  std::int32_t id;
  float weight;
};

/// Reads, per (sequence, KV head) and step, whole sentence chunks in score order until the token
/// budget is full, plus the open chunk and the dense tail (always read).
///
/// What it computes:
///   - the token stream (ids the caller passes with every prefill and append) is cut into chunks
///     by Algorithm 2 of SentKVCompress, exactly (`sentence_split`): from `current`, ideal_end =
///     min(current + L, n); candidates are the boundary tokens t in [max(ideal_end - Delta,
///     current + 1), min(ideal_end + Delta, n)] (t < n: a token must exist); the chunk ends at the
///     candidate maximizing 0.7 S(t) + 0.3 (1 - |ideal_end - t| / Delta) (the first of equals), or
///     at ideal_end when there is none. As in the pseudocode, the chunk is [current, best_split)
///     and the boundary token at best_split opens the next chunk.
///   - a chunk is final once the tokens its window can see exist (n > current + L + Delta); the
///     tokens after the last final chunk (the open chunk, fewer than L + Delta + 1) are always read.
///   - each final chunk keeps the channel-wise min and max of its keys per KV head (16-bit, exact).
///   - a step scores every chunk as `select::quest` scores a block (sum_c max(q_c hi_c, q_c lo_c),
///     the group combined by `combine`) and takes chunks in score order while their lengths fit the
///     budget (stopping at the first that does not), with no padding: kernels read the selected
///     tokens' pages and mask the rest.
///
/// Cost: 2 x head_dim 16-bit values per chunk and KV head (about 1/7 of the dense K bytes at the
/// default L = 14; SentKVCompress reports 7% of the KV); per step, reading those bounds and a
/// budgeted top-k per (sequence, KV head). Both backends: on CUDA the host cuts the chunks from
/// the ids (host memory) and the device keeps their bounds (docs/selectors.md).
struct sentence_chunks {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int target_length = 14;                     ///< L: the ideal chunk length (the paper's setting), 1 to
                                              ///< `max_length`
  int window = 8;                             ///< Delta: how far a split may move from the ideal end, 1 to
                                              ///< `max_length`
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head
  std::vector<boundary> boundaries;           ///< the boundary token ids and their weights S(b)

  /// The largest L and Delta: chunks are sentences (the paper's L is 14), and an engine keeps
  /// each sequence's open chunk, up to L + Delta rows, in memory, so both stay small and L + Delta
  /// (at most 8192) far from int's range.
  static constexpr int max_length = 4096;

  /// S(b) of `id`: its weight, or -1 for a token that is not a boundary.
  float weight_of(std::int32_t id) const noexcept {
    for (const boundary& b : boundaries)
      if (b.id == id) return b.weight;
    return -1.0f;
  }
};

/// One chunk: tokens [begin, end).
struct chunk {
  std::int64_t begin;
  std::int64_t end;
};

/// Algorithm 2 of SentKVCompress over ids[0, n): the chunks, in order, covering [0, n).
inline std::vector<chunk> sentence_split(const std::int32_t* ids, std::int64_t n, const sentence_chunks& s);

namespace detail {
/// One step of Algorithm 2 from `current` over a stream of n tokens: the chunk's end.
inline std::int64_t split_end(const std::int32_t* ids, std::int64_t n, std::int64_t current, const sentence_chunks& s) {
  const std::int64_t ideal_end = std::min<std::int64_t>(current + s.target_length, n);
  const std::int64_t window_start = std::max<std::int64_t>(ideal_end - s.window, current + 1);
  const std::int64_t window_end = std::min<std::int64_t>(ideal_end + s.window, n);
  std::int64_t best = -1;
  double best_score = 0.0;
  for (std::int64_t t = window_start; t <= window_end && t < n; ++t) {
    const float weight = s.weight_of(ids[t]);
    if (weight < 0.0f) continue;
    const double distance = static_cast<double>(ideal_end > t ? ideal_end - t : t - ideal_end);
    const double score = 0.7 * weight + 0.3 * (1.0 - distance / s.window);
    if (best < 0 || score > best_score) {
      best = t;
      best_score = score;
    }
  }
  return best >= 0 ? best : ideal_end;
}
}  // namespace detail

inline std::vector<chunk> sentence_split(const std::int32_t* ids, std::int64_t n, const sentence_chunks& s) {
  std::vector<chunk> chunks;
  for (std::int64_t current = 0; current < n;) {
    const std::int64_t end = detail::split_end(ids, n, current, s);
    chunks.push_back(chunk{current, end});
    current = end;
  }
  return chunks;
}

/// The chunk stream of one sequence (`select::sentence_chunks`' per-sequence state): its final
/// chunks, their key bounds on the host backend, and the open chunk's tokens, which Algorithm 2
/// has not cut yet. Memory: 8 bytes per chunk, plus on the host backend 2 x head_dim 16-bit values
/// per chunk and KV head, plus the open chunk's ids (and, on the host, its keys as floats: at most
/// L + Delta rows).
struct chunk_stream {
  std::vector<std::int64_t> starts{0};     ///< chunk i is [starts[i], starts[i+1]); back(): the open chunk
  std::vector<std::uint16_t> bounds;       ///< host backend: [chunk][num_kv_heads][lo row, hi row], storage dtype bits
  std::vector<std::int32_t> pending_ids;   ///< ids of the open chunk's tokens
  std::vector<float> pending_keys;         ///< host backend: their keys, rounded to the storage dtype [token][heads][head_dim]

  /// The final chunks, in order ([begin, end)). Cost: O(chunks), a new vector.
  std::vector<chunk> chunks() const {
    std::vector<chunk> out;
    for (std::size_t i = 0; i + 1 < starts.size(); ++i) out.push_back(chunk{starts[i], starts[i + 1]});
    return out;
  }
};

/// What some rows add to a `chunk_stream`, computed without changing it (`selector_traits::stage`):
/// the chunks Algorithm 2 closes, their key bounds (host backend), and the open tokens left.
struct chunk_stream_update {
  std::vector<std::int32_t> lengths;      ///< closed chunks, in order
  std::vector<std::uint16_t> bounds;      ///< host backend: their bounds, as chunk_stream::bounds
  std::vector<std::int32_t> pending_ids;  ///< the open chunk's ids afterwards
  std::vector<float> pending_keys;        ///< host backend: their keys afterwards
};

}  // namespace select

template <>
struct selector_traits<select::sentence_chunks> {
  static constexpr const char* name = "sentence_chunks";
  static constexpr bool reads_all_pages = false;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = true;
  /// Chunks are runs of slots: a compaction would move tokens out from under them.
  static constexpr bool keeps_token_ranges = true;
  static std::string describe(const select::sentence_chunks& s) {
    std::string text = "sentence_chunks(";
    text += s.budget.describe();
    text += ", L " + std::to_string(s.target_length) + ", delta " + std::to_string(s.window) + ", " + to_string(s.combine) + ")";
    return text;
  }
  static void validate(const select::sentence_chunks& s, int /*page_size*/) {
    const char* where = "select::sentence_chunks";
    s.budget.validate(where);
    detail::require(s.target_length >= 1 && s.target_length <= select::sentence_chunks::max_length, where,
                    "target_length", s.target_length, "1 to 4096 (sentence_chunks::max_length)");
    detail::require(s.window >= 1 && s.window <= select::sentence_chunks::max_length, where, "window", s.window,
                    "1 to 4096 (sentence_chunks::max_length)");
    for (const select::boundary& b : s.boundaries)
      detail::require(b.weight >= 0.0f && b.weight <= 1.0f, where, "boundaries[].weight", b.weight, "0 to 1");
  }
  static int bounds_block_tokens(const select::sentence_chunks&, int) noexcept { return 0; }

  // --- Host hooks (select/selector_traits.hpp) ---------------------------------------------------

  using sequence_state = select::chunk_stream;
  using update = select::chunk_stream_update;

  /// `cache::chunks(seq)`: the chunks cut for `seq` so far ([begin, end), final ones only).
  template <class Cache>
  struct cache_members {
    std::vector<select::chunk> chunks(std::int32_t seq) const {
      return static_cast<const Cache&>(*this).selector_state(seq).chunks();
    }
  };

  /// Rows [first, first + n) of a prefill or append extend the stream: Algorithm 2 runs over the
  /// open ids while the next chunk's window is complete (more than L + Delta open tokens). On the
  /// host backend the closed chunks' key bounds come from the open keys (rounded to the storage
  /// dtype, so exact); on a device backend `write` has the engine compute them. Cost: O(open
  /// tokens) copies, Algorithm 2's window scan per closed chunk, and on the host a min/max pass over
  /// the closed chunks' keys.
  template <bool OnDevice, class T>
  static update stage(const select::sentence_chunks& s, const selector_shape& shape, const sequence_state& c,
                      const tensor_view<const T, 3>& k, span<const std::int32_t> ids, std::int64_t first, std::int64_t n) {
    update u;
    const int heads = shape.num_kv_heads, d = shape.head_dim;
    const std::size_t row = static_cast<std::size_t>(heads) * d;
    u.pending_ids = c.pending_ids;
    for (std::int64_t t = first; t < first + n; ++t) u.pending_ids.push_back(ids(t));
    if constexpr (!OnDevice) {
      u.pending_keys = c.pending_keys;
      for (std::int64_t t = first; t < first + n; ++t)
        for (int h = 0; h < heads; ++h)
          for (int ch = 0; ch < d; ++ch) u.pending_keys.push_back(round_to_storage(shape.storage, to_float(k(t, h, ch))));
    }
    // Algorithm 2 over the open tokens, while the next chunk's window is complete (ids only).
    const std::int64_t horizon = static_cast<std::int64_t>(s.target_length) + s.window;
    std::size_t done = 0;  // tokens of pending already cut into chunks
    while (static_cast<std::int64_t>(u.pending_ids.size() - done) > horizon) {
      const std::int64_t end =
          select::detail::split_end(u.pending_ids.data() + done, static_cast<std::int64_t>(u.pending_ids.size() - done), 0, s);
      u.lengths.push_back(static_cast<std::int32_t>(end));
      done += static_cast<std::size_t>(end);
    }
    u.pending_ids.erase(u.pending_ids.begin(), u.pending_ids.begin() + static_cast<std::ptrdiff_t>(done));
    if constexpr (!OnDevice) {
      std::vector<float> bounds(2 * static_cast<std::size_t>(d));
      std::size_t at = 0;
      for (const std::int32_t length : u.lengths) {
        for (int h = 0; h < heads; ++h) {
          for (int ch = 0; ch < d; ++ch) {
            float lo = u.pending_keys[at * row + static_cast<std::size_t>(h) * d + ch], hi = lo;
            for (std::int64_t t = 1; t < length; ++t) {
              const float x = u.pending_keys[(at + static_cast<std::size_t>(t)) * row + static_cast<std::size_t>(h) * d + ch];
              lo = x < lo ? x : lo;
              hi = x > hi ? x : hi;
            }
            bounds[static_cast<std::size_t>(ch)] = lo;
            bounds[static_cast<std::size_t>(d + ch)] = hi;
          }
          for (const float x : bounds) u.bounds.push_back(storage_bits(shape.storage, x));  // lo row, then hi row
        }
        at += static_cast<std::size_t>(length);
      }
      u.pending_keys.erase(u.pending_keys.begin(), u.pending_keys.begin() + static_cast<std::ptrdiff_t>(done * row));
    }
    return u;
  }
  /// Room for `u` in `c`, so that `commit` cannot throw.
  static void reserve(sequence_state& c, const update& u) {
    c.starts.reserve(c.starts.size() + u.lengths.size());
    c.bounds.reserve(c.bounds.size() + u.bounds.size());
  }
  static void commit(sequence_state& c, update& u) noexcept {
    for (const std::int32_t length : u.lengths) c.starts.push_back(c.starts.back() + length);
    c.bounds.insert(c.bounds.end(), u.bounds.begin(), u.bounds.end());
    c.pending_ids.swap(u.pending_ids);
    c.pending_keys.swap(u.pending_keys);
  }
  /// On a device backend the selection stage (cuda/select/sentence_chunks.cuh) computes the closed
  /// chunks' bounds from the device rows [first, first + n) of `k` and keeps the open rows
  /// (pending until the engine's commit).
  template <bool OnDevice, class Engine, class T>
  static void write(Engine& engine, std::int32_t slot, const update& u, const tensor_view<const T, 3>& k, std::int64_t first,
                    std::int64_t n) {
    if constexpr (OnDevice) engine.selection().add_chunks(slot, k, first, n, u.lengths, engine.stream());
  }
  /// On a device backend the child's slot gets a copy of the parent's chunks and open rows.
  template <bool OnDevice, class Engine>
  static void fork(Engine& engine, std::int32_t from, std::int32_t to) {
    if constexpr (OnDevice) engine.selection().copy_chunks(from, to, engine.stream());
  }
  /// On a device backend the slot's chunk storage goes back to the selection stage.
  template <bool OnDevice, class Engine>
  static void release(Engine& engine, std::int32_t slot) {
    if constexpr (OnDevice) engine.selection().release_chunks(slot);
  }
  /// The chunks' key bounds: 2 rows of head_dim 16-bit values per chunk and KV head (counted on
  /// both backends, wherever they live).
  static std::int64_t extra_bytes(const selector_shape& shape, const sequence_state& c) noexcept {
    return static_cast<std::int64_t>(c.starts.size() - 1) * shape.num_kv_heads * 2 * shape.head_dim *
           static_cast<std::int64_t>(sizeof(std::uint16_t));
  }
  /// Every step reads the open chunk (and everything after it).
  static std::int64_t always_from(const sequence_state& c, std::int64_t sealed) noexcept {
    return std::min(sealed, c.starts.back());
  }

  /// A step scores each sequence's final chunks.
  static detail::selection_request start_request(const select::sentence_chunks& s, const selector_shape&) {
    detail::selection_request r;
    r.combine = s.combine;
    r.block_tokens = 0;
    return r;
  }
  /// One sequence's entry: the budget for its length, the open chunk (never empty, so every step
  /// attends to a token) read besides the selection, and the final chunks as spans. Cost: O(1).
  static void request(const select::sentence_chunks& s, const selector_shape&, const sequence_state& c, std::int64_t length,
                      std::int64_t /*tail_rows*/, detail::selection_request& r) {
    r.budget.push_back(s.budget.resolve(length));
    r.always_from.push_back(c.starts.back());
    r.chunks.push_back(detail::chunk_list{c.starts.data(), static_cast<std::int32_t>(c.starts.size() - 1), c.bounds.data()});
  }

 private:
  static float round_to_storage(dtype storage, float x) noexcept {
    return storage == dtype::f16 ? detail::half_bits_to_float(detail::float_to_half_bits(x))
                                 : detail::bfloat16_bits_to_float(detail::float_to_bfloat16_bits(x));
  }
  static std::uint16_t storage_bits(dtype storage, float x) noexcept {
    return storage == dtype::f16 ? detail::float_to_half_bits(x) : detail::float_to_bfloat16_bits(x);
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/sentence_chunks.hpp> ----

// ---- begin <kvmosaic/select/streaming.hpp> ----
/// \file
/// `select::streaming`: attention sinks plus a recent window (StreamingLLM, Xiao et al., ICLR
/// 2024; "sink plus recency" in the eviction and compaction notes), the rest evicted for good.



namespace kvmosaic {
namespace select {

/// Keeps the first `sink_tokens` tokens and the most recent ones within a token budget (the
/// window is the budget less the sinks); every other token is evicted once it is sealed in a
/// page (the dense tail is never evicted), and every `compact_every` tokens written the cache runs
/// its compactor over the sequence. Needs a compactor that frees memory
/// (`cache<F, select::streaming, compact::repack>`).
///
/// What it computes: attention over the sinks, the window and the tail; no scores are read, so the
/// attention kernels are the plain ones. Cost: eviction bookkeeping per write (O(tokens evicted));
/// a compaction pass per `compact_every` tokens; memory bounded by the budget plus a page per
/// partially dead page and the tail, once compacted.
struct streaming {
  using policy_category = selector_tag;

  int sink_tokens = 4;           ///< tokens kept from the start (StreamingLLM's attention sinks)
  token_budget budget{};         ///< tokens kept: sinks plus window (tokens, or a ratio of the length)
  int compact_every = 128;       ///< tokens written between compaction passes (TriAttention: 128)
};

/// Per sequence: the first position not yet evicted past the sinks, and tokens written since the
/// last compaction.
struct streaming_state {
  std::int64_t evicted_to = 0;
  std::int64_t since_compaction = 0;
};

}  // namespace select

template <>
struct selector_traits<select::streaming> : stateless_selector_hooks {
  static constexpr const char* name = "streaming";
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static std::string describe(const select::streaming& s) {
    return "streaming(" + std::to_string(s.sink_tokens) + " sinks, " + s.budget.describe() + ", compact every " +
           std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::streaming& s, int /*page_size*/) {
    const char* where = "select::streaming";
    s.budget.validate(where);
    detail::require(s.sink_tokens >= 0 && s.sink_tokens <= 1024, where, "sink_tokens", s.sink_tokens, "0 to 1024");
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  static int bounds_block_tokens(const select::streaming&, int) noexcept { return 0; }

  using sequence_state = select::streaming_state;
  using update = stateless_selector_hooks::update;
  // Writes stage nothing: the cache asks for evictions after each write (`evictions`).
  template <bool OnDevice, class T>
  static update stage(const select::streaming&, const selector_shape&, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t, std::int64_t) noexcept {
    return {};
  }
  static void reserve(sequence_state&, const update&) noexcept {}
  static void commit(sequence_state&, update&) noexcept {}
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state&) noexcept { return 0; }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  /// The positions to evict now from a sequence of `length` tokens whose tokens before `open_from`
  /// are sealed: those past the sinks and before the window, not evicted yet. Cost: O(result).
  static std::vector<std::int64_t> evictions(const select::streaming& s, sequence_state& state, std::int64_t length,
                                             std::int64_t open_from, const eviction_view& /*live*/) {
    const std::int64_t keep = std::max<std::int64_t>(s.budget.resolve(length), s.sink_tokens);
    const std::int64_t window_from = length - (keep - s.sink_tokens);
    const std::int64_t from = std::max<std::int64_t>(state.evicted_to, s.sink_tokens);
    const std::int64_t to = std::min(window_from, open_from);
    std::vector<std::int64_t> out;
    for (std::int64_t p = from; p < to; ++p) out.push_back(p);
    state.evicted_to = std::max(state.evicted_to, to);
    return out;
  }
  /// Whether `written` more tokens bring the sequence to its next compaction pass.
  static bool compaction_due(const select::streaming& s, sequence_state& state, std::int64_t written) noexcept {
    state.since_compaction += written;
    if (state.since_compaction < s.compact_every) return false;
    state.since_compaction = 0;
    return true;
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/streaming.hpp> ----

// ---- begin <kvmosaic/select/scored_eviction.hpp> ----
/// \file
/// The host hooks the score-based keep-less selectors share (`select::tova`, `select::h2o`): a
/// per-sequence token score buffer (select/token_scores.hpp) grown with every write and written by
/// every attend step, the ranking that turns a selector's `eviction_quota` into positions, and the
/// compaction cadence of `select::streaming`. Each selector adds its description and its
/// `eviction_quota`. On a device backend the scores stay in device memory and the ranking runs
/// there (cuda/select/scored_eviction.cuh); the cache asks the quota, not the positions.



namespace kvmosaic {
namespace select {

/// Per sequence: the token scores, and tokens written since the last compaction.
struct scored_state {
  kvmosaic::detail::token_score_buffer scores;
  std::int64_t since_compaction = 0;
};

}  // namespace select

namespace detail {

/// Hooks of a selector `S` with members `combine` (group_combine) and `compact_every` (int)
/// whose state is `select::scored_state`, and whose traits provide
///
///     static score_eviction eviction_quota(const S&, const sequence_state&, std::int64_t length,
///                                          std::int64_t open_from, std::int64_t stored);
///
/// (how many of the lowest-scored tokens below which position to evict after a write that leaves
/// `stored` live tokens). Cost per write: the buffer grows by 4 bytes per token and KV head
/// (amortized O(1)); per step, the attend path writes the scores of the tokens it reads.
template <class S, score_use Use>
struct scored_eviction_hooks {
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr score_use token_scores = Use;
  static int bounds_block_tokens(const S&, int) noexcept { return 0; }

  using sequence_state = select::scored_state;
  struct update {
    std::int64_t added;   ///< tokens the write adds to the sequence
    std::int64_t length;  ///< the sequence's positions after the write
    int heads;
    bool on_device;       ///< the scores live in device memory
  };
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class T>
  static update stage(const S&, const selector_shape& shape, const sequence_state& state, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t /*first row*/, std::int64_t n) noexcept {
    return {n, state.scores.tokens() + n, shape.num_kv_heads, OnDevice};
  }
  static void reserve(sequence_state& state, const update& u) {
    state.scores.on_device = u.on_device;  // fixed by the backend: the same on every write
    state.scores.reserve(u.length, u.heads);
  }
  static void commit(sequence_state& state, update& u) noexcept { state.scores.grow_to(u.length, u.heads); }
  /// On a device backend the selection stage makes room for the new positions' scores (zero).
  template <bool OnDevice, class Engine, class T>
  static void write(Engine& engine, std::int32_t slot, const update& u, const tensor_view<const T, 3>&, std::int64_t,
                    std::int64_t) {
    if constexpr (OnDevice) engine.selection().reserve_scores(slot, u.length, engine.stream());
  }
  /// On a device backend the child's scores are a copy of the parent's.
  template <bool OnDevice, class Engine>
  static void fork(Engine& engine, std::int32_t from, std::int32_t to) {
    if constexpr (OnDevice) engine.selection().copy_scores(from, to, engine.stream());
  }
  /// On a device backend the slot's score storage is freed.
  template <bool OnDevice, class Engine>
  static void release(Engine& engine, std::int32_t slot) {
    if constexpr (OnDevice) engine.selection().release_scores(slot);
  }
  /// The score buffer: 4 bytes per token and KV head, wherever it lives.
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state& state) noexcept {
    return state.scores.tokens() * state.scores.heads * static_cast<std::int64_t>(sizeof(float));
  }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  static group_combine score_combine(const S& s) noexcept { return s.combine; }
  static token_score_buffer& scores(sequence_state& state) noexcept { return state.scores; }
  static const token_score_buffer& scores(const sequence_state& state) noexcept { return state.scores; }

  /// The host ranking of `S::eviction_quota`: the live sealed positions in [first_evictable,
  /// quota.before) with the lowest shared scores. Cost: O(slots log slots) on the host.
  static std::vector<std::int64_t> evictions(const S& s, sequence_state& state, std::int64_t length, std::int64_t open_from,
                                             const eviction_view& live) {
    const score_eviction quota = selector_traits<S>::eviction_quota(s, state, length, open_from, live.stored);
    if (quota.count <= 0) return {};
    return lowest_scored(state.scores, live.evictable(quota.before), quota.count);
  }

  /// Whether `written` more tokens bring the sequence to its next compaction pass.
  static bool compaction_due(const S& s, sequence_state& state, std::int64_t written) noexcept {
    state.since_compaction += written;
    if (state.since_compaction < s.compact_every) return false;
    state.since_compaction = 0;
    return true;
  }
};

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/select/scored_eviction.hpp> ----

// ---- begin <kvmosaic/select/tova.hpp> ----
/// \file
/// `select::tova`: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs",
/// 2024; the cumulative-attention family of the eviction and compaction notes): over its budget,
/// the cache drops the tokens the latest step attended to least.



namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens: after each write that leaves more, the sealed tokens with the
/// lowest score of the latest decode step (the attention probability each received, combined
/// over the GQA group by `combine`, then summed over the KV heads: one decision for every head,
/// as TOVA's layer-wise policy averages its heads; `select::per_kv_head<select::tova>` decides per
/// head) are evicted; every `compact_every` tokens
/// written the cache compacts the sequence. The dense tail and the format's sink tokens are never
/// evicted and count in the budget; a token no step has read yet is not a candidate (a prefill is
/// trimmed after its first decode step). Needs a compactor that frees memory.
///
/// What it computes: attention over the tokens kept; the attend path writes each read token's
/// score (select/token_scores.hpp), no eager attention. Cost: per step, the scores (4 bytes per
/// token and KV head written); per write over budget, O(tokens log evicted) on the host to rank
/// them; memory bounded by the budget once compacted, plus 4 bytes per token and KV head of scores.
struct tova {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept (tokens, or a ratio of the length)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
  int compact_every = 128;                     ///< tokens written between compaction passes
};

}  // namespace select

template <>
struct selector_traits<select::tova> : detail::scored_eviction_hooks<select::tova, score_use::last_step> {
  static constexpr const char* name = "tova";
  static std::string describe(const select::tova& s) {
    return std::string("tova(") + s.budget.describe() + ", " + to_string(s.combine) + ", compact every " +
           std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::tova& s, int /*page_size*/) {
    const char* where = "select::tova";
    s.budget.validate(where);
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  /// After a write that leaves `stored` live tokens: as many of the lowest-scored live sealed
  /// tokens that a step has read as the stored tokens exceed the budget.
  static score_eviction eviction_quota(const select::tova& s, const sequence_state& state, std::int64_t length,
                                       std::int64_t open_from, std::int64_t stored) {
    const std::int64_t keep = s.budget.resolve(length);
    if (stored <= keep) return {};
    return {stored - keep, std::min(open_from, state.scores.scored_tokens)};
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/tova.hpp> ----

// ---- begin <kvmosaic/select/h2o.hpp> ----
/// \file
/// `select::h2o`: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
/// Generative Inference of Large Language Models", NeurIPS 2023; the cumulative-attention family
/// of the eviction and compaction notes): the recent tokens plus the tokens that have received the
/// most attention so far.

#include <initializer_list>


namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens: the most recent floor(`recent_share` x budget) positions, and of
/// the older sealed tokens those with the highest accumulated score (the attention probability
/// each received at every decode step so far, combined over the GQA group by `combine`, then
/// summed over the KV heads: one decision for every head). After each write that leaves more than
/// the budget, the lowest-scored older tokens are evicted; every `compact_every` tokens written
/// the cache compacts the sequence. The dense tail and the format's sink tokens are never evicted
/// and count in the budget; a token no step has read yet is not a candidate. Needs a compactor
/// that frees memory.
///
/// Differs from the paper's code on purpose: one decision for all KV heads, not one per head (a
/// pool page holds every head of its tokens, so only a token every head drops frees memory);
/// `select::per_kv_head<select::h2o>` decides per head, as the paper, in head pages of their own
/// (docs/architecture.md, "Per-KV-head eviction"). Tokens leave in batches after a write, not one
/// per step (the same set when each write is one token).
///
/// What it computes: attention over the tokens kept; the attend path adds each read token's score
/// (select/token_scores.hpp), no eager attention. Cost: as `select::tova`.
struct h2o {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept: heavy hitters plus the recent window
  double recent_share = 0.5;                   ///< the budget's share for the recent window (H2O: half)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
  int compact_every = 128;                     ///< tokens written between compaction passes
};

}  // namespace select

template <>
struct selector_traits<select::h2o> : detail::scored_eviction_hooks<select::h2o, score_use::cumulative> {
  static constexpr const char* name = "h2o";
  static std::string describe(const select::h2o& s) {
    return std::string("h2o(") + s.budget.describe() + ", recent " + detail::to_text(s.recent_share) + ", " +
           to_string(s.combine) + ", compact every " + std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::h2o& s, int /*page_size*/) {
    const char* where = "select::h2o";
    s.budget.validate(where);
    detail::require(s.recent_share >= 0.0 && s.recent_share <= 1.0, where, "recent_share", s.recent_share, "0 to 1");
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  /// The recent window under a budget of `keep` tokens.
  static std::int64_t recent_tokens(const select::h2o& s, std::int64_t keep) noexcept {
    return static_cast<std::int64_t>(std::floor(s.recent_share * static_cast<double>(keep)));
  }
  /// After a write that leaves `stored` live tokens: as many of the lowest-scored live sealed
  /// tokens before the recent window that a step has read as the stored tokens exceed the budget.
  static score_eviction eviction_quota(const select::h2o& s, const sequence_state& state, std::int64_t length,
                                       std::int64_t open_from, std::int64_t stored) {
    const std::int64_t keep = s.budget.resolve(length);
    if (stored <= keep) return {};
    const std::int64_t recent_from = length - recent_tokens(s, keep);
    return {stored - keep, std::min({open_from, recent_from, state.scores.scored_tokens})};
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/h2o.hpp> ----

// ---- begin <kvmosaic/select/snapkv.hpp> ----
/// \file
/// `select::snapkv`: SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before
/// Generation", NeurIPS 2024; the observation-window family of the eviction and compaction notes):
/// once, at the end of a prefill, the attention the prompt's last W queries pay to the earlier
/// tokens decides which of them stay.



namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens of a prompt: the observation window (its last `window` tokens),
/// and of the tokens before it those with the highest pooled vote. The caller passes the window's
/// queries to `cache::snapshot(seq, queries)` once the prompt is stored (the cache holds no
/// queries); until then, and between snapshots, nothing is evicted. The vote of token t is
///
///     vote_h(t) = sum over the window's queries w of combine over the group's query heads j of
///                 softmax_j,w(t)
///
/// where query w (position length - W + w) attends causally to every stored token up to its own
/// position; each KV head's votes are max-pooled over the positions t - pool_kernel / 2 ...
/// t + pool_kernel / 2 (SnapKV's 1-D pooling, so that a kept token keeps its neighbours), and the
/// pooled votes are summed over the KV heads: one decision for every head, as `select::h2o` (a pool
/// page holds every head: docs/architecture.md, "Per-KV-head eviction"). The snapshot then evicts
/// the lowest (ties: the earlier position) and compacts the sequence. The dense tail, the
/// window and the format's sink tokens are never evicted and count in the budget. Needs a
/// compactor that frees memory.
///
/// Differs from the paper's code on purpose: one decision for all KV heads instead of one per
/// head (`select::per_kv_head<select::snapkv>` decides per head, as the paper); the group's
/// query heads are combined by `combine` (sum by default) where the paper has one query head per
/// KV head; the budget counts the sinks and the tail.
///
/// What it computes: attention over the tokens kept. Cost of a snapshot: the window's votes
/// (`cache::window_votes`): on backend::cuda over format::dense, ceil(W / 8) decode steps of up to
/// 8 copies of the sequence that write their rows' logits, two small kernels over them and 4 bytes
/// per row and KV head copied back (device memory: 4 x group x 8 bytes per row and KV head);
/// elsewhere the stored keys read back (`cache::read`) and scored on the host in fp64, W x group x
/// stored x head_dim multiply-adds, keeping one query's logits at a time (no W x N matrix). Then
/// O(stored log stored) on the host to pool and rank, and one compaction. Nothing per decode step.
struct snapkv {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept (the window, sinks and tail included)
  int window = 32;                             ///< W: the observation window (SnapKV: 32)
  int pool_kernel = 7;                         ///< the max-pooling width, odd (SnapKV: 7)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
};

}  // namespace select

namespace detail {

/// SnapKV's pooling of window votes (`window_votes`, [window_start][num_kv_heads], -inf where no
/// live token is): each KV head's votes max-pooled over the live positions within
/// pool_kernel / 2 of t, then summed over the KV heads. A position with no live token scores -inf
/// and pools as nothing. Cost: O(window_start x num_kv_heads x pool_kernel).
inline std::vector<double> snapkv_pool(const std::vector<double>& vote, std::int64_t window_start, int num_kv_heads,
                                       int pool_kernel) {
  const double none = -std::numeric_limits<double>::infinity();
  const std::int64_t reach = pool_kernel / 2;
  std::vector<double> score(static_cast<std::size_t>(window_start), none);
  for (std::int64_t t = 0; t < window_start; ++t) {
    if (vote[static_cast<std::size_t>(t) * num_kv_heads] == none) continue;  // no live token here
    double total = 0.0;
    for (int h = 0; h < num_kv_heads; ++h) {
      double pooled = none;
      for (std::int64_t u = std::max<std::int64_t>(0, t - reach); u <= std::min(window_start - 1, t + reach); ++u)
        pooled = std::max(pooled, vote[static_cast<std::size_t>(u) * num_kv_heads + h]);
      total += pooled;
    }
    score[static_cast<std::size_t>(t)] = total;
  }
  return score;
}

/// What a snapshot of one sequence may evict: how many live tokens it holds, and its candidates,
/// the live positions in [first, before) (after the sinks, before the window and the open tail),
/// ascending. Cost: O(slots log slots).
struct snapshot_candidates {
  std::int64_t live = 0;
  std::vector<std::int64_t> positions;
};
inline snapshot_candidates candidates_of(const std::vector<std::int64_t>& slot_positions, std::int64_t first,
                                         std::int64_t before) {
  snapshot_candidates out;
  for (const std::int64_t p : slot_positions) {
    if (p < 0) continue;
    ++out.live;
    if (p >= first && p < before) out.positions.push_back(p);
  }
  std::sort(out.positions.begin(), out.positions.end());
  return out;
}

/// The SnapKV scores of one sequence in fp64: of the tokens before `window_start`, by position,
/// the window's votes (`window_votes`, the same arguments) pooled by `snapkv_pool`.
template <class Keys, class Queries>
std::vector<double> snapkv_scores(const Keys& keys, const std::vector<std::int64_t>& positions, const Queries& queries,
                                  std::int64_t window_start, int window, int num_kv_heads, int group, int head_dim,
                                  int pool_kernel, group_combine combine) {
  return snapkv_pool(window_votes(keys, positions, queries, window_start, window, num_kv_heads, group, head_dim, combine),
                     window_start, num_kv_heads, pool_kernel);
}

}  // namespace detail

template <>
struct selector_traits<select::snapkv> : stateless_selector_hooks {
  static constexpr const char* name = "snapkv";
  static constexpr bool reads_all_pages = true;  // every live token: the snapshot already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr bool reads_window_votes = true;  // cache::window_votes, computed by the device where it can
  static std::string describe(const select::snapkv& s) {
    return std::string("snapkv(") + s.budget.describe() + ", window " + std::to_string(s.window) + ", pool " +
           std::to_string(s.pool_kernel) + ", " + to_string(s.combine) + ")";
  }
  static void validate(const select::snapkv& s, int /*page_size*/) {
    const char* where = "select::snapkv";
    s.budget.validate(where);
    detail::require(s.window >= 1, where, "window", s.window, ">= 1");
    detail::require(s.pool_kernel >= 1 && s.pool_kernel % 2 == 1, where, "pool_kernel", s.pool_kernel, "an odd number >= 1");
  }
  static int bounds_block_tokens(const select::snapkv&, int) noexcept { return 0; }

  /// `cache::snapshot(seq, queries, softmax_scale)`.
  template <class Cache>
  struct cache_members {
    /// Scores the tokens of `seq` by the attention its last `window` queries pay them and keeps
    /// the budget (`select::snapkv`): evicts the rest, then compacts the sequence. `queries` is
    /// [window][num_q_heads][head_dim] in host memory (float, half or bfloat16), row w the query of
    /// position length(seq) - window + w; `softmax_scale` 0 means 1 / sqrt(head_dim). Returns the
    /// tokens evicted. Call it once the prompt is stored (the window must lie within it); calling it
    /// again scores what is left. Throws `invalid_argument` for a window longer than the sequence
    /// or queries of the wrong extents, before anything changes.
    template <class Q>
    std::int64_t snapshot(std::int32_t seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f) {
      Cache& cache = static_cast<Cache&>(*this);
      const char* where = "cache::snapshot";
      const select::snapkv& s = cache.selector();
      const auto& c = cache.config();
      const std::int64_t length = cache.length(seq);
      detail::require(queries.extent(0) == s.window, where, "queries.extent(0) (window)", queries.extent(0),
                      "select::snapkv::window");
      detail::require(s.window <= length, where, "select::snapkv::window", s.window,
                      "at most length(seq): the window's tokens must be stored");
      detail::require(queries.extent(1) == c.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                      "num_kv_heads x group_size");
      detail::require(queries.extent(2) == c.head_dim, where, "queries.extent(2) (head_dim)", queries.extent(2),
                      "cache_config::head_dim");
      const std::int64_t window_start = length - s.window;
      const std::vector<double> score = detail::snapkv_pool(cache.window_votes(seq, queries, softmax_scale, s.combine),
                                                            window_start, c.num_kv_heads, s.pool_kernel);
      // Candidates: live sealed tokens after the sinks and before the window and the open tail.
      const std::int64_t open_from = length - cache.stored_tokens(seq) % c.page_size;
      const detail::snapshot_candidates candidates =
          detail::candidates_of(cache.positions(seq), kvmosaic::sink_rows(cache.format()), std::min(window_start, open_from));
      const std::int64_t keep = cache.budget(seq).resolve(length);  // the sequence's own, if it has one
      if (candidates.live <= keep) return 0;
      const std::vector<std::int64_t> dead = detail::lowest_ranked(
          candidates.positions, candidates.live - keep, [&score](std::int64_t p) { return score[static_cast<std::size_t>(p)]; });
      if (dead.empty()) return 0;
      cache.evict(seq, span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())));
      cache.compact(seq);
      return static_cast<std::int64_t>(dead.size());
    }
  };

  /// No eviction after a write: the snapshot evicts.
  static std::vector<std::int64_t> evictions(const select::snapkv&, sequence_state&, std::int64_t, std::int64_t,
                                             const eviction_view&) {
    return {};
  }
  static bool compaction_due(const select::snapkv&, sequence_state&, std::int64_t) noexcept { return false; }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/snapkv.hpp> ----

// ---- begin <kvmosaic/select/per_kv_head.hpp> ----
/// \file
/// `select::per_kv_head<S>`: a keep-less selector run by each KV head on its own tokens, with a
/// budget per head (H2O, TOVA and SnapKV as their papers score, one decision per head; budgets
/// that differ across heads, set or, for SnapKV, allocated by Ada-KV's rule), and memory freed
/// per head. A cache of it is
/// `cache<Format, select::per_kv_head<S>, Compactor, Backend>` (per_kv_head_cache.hpp), which
/// stores each KV head of a sequence in pages of its own: docs/architecture.md, "Per-KV-head
/// eviction".



namespace kvmosaic {
namespace select {

/// Runs the keep-less selector `S` (select::h2o, tova, snapkv, streaming) on each KV head alone:
/// head h keeps the tokens that S keeps when it sees head h's scores only, within `budgets[h]`
/// (every head `selector.budget` when `budgets` is empty). The sinks and the dense tail are each
/// head's, as a cache's are.
///
/// What it computes: for each KV head, attention over the tokens that head keeps. Cost: a head's
/// tokens, scores and evictions cost what a one-head sequence's cost under S; a step plans
/// num_kv_heads times as many (one-head) sequences, and block tables hold one entry per head page
/// (4 bytes per head and page instead of per page). Kernels are those of S's cache, unchanged.
template <class S>
struct per_kv_head {
  using policy_category = selector_tag;
  using selector_type = S;

  S selector{};                         ///< the policy each KV head runs, with its default budget
  std::vector<token_budget> budgets{};  ///< per KV head, num_kv_heads of them; empty: selector.budget
  /// select::snapkv only: Ada-KV's allocation (Feng et al., "Ada-KV: Optimizing KV Cache
  /// Eviction by Adaptive Budget Allocation"): a snapshot evicts as many tokens as the heads'
  /// budgets ask in all, the lowest pooled votes of all heads ranked together, so that a head
  /// whose attention is spread keeps more than one whose attention is concentrated.
  bool adaptive = false;
  /// With `adaptive`: the share of the tokens a head would keep under its own budget that it keeps
  /// whatever the other heads score (Ada-KV's safeguard; kvpress's default 0.2).
  double safeguard = 0.2;

  /// Head `head`'s budget.
  const token_budget& budget_of(int head) const noexcept {
    return budgets.empty() ? selector.budget : budgets[static_cast<std::size_t>(head)];
  }
};

}  // namespace select

namespace detail {
template <class S>
struct is_per_kv_head : std::false_type {};
template <class S>
struct is_per_kv_head<select::per_kv_head<S>> : std::true_type {};

/// The policy a cache of `Selector` runs per sequence, and access to it: `Selector` itself, or S
/// of `select::per_kv_head<S>` (each head's lane runs it).
template <class Selector>
struct policy_of {
  using type = Selector;
  static Selector& get(Selector& s) noexcept { return s; }
};
template <class S>
struct policy_of<select::per_kv_head<S>> {
  using type = S;
  static S& get(select::per_kv_head<S>& s) noexcept { return s.selector; }
};
}  // namespace detail

/// `select::per_kv_head<S>`'s traits: its name, description and checks, and S's properties
/// (what it reads, whether it evicts, which scores its lanes record), so that code reading a
/// selector's properties reads these. It declares no per-sequence hooks: S's run in each lane
/// (per_kv_head_cache.hpp), and the primary cache template does not take it.
template <class S>
struct selector_traits<select::per_kv_head<S>> {
  static_assert(selector_traits<S>::evicts && detail::has_token_budget<S>::value,
                "kvmosaic::select::per_kv_head<S>: S must be a keep-less selector with a token budget "
                "(select::h2o, select::tova, select::snapkv, select::streaming); read-less selectors "
                "(select::quest, select::mean_keys) already choose per KV head at each step");
  static constexpr const char* name = "per_kv_head";
  static constexpr bool reads_all_pages = selector_traits<S>::reads_all_pages;
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = selector_traits<S>::needs_token_ids;
  static constexpr score_use token_scores = detail::token_scores_of<S>::value;
  static constexpr bool reads_window_votes = detail::reads_window_votes<S>::value;
  template <class Cache>
  struct cache_members {};  // the specialization's own members (snapshot) stand in

  static std::string describe(const select::per_kv_head<S>& s) {
    std::string text = std::string("per_kv_head(") + selector_traits<S>::describe(s.selector);
    if (s.adaptive) text += ", adaptive, safeguard " + detail::to_text(s.safeguard);
    if (!s.budgets.empty()) {
      text += ", budgets";
      for (const select::token_budget& b : s.budgets) text += " " + b.describe() + ";";
      text.pop_back();
    }
    return text + ")";
  }
  /// Throws `invalid_argument` naming `budgets` unless it is empty or has one budget per KV head,
  /// each valid, or naming S's field that S's own checks reject.
  static void validate(const select::per_kv_head<S>& s, int num_kv_heads, int page_size) {
    const char* where = "select::per_kv_head";
    selector_traits<S>::validate(s.selector, page_size);
    detail::require(s.budgets.empty() || static_cast<int>(s.budgets.size()) == num_kv_heads, where, "budgets.size()",
                    static_cast<std::int64_t>(s.budgets.size()), "0 (selector.budget for every head) or num_kv_heads");
    for (const select::token_budget& b : s.budgets) b.validate(where);
    detail::require(!s.adaptive || std::is_same<S, select::snapkv>::value, where, "adaptive", "true",
                    "false unless S is select::snapkv (Ada-KV ranks one snapshot's votes of every head together)");
    detail::require(s.safeguard >= 0.0 && s.safeguard <= 1.0, where, "safeguard", s.safeguard, "0 to 1");
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/select/per_kv_head.hpp> ----

// ---- begin <kvmosaic/compact/compactor_traits.hpp> ----
/// \file
/// What a compactor is, and what it must provide.
///
/// A compactor is a policy struct in `kvmosaic::compact` declaring `using policy_category =
/// compactor_tag;`. It turns tokens a keep-less selector evicted into freed pages: it moves
/// surviving tokens between slots, updates block tables and logical positions together, never
/// moves or frees a page whose reference count is above one, and reports pages freed, slot copies
/// and tokens evicted per pass. `kvmosaic::compactor_traits<Compactor>` provides
///   static constexpr const char* name;
///   static std::string describe(const Compactor&);
///   static constexpr bool frees_memory;   // false for compact::none
/// and, for compactors that free memory, the compaction pass over one sequence.



namespace kvmosaic {

template <class Compactor>
struct compactor_traits {
  static_assert(sizeof(Compactor) == 0,
                "kvmosaic: this type is not a compactor: use one of kvmosaic::compact::none, or "
                "specialize kvmosaic::compactor_traits<YourCompactor> as described in "
                "kvmosaic/compact/compactor_traits.hpp");
};

}  // namespace kvmosaic
// ---- end <kvmosaic/compact/compactor_traits.hpp> ----

// ---- begin <kvmosaic/compact/hole_fill.hpp> ----
/// \file
/// `compact::hole_fill`: hole-filling compaction (TriAttention's second shape, in the eviction and
/// compaction notes).


// ---- begin <kvmosaic/memory/compaction_plan.hpp> ----
/// \file
/// What a compaction pass does to one sequence, planned on the host from its slots alone: which
/// surviving tokens move to which slots, which pages empty out, and the logical position each slot
/// holds afterwards. Both backends execute the same plan (the host by copying rows, the CUDA
/// engine by one gather-then-scatter pass on the device), so their block tables, positions and
/// page bytes agree. Source: the eviction and compaction notes (TriAttention's two compaction
/// shapes, and the numpy oracle whose counts the tests reproduce).
///
/// A sequence's *slots* are its sealed pages' rows in block-table order: slot s is row
/// s % page_size of page s / page_size. `positions[s]` is the logical position (the token's index
/// in the sequence as the model saw it, what RoPE used) of the token in slot s, or -1 when that
/// token was evicted. Pages shared with another sequence (reference count above one: a forked
/// prefix) lead the block table and are *frozen*: nothing moves out of or into them and they are
/// never freed by this sequence, so their dead slots stay dead (masked) until their other holders
/// let go.
///
///   - **repack** (order-preserving): every survivor after the frozen pages slides forward, in
///     logical order, so the sequence's slots are dense again; all survivors are read before any
///     is written (the moves may overlap). Most data movement, no position bookkeeping needed
///     beyond what eviction already keeps.
///   - **hole fill**: survivors before `round_start` (the history) stay where they are; the
///     survivors of the newest round (slots from `round_start` on) drop into the history's holes,
///     in order; those that find no hole slide forward behind the history. Far fewer copies, but
///     the physical order of positions is scrambled, so the position map is what RoPE and prefix
///     hashing must read.
///
/// Cost: O(slots) time and memory on the host, per sequence and pass.



namespace kvmosaic {

/// What one compaction pass did (summed over the sequences it compacted): the evidence that
/// eviction returns memory.
struct compaction_report {
  std::int32_t pages_freed = 0;      ///< pages returned to the pool
  std::int64_t slot_copies = 0;      ///< token rows moved between slots
  std::int64_t tokens_evicted = 0;   ///< dead tokens whose slots the pass reclaimed or left as holes
  std::int32_t pages_reencoded = 0;  ///< pages written whole again (formats that encode pages)

  compaction_report& operator+=(const compaction_report& r) noexcept {
    pages_freed += r.pages_freed;
    slot_copies += r.slot_copies;
    tokens_evicted += r.tokens_evicted;
    pages_reencoded += r.pages_reencoded;
    return *this;
  }
};

namespace detail {

/// The position map of one sequence whose cache can evict: per sealed slot the token's logical
/// position (-1 once evicted), and per page a live-row mask in the host attend's layout
/// (`words(page_size)` 64-bit words, bit r of word w for row 64 w + r). Kept in step with the
/// block table by the cache: `seal` when pages are sealed, `evict`, `drop_pages` and compaction.
struct slot_positions {
  std::vector<std::int64_t> position;
  std::vector<std::uint64_t> live;
  std::vector<std::uint8_t> reencoded;  ///< per page: compaction passes that encoded it again (saturating)
  std::int64_t dead = 0;         ///< sealed slots whose token was evicted
  std::int64_t round_start = 0;  ///< slots at the end of the previous compaction pass

  static int words(int page_size) noexcept { return (page_size + 63) / 64; }
  /// Room for `pages` sealed pages, so that `seal` cannot throw.
  void reserve(std::size_t pages, int page_size) {
    position.reserve(pages * static_cast<std::size_t>(page_size));
    live.reserve(pages * static_cast<std::size_t>(words(page_size)));
    reencoded.reserve(pages);
  }
  /// `pages` new sealed pages holding positions first, first + 1, ... (within the reserved room).
  void seal(std::size_t pages, std::int64_t first, int page_size) noexcept {
    for (std::size_t i = 0; i < pages * static_cast<std::size_t>(page_size); ++i)
      position.push_back(first + static_cast<std::int64_t>(i));
    reencoded.insert(reencoded.end(), pages, std::uint8_t{0});
    for (std::size_t i = 0; i < pages; ++i)
      for (int w = 0; w < words(page_size); ++w) {
        const int rows = page_size - 64 * w;
        live.push_back(rows >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << rows) - 1);
      }
  }
  /// Marks sealed slot `slot` dead.
  void evict(std::int64_t slot, int page_size) noexcept {
    position[static_cast<std::size_t>(slot)] = -1;
    const std::int64_t page = slot / page_size, row = slot % page_size;
    live[static_cast<std::size_t>(page * words(page_size) + row / 64)] &= ~(std::uint64_t{1} << (row % 64));
    ++dead;
  }
  /// Removes the listed pages (ascending block-table indices) with their slots.
  void drop_pages(const std::vector<std::int32_t>& pages, int page_size) noexcept {
    std::size_t write_slot = 0, write_word = 0, write_page = 0;
    std::size_t next = 0;
    const std::int64_t history = round_start;  // each dropped page below it leaves the history
    const auto count = static_cast<std::int32_t>(position.size() / static_cast<std::size_t>(page_size));
    for (std::int32_t page = 0; page < count; ++page) {
      const auto first = static_cast<std::size_t>(page) * static_cast<std::size_t>(page_size);
      if (next < pages.size() && pages[next] == page) {
        ++next;
        for (int r = 0; r < page_size; ++r) dead -= position[first + static_cast<std::size_t>(r)] < 0;
        if (first < static_cast<std::size_t>(history)) round_start -= page_size;
        continue;
      }
      reencoded[write_page++] = reencoded[static_cast<std::size_t>(page)];
      for (int r = 0; r < page_size; ++r) position[write_slot++] = position[first + static_cast<std::size_t>(r)];
      for (int w = 0; w < words(page_size); ++w)
        live[write_word++] = live[static_cast<std::size_t>(page) * static_cast<std::size_t>(words(page_size)) + static_cast<std::size_t>(w)];
    }
    position.resize(write_slot);
    live.resize(write_word);
    reencoded.resize(write_page);
  }
};

/// One row move of a plan: the token in slot `from` goes to slot `to`.
struct slot_move {
  std::int64_t from;
  std::int64_t to;
};

/// A compaction pass over one sequence (see the file comment).
struct compaction_plan {
  std::vector<slot_move> moves;              ///< every survivor that changes slot; read all, then write all
  std::vector<std::int64_t> positions;       ///< per slot kept afterwards: its logical position, -1 for a hole
  std::int32_t pages_kept = 0;               ///< leading pages of the block table kept; the rest are freed
  std::int32_t pages_freed = 0;
  std::vector<std::int32_t> pages_written;   ///< indices (in the block table) of kept pages a move writes, ascending
  std::int64_t tokens_evicted = 0;           ///< dead slots before the pass

  /// The pass's report (`reencoded`: whether the format rewrites whole pages it changes).
  compaction_report report(bool reencoded) const noexcept {
    compaction_report r;
    r.pages_freed = pages_freed;
    r.slot_copies = static_cast<std::int64_t>(moves.size());
    r.tokens_evicted = tokens_evicted;
    r.pages_reencoded = reencoded ? static_cast<std::int32_t>(pages_written.size()) : 0;
    return r;
  }
};

namespace detail_compaction {

inline void check(const std::vector<std::int64_t>& positions, int page_size, std::int32_t frozen_pages, const char* where) {
  require(page_size >= 1, where, "page_size", page_size, ">= 1");
  require(positions.size() % static_cast<std::size_t>(page_size) == 0, where, "positions.size()", positions.size(),
          "whole pages (a multiple of page_size)");
  const auto pages = static_cast<std::int64_t>(positions.size()) / page_size;
  require(frozen_pages >= 0 && frozen_pages <= pages, where, "frozen_pages", frozen_pages,
          "0 to the number of pages");
}

/// Fills `plan.positions`, `pages_kept`, `pages_freed` and `pages_written` once `layout` (the slots
/// kept, by position) and the moves are known. Trailing dead slots free their pages, down to the
/// first `first` slots (the frozen pages, never freed).
inline void finish(compaction_plan& plan, std::vector<std::int64_t> layout, std::int64_t total_pages, int page_size,
                   std::int64_t first) {
  std::int64_t used = static_cast<std::int64_t>(layout.size());
  while (used > first && layout[static_cast<std::size_t>(used - 1)] < 0) --used;
  const std::int64_t kept = (used + page_size - 1) / page_size;
  layout.resize(static_cast<std::size_t>(kept * page_size), -1);
  plan.positions = std::move(layout);
  plan.pages_kept = static_cast<std::int32_t>(kept);
  plan.pages_freed = static_cast<std::int32_t>(total_pages - kept);
  for (const slot_move& m : plan.moves) {
    const auto page = static_cast<std::int32_t>(m.to / page_size);
    if (plan.pages_written.empty() || plan.pages_written.back() != page) plan.pages_written.push_back(page);
  }
  std::sort(plan.pages_written.begin(), plan.pages_written.end());
  plan.pages_written.erase(std::unique(plan.pages_written.begin(), plan.pages_written.end()), plan.pages_written.end());
}

}  // namespace detail_compaction

/// Order-preserving repack: the survivors after the frozen pages, in slot order, move to the
/// first slots after them. Cost: O(slots).
inline compaction_plan plan_repack(const std::vector<std::int64_t>& positions, int page_size, std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "compact::repack");
  compaction_plan plan;
  const std::int64_t first = static_cast<std::int64_t>(frozen_pages) * page_size;
  std::vector<std::int64_t> layout(positions.begin(), positions.begin() + first);
  for (std::int64_t s = 0; s < static_cast<std::int64_t>(positions.size()); ++s) {
    const std::int64_t p = positions[static_cast<std::size_t>(s)];
    if (p < 0) {
      ++plan.tokens_evicted;
      continue;
    }
    if (s < first) continue;
    const auto to = static_cast<std::int64_t>(layout.size());
    if (to != s) plan.moves.push_back(slot_move{s, to});
    layout.push_back(p);
  }
  detail_compaction::finish(plan, std::move(layout), static_cast<std::int64_t>(positions.size()) / page_size, page_size, first);
  return plan;
}

/// Hole filling: slots before `round_start` keep their survivors; the survivors from
/// `round_start` on fill the history's holes after the frozen pages, in order, and those left over
/// slide forward behind the history. `round_start`: a slot index from the end of the frozen pages
/// to the number of slots. Cost: O(slots).
inline compaction_plan plan_hole_fill(const std::vector<std::int64_t>& positions, int page_size, std::int64_t round_start,
                                      std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "compact::hole_fill");
  const std::int64_t first = static_cast<std::int64_t>(frozen_pages) * page_size;
  const auto slots = static_cast<std::int64_t>(positions.size());
  require(round_start >= first && round_start <= slots, "compact::hole_fill", "round_start", round_start,
          "a slot from the end of the shared pages to the sequence's slots");
  compaction_plan plan;
  std::vector<std::int64_t> layout(positions.begin(), positions.begin() + round_start);
  std::vector<std::int64_t> holes;
  for (std::int64_t s = 0; s < round_start; ++s)
    if (positions[static_cast<std::size_t>(s)] < 0) {
      ++plan.tokens_evicted;
      if (s >= first) holes.push_back(s);
    }
  std::size_t next_hole = 0;
  for (std::int64_t s = round_start; s < slots; ++s) {
    const std::int64_t p = positions[static_cast<std::size_t>(s)];
    if (p < 0) {
      ++plan.tokens_evicted;
      continue;
    }
    std::int64_t to;
    if (next_hole < holes.size()) {
      to = holes[next_hole++];
      layout[static_cast<std::size_t>(to)] = p;
    } else {
      to = static_cast<std::int64_t>(layout.size());
      layout.push_back(p);
    }
    if (to != s) plan.moves.push_back(slot_move{s, to});
  }
  detail_compaction::finish(plan, std::move(layout), slots / page_size, page_size, first);
  return plan;
}

/// Pages whose every slot is dead, which eviction alone returns (block-granular reclaim, no
/// compaction): their indices in the block table, ascending. Frozen pages are never listed.
inline std::vector<std::int32_t> empty_pages(const std::vector<std::int64_t>& positions, int page_size,
                                             std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "cache::evict");
  std::vector<std::int32_t> pages;
  const auto count = static_cast<std::int32_t>(positions.size() / static_cast<std::size_t>(page_size));
  for (std::int32_t page = frozen_pages; page < count; ++page) {
    const auto begin = positions.begin() + static_cast<std::ptrdiff_t>(page) * page_size;
    if (std::all_of(begin, begin + page_size, [](std::int64_t p) { return p < 0; })) pages.push_back(page);
  }
  return pages;
}

}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/memory/compaction_plan.hpp> ----

namespace kvmosaic {
namespace compact {

/// The survivors written since a sequence's previous pass (the newest round) drop into the holes
/// eviction opened before it; the rest stays where it is. Far fewer copies than `repack`, but a
/// sequence's physical order of positions is scrambled: its position map (`cache::positions`) is
/// what position-dependent code (RoPE indices, prefix hashing) must read. Pages shared with a fork
/// are left as they are. Cost per pass: one row copy per survivor of the newest round.
struct hole_fill {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::hole_fill> {
  static constexpr const char* name = "hole_fill";
  static constexpr bool frees_memory = true;
  static std::string describe(const compact::hole_fill&) { return "hole_fill"; }
  /// The pass over one sequence's slots (`detail::plan_hole_fill`): the round starts at the slot
  /// count the previous pass left.
  static detail::compaction_plan plan(const compact::hole_fill&, const std::vector<std::int64_t>& positions, int page_size,
                                      std::int64_t round_start, std::int32_t frozen_pages) {
    return detail::plan_hole_fill(positions, page_size, round_start, frozen_pages);
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/compact/hole_fill.hpp> ----

// ---- begin <kvmosaic/compact/none.hpp> ----
/// \file
/// `compact::none`: no compaction. The right choice with a read-less selector, which evicts nothing.



namespace kvmosaic {
namespace compact {

/// Never moves a token or frees a page. Cost: none.
struct none {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::none> {
  static constexpr const char* name = "none";
  static constexpr bool frees_memory = false;
  static std::string describe(const compact::none&) { return "none"; }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/compact/none.hpp> ----

// ---- begin <kvmosaic/compact/repack.hpp> ----
/// \file
/// `compact::repack`: order-preserving compaction (TriAttention's first shape, in the eviction and
/// compaction notes).



namespace kvmosaic {
namespace compact {

/// Every survivor slides forward, in logical order, so a sequence's slots are dense again and its
/// emptied tail pages go back to the pool; all survivors are read before any is written. Pages
/// shared with a fork are left as they are. Cost per pass: one row copy per survivor behind the
/// first hole (the most data movement of the two compactors), no position bookkeeping beyond the
/// cache's position map.
struct repack {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::repack> {
  static constexpr const char* name = "repack";
  static constexpr bool frees_memory = true;
  static std::string describe(const compact::repack&) { return "repack"; }
  /// The pass over one sequence's slots (`detail::plan_repack`; `round_start` is unused).
  static detail::compaction_plan plan(const compact::repack&, const std::vector<std::int64_t>& positions, int page_size,
                                      std::int64_t /*round_start*/, std::int32_t frozen_pages) {
    return detail::plan_repack(positions, page_size, frozen_pages);
  }
};

}  // namespace kvmosaic
// ---- end <kvmosaic/compact/repack.hpp> ----

// ---- begin <kvmosaic/memory/page_pool.hpp> ----
/// \file
/// The page pool: bookkeeping for a fixed number of fixed-size page slots. It hands out page ids,
/// counts references (a page shared by forked sequences, e.g. a common prompt prefix, is freed
/// when its last holder releases it) and keeps the free-page gauge, the proof of reclaimed memory.
///
/// The pool owns no bytes: the backend's arena (host memory or device memory) maps a page id to
/// its slot, `slot address = base + id * slot_bytes`, as vLLM's block tables do. Bookkeeping stays on
/// the host on every backend, as in inference engines, so allocation never synchronizes the GPU.



namespace kvmosaic {

/// Index of a page slot in a pool (int32, as in vLLM block tables).
using page_id = std::int32_t;

/// Free list and reference counts of `capacity` page slots. Cost: O(1) per allocate, retain and
/// release; O(capacity) memory. Not thread-safe: one owner drives it (the cache).
class page_pool {
 public:
  explicit page_pool(std::int32_t capacity) : ref_counts_(checked(capacity), 0) {
    free_list_.reserve(static_cast<std::size_t>(capacity));
    // Hand out low ids first: the stack pops from the back.
    for (std::int32_t id = capacity - 1; id >= 0; --id) free_list_.push_back(id);
  }

  std::int32_t capacity() const noexcept { return static_cast<std::int32_t>(ref_counts_.size()); }
  std::int32_t free_pages() const noexcept { return static_cast<std::int32_t>(free_list_.size()); }
  std::int32_t used_pages() const noexcept { return capacity() - free_pages(); }
  bool can_allocate(std::int64_t count) const noexcept { return count <= free_pages(); }

  /// Takes `count` pages, all or none, each with reference count 1. Throws `capacity_error` naming
  /// the request and the free count when the pool cannot hold them; the pool is then unchanged.
  std::vector<page_id> allocate(std::int64_t count) {
    if (count < 0) throw invalid_argument("count", detail::describe("page_pool::allocate", "count", count, ">= 0"));
    if (!can_allocate(count)) {
      throw capacity_error(
          "page_pool", "kvmosaic: page pool exhausted: " + std::to_string(count) + " page(s) needed, " +
                           std::to_string(free_pages()) + " free of " + std::to_string(capacity()) +
                           "; allowed: at most the free pages (raise cache_config::max_pages or free sequences)");
    }
    std::vector<page_id> pages(static_cast<std::size_t>(count));
    for (auto& id : pages) {
      id = free_list_.back();
      free_list_.pop_back();
      ref_counts_[static_cast<std::size_t>(id)] = 1;
    }
    return pages;
  }

  /// Adds a holder to a page in use (a forked sequence shares it).
  void retain(page_id id) {
    check_in_use(id, "page_pool::retain");
    ++ref_counts_[static_cast<std::size_t>(id)];
  }

  /// Drops a holder; the page returns to the free list when none is left.
  void release(page_id id) {
    check_in_use(id, "page_pool::release");
    if (--ref_counts_[static_cast<std::size_t>(id)] == 0) free_list_.push_back(id);
  }

  /// Holders of a page (0 when free).
  std::int32_t ref_count(page_id id) const {
    detail::require(id >= 0 && id < capacity(), "page_pool::ref_count", "page", id, "0 to capacity - 1");
    return ref_counts_[static_cast<std::size_t>(id)];
  }

 private:
  static std::size_t checked(std::int32_t capacity) {
    detail::require(capacity >= 1, "page_pool", "capacity", capacity, ">= 1");
    return static_cast<std::size_t>(capacity);
  }
  void check_in_use(page_id id, const char* where) const {
    detail::require(id >= 0 && id < capacity() && ref_counts_[static_cast<std::size_t>(id)] > 0, where, "page",
                    id, "a page id that is allocated");
  }

  std::vector<std::int32_t> ref_counts_;
  std::vector<page_id> free_list_;
};

}  // namespace kvmosaic
// ---- end <kvmosaic/memory/page_pool.hpp> ----

// ---- begin <kvmosaic/memory/block_table.hpp> ----
/// \file
/// Per-sequence block tables: logical page i of a sequence lives in pool slot `pages[i]`.
/// A token at logical position t is in page t / page_size at row t % page_size, or in the dense
/// tail when t >= pages.size() * page_size. Kernels receive the tables of a batch packed into one
/// int32 matrix by `pack_block_tables`.



namespace kvmosaic {

/// The ordered page ids of one sequence.
using block_table = std::vector<page_id>;

/// Packs the tables of a batch into a row-major [batch][max_pages] int32 matrix padded with -1
/// (the layout paged-attention kernels index as `table[b * stride + i]`). Returns the row stride.
inline std::int32_t pack_block_tables(const std::vector<const block_table*>& tables, std::vector<std::int32_t>& out) {
  std::size_t stride = 1;
  for (const block_table* t : tables) stride = std::max(stride, t->size());
  out.assign(tables.size() * stride, -1);
  for (std::size_t b = 0; b < tables.size(); ++b) std::copy(tables[b]->begin(), tables[b]->end(), out.begin() + b * stride);
  return static_cast<std::int32_t>(stride);
}

}  // namespace kvmosaic
// ---- end <kvmosaic/memory/block_table.hpp> ----

// ---- begin <kvmosaic/host/backend.hpp> ----
/// \file
/// The host backend: page and tail storage in host memory and the CPU implementation of every cache
/// operation (extend, append, attend), built on the format's host reference primitives and Eigen.
/// It is the test oracle's sibling (same arithmetic as the kernels: fp32 logits and accumulators,
/// online softmax merged page by page) and the backend the demo runs on without a GPU.
///
/// Layouts (all row-major, bytes):
///   page slot  = [K: num_kv_heads x k_page_bytes][V: num_kv_heads x v_page_bytes]
///   tail slot  = [K: num_kv_heads x tail head][V: same], storage dtype (format::dense), a tail head
///                = [recent window ring: W rows][sinks: S rows][tail: page_size rows] (W, S: the
///                format's `window_rows` and `sink_rows`, usually 0). Ring entry j (the sealed
///                position S + j modulo W) is row W - 1 - j, so a sequence's exact rows, however
///                many it holds yet, and its tail rows are one contiguous run ending at the tail.

#include <exception>
#include <memory>
#include <new>
#include <optional>


namespace kvmosaic {
namespace backend {
/// Runs everything on the CPU, with pages in host memory.
struct host {
  using policy_category = backend_tag;
  static constexpr const char* name = "host";
};
}  // namespace backend

namespace detail {

/// The geometry every backend engine is built from (a subset of cache_config, already validated).
struct engine_shape {
  int num_kv_heads;
  int group_size;
  int head_dim;
  int page_size;
  dtype storage;
  std::int32_t max_pages;
  std::int32_t max_sequences;

  page_shape page() const { return page_shape{page_size, head_dim, storage}; }
  std::size_t row_elements() const { return static_cast<std::size_t>(num_kv_heads) * head_dim; }
};

/// Byte geometry of one format's page and tail arenas (the layouts in this file's comment): the
/// one place every engine computes slot sizes and offsets.
struct arena_geometry {
  template <class Format>
  arena_geometry(const engine_shape& shape, const Format& format)
      : num_kv_heads(shape.num_kv_heads),
        k_page_bytes(format_traits<Format>::k_page_bytes(format, shape.page())),
        v_page_bytes(format_traits<Format>::v_page_bytes(format, shape.page())),
        sink_rows(kvmosaic::sink_rows(format)),
        window_rows(kvmosaic::window_rows(format)),
        exact_rows(sink_rows + window_rows),
        row_bytes(static_cast<std::size_t>(shape.head_dim) * size_of(shape.storage)),
        tail_head_bytes((static_cast<std::size_t>(shape.page_size) + exact_rows) * row_bytes) {}

  std::size_t num_kv_heads;
  std::size_t k_page_bytes;     ///< one page of K of one head, by the format's accounting
  std::size_t v_page_bytes;     ///< one page of V of one head
  std::size_t sink_rows;        ///< S: exact sink rows a tail head keeps (format's `sink_rows`)
  std::size_t window_rows;      ///< W: exact recent-window rows a tail head keeps (`window_rows`)
  std::size_t exact_rows;       ///< S + W
  std::size_t row_bytes;        ///< one dense row of one head
  std::size_t tail_head_bytes;  ///< the window ring, the sinks, then page_size tail rows, of one head (K or V)

  /// One pool slot: a page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return num_kv_heads * (k_page_bytes + v_page_bytes); }
  /// One tail slot: the exact rows and page_size tail rows of K and of V for every KV head.
  std::size_t tail_slot_bytes() const noexcept { return 2 * num_kv_heads * tail_head_bytes; }
  /// Offset of tail row 0 inside a tail head (after the exact rows).
  std::size_t tail_row_offset() const noexcept { return exact_rows * row_bytes; }
  /// Exact rows a sequence with `sealed` sealed tokens holds (just before its tail rows):
  /// min(S + W, sealed), 0 before its first page is sealed.
  std::int64_t exact_rows_held(std::int64_t sealed) const noexcept {
    return sealed > 0 ? std::min(static_cast<std::int64_t>(exact_rows), sealed) : 0;
  }
  /// The row of a tail head (from its start) that keeps the exact copy of sealed position `t`
  /// (a sink, or a window position >= S).
  std::size_t exact_row_of(std::int64_t t) const noexcept {
    if (t < static_cast<std::int64_t>(sink_rows)) return window_rows + static_cast<std::size_t>(t);
    return window_rows - 1 - static_cast<std::size_t>((t - static_cast<std::int64_t>(sink_rows)) % static_cast<std::int64_t>(window_rows));
  }
  /// The logical positions of the `exact_rows_held(sealed)` rows the attend path folds before the
  /// tail rows (the run that ends where the tail's rows begin), in run order.
  void exact_run_positions(std::int64_t sealed, std::int64_t* out) const noexcept {
    const std::int64_t held = exact_rows_held(sealed), region = static_cast<std::int64_t>(exact_rows);
    const auto place = [&](std::int64_t t) {
      const std::int64_t run_row = static_cast<std::int64_t>(exact_row_of(t)) - (region - held);
      if (run_row >= 0 && run_row < held) out[run_row] = t;
    };
    const auto sinks = static_cast<std::int64_t>(sink_rows), window = static_cast<std::int64_t>(window_rows);
    for (std::int64_t t = 0; t < std::min(sinks, sealed); ++t) place(t);
    for (std::int64_t t = std::max(sinks, sealed - window); t < sealed; ++t) place(t);
  }
  /// Whether sealed position `t` of a sequence with `sealed` sealed tokens is attended from its
  /// exact copy (its page copy is masked): a sink, or one of the last W sealed tokens.
  bool exact_position(std::int64_t t, std::int64_t sealed) const noexcept {
    return t < static_cast<std::int64_t>(sink_rows) || t >= sealed - static_cast<std::int64_t>(window_rows);
  }
  /// Whether any sealed position in [from, to) is attended from its exact copy: only the first
  /// pages (sinks) and the last ones (the window) have rows to mask, so a step's row masks cost
  /// O(pages), not O(tokens).
  bool any_exact_position(std::int64_t from, std::int64_t to, std::int64_t sealed) const noexcept {
    return from < to && (from < static_cast<std::int64_t>(sink_rows) || to > sealed - static_cast<std::int64_t>(window_rows));
  }
  /// Offsets inside a page slot and a tail slot.
  std::size_t k_page_offset(int head) const noexcept { return head * k_page_bytes; }
  std::size_t v_page_offset(int head) const noexcept { return num_kv_heads * k_page_bytes + head * v_page_bytes; }
  std::size_t tail_offset(bool is_v, int head) const noexcept {
    return (static_cast<std::size_t>(is_v) * num_kv_heads + head) * tail_head_bytes;
  }
};

/// What the attend path needs to know about one sequence of a batch.
struct sequence_ref {
  const block_table* pages;   ///< full (encoded) pages, in order
  std::int64_t length;        ///< tokens stored: pages->size() * page_size + tail rows
  std::int32_t slot;          ///< tail slot
  const std::uint64_t* live = nullptr;  ///< per page, the live rows (`slot_positions::live`); null: every row
  /// A step that records token scores (`score_settings`): where they go, [position][num_kv_heads];
  /// null: none recorded for this sequence.
  float* scores = nullptr;
  const std::int64_t* positions = nullptr;  ///< per sealed slot, its logical position; null: the slot's index
  std::int64_t tail_position = -1;          ///< the tail's first logical position; -1: pages->size() * page_size
};

/// One sequence of a decode batch's append: its tail slot, the rows its tail holds, the page
/// its tail is sealed into when this token fills it (-1 otherwise), and the pages it has.
struct append_item {
  std::int32_t slot;
  std::int32_t tail_rows;
  page_id new_page;
  std::int64_t sealed_pages;
};

/// Block summaries kept per block of every page for a read-less selector (`block_summary`):
/// `select::quest`'s key bounds (the channel-wise min row then max row of each block's keys) or
/// `select::mean_keys`'s mean key row, per KV head, in the storage dtype; or, for a mean key
/// over a format with block keys (`has_block_keys_v`), the format's block key of
/// `block_key_bytes` bytes.
struct bounds_geometry {
  bounds_geometry(const engine_shape& shape, int block, block_summary kind = block_summary::bounds,
                  std::size_t block_key_bytes = 0)
      : block_tokens(block),
        blocks_per_page(block > 0 ? shape.page_size / block : 0),
        summary(kind),
        rows_per_block(summary_rows(kind)),
        row_bytes(static_cast<std::size_t>(shape.head_dim) * size_of(shape.storage)),
        block_bytes(block_key_bytes > 0 ? block_key_bytes : rows_per_block * row_bytes),
        format_keys(block_key_bytes > 0),
        head_bytes(static_cast<std::size_t>(blocks_per_page) * block_bytes),
        page_bytes(static_cast<std::size_t>(shape.num_kv_heads) * head_bytes) {}
  int block_tokens;        ///< 0: no summaries kept
  int blocks_per_page;
  block_summary summary;
  int rows_per_block;      ///< 2 (lo row, hi row) or 1 (mean row)
  std::size_t row_bytes;   ///< one row of head_dim values
  std::size_t block_bytes; ///< one block's summary of one KV head
  bool format_keys;        ///< the blocks keep the format's block keys, not dense rows
  std::size_t head_bytes;  ///< the summaries of one page of one KV head: [blocks][block_bytes]
  std::size_t page_bytes;  ///< the summaries of one page (every KV head): what a page costs on top
  std::size_t offset(page_id page, int head, int block) const noexcept {
    return static_cast<std::size_t>(page) * page_bytes + head * head_bytes + static_cast<std::size_t>(block) * block_bytes;
  }
};

/// The fp32 mean of `n` rows (head_dim floats each): per channel a sum in token order divided by
/// n, the order of the CUDA summary kernels.
inline void mean_key(const float* rows, int n, int head_dim, float* mean) {
  for (int c = 0; c < head_dim; ++c) {
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum = sum + rows[static_cast<std::size_t>(t) * head_dim + c];
    mean[c] = sum / static_cast<float>(n);
  }
}

/// Writes the channel-wise min and max of `n` rows (head_dim floats each, already exact in the
/// storage dtype) as two stored rows at `out`.
inline void store_key_bounds(dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  std::vector<float> bounds(2 * static_cast<std::size_t>(head_dim));
  for (int c = 0; c < head_dim; ++c) {
    float lo = rows[c], hi = rows[c];
    for (int t = 1; t < n; ++t) {
      const float x = rows[static_cast<std::size_t>(t) * head_dim + c];
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    bounds[static_cast<std::size_t>(c)] = lo;
    bounds[static_cast<std::size_t>(head_dim + c)] = hi;
  }
  store_dense_rows(storage, bounds.data(), bounds.size(), out);
}

/// Writes the mean of `n` rows (head_dim floats each, exact in the storage dtype) as one stored
/// row at `out`: per channel an fp32 sum in token order, divided by n, rounded to the storage
/// dtype (the CUDA summary kernel computes it in the same order: the same bits).
inline void store_mean_key(dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  std::vector<float> mean(static_cast<std::size_t>(head_dim));
  mean_key(rows, n, head_dim, mean.data());
  store_dense_rows(storage, mean.data(), mean.size(), out);
}

/// Writes the summary `kind` of `n` rows at `out`.
inline void store_block_summary(block_summary kind, dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  if (kind == block_summary::mean) store_mean_key(storage, rows, n, head_dim, out);
  else store_key_bounds(storage, rows, n, head_dim, out);
}

/// What one step read for one (sequence, KV head): the selected spans' token ranges (merged,
/// ascending), the tokens attended (selected, open chunk, tail, sinks) and the pages read.
struct head_selection {
  std::vector<std::pair<std::int64_t, std::int64_t>> selected;
  std::int64_t tokens_selected = 0;
  std::int64_t tokens_read = 0;
  std::int32_t pages_read = 0;
};

/// Row b of a [batch][heads][head_dim] view, as a one-row view.
template <class T>
tensor_view<const T, 3> row_of(const tensor_view<const T, 3>& x, std::int64_t b) {
  return tensor_view<const T, 3>::strided(&x(b, 0, 0), {1, x.extent(1), x.extent(2)},
                                          {x.stride(0), x.stride(1), x.stride(2)});
}

/// Owns bytes with 64-byte alignment and leaves them uninitialized (pages are written before read).
class host_buffer {
 public:
  explicit host_buffer(std::size_t bytes) : bytes_(bytes), data_(allocate(bytes)) {}
  std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return bytes_; }

 private:
  struct free_aligned {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  static std::byte* allocate(std::size_t bytes) {
    try {
      return static_cast<std::byte*>(::operator new[](bytes == 0 ? 64 : bytes, std::align_val_t{64}));
    } catch (const std::bad_alloc&) {
      throw capacity_error("cache_config", "kvmosaic: host backend: cannot allocate " + std::to_string(bytes) +
                                               " bytes of page or tail storage; allowed: a cache_config whose "
                                               "max_pages and max_sequences fit in host memory");
    }
  }
  std::size_t bytes_;
  std::unique_ptr<std::byte[], free_aligned> data_;
};

/// Calls body(i, scratch) for every i in [0, n). Compiled with OpenMP (`_OPENMP`: the consumer
/// builds with -fopenmp) and for n > 1, on OpenMP's threads (`OMP_NUM_THREADS`; dynamic schedule,
/// one item at a time), each thread with its own scratch, made by make_scratch() when it takes
/// its first item; otherwise in order on the calling thread, with one scratch. When items throw,
/// the exception of the lowest one is rethrown, as the serial loop would throw it (on threads,
/// after the others have run). The host backend's one way of spreading independent work.
template <class MakeScratch, class Body>
void for_each_item(std::int64_t n, const MakeScratch& make_scratch, const Body& body) {
  using scratch_type = decltype(make_scratch());
#if defined(_OPENMP)
  if (n > 1) {
    std::exception_ptr error;
    std::int64_t error_item = n;
#pragma omp parallel
    {
      std::optional<scratch_type> scratch;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t i = 0; i < n; ++i) {
        try {
          if (!scratch) scratch.emplace(make_scratch());
          body(i, *scratch);
        } catch (...) {
#pragma omp critical(kvmosaic_host_item_error)
          if (i < error_item) {
            error_item = i;
            error = std::current_exception();
          }
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  if (n <= 0) return;
  scratch_type scratch = make_scratch();
  for (std::int64_t i = 0; i < n; ++i) body(i, scratch);
}

/// The rows a segment whose first page is page `index` is fit to: that page's rows from `skip`
/// (its sinks are left out of a first segment), then `ahead` more; `count` in all.
struct segment_fit_rows {
  int skip;
  std::int64_t count;
  static segment_fit_rows of(const arena_geometry& geometry, int page_size, std::int64_t index, std::int64_t ahead) {
    const int skip = index == 0 ? static_cast<int>(geometry.sink_rows) : 0;
    return segment_fit_rows{skip, page_size - skip + ahead};
  }
};

/// The segments (one per KV head) of a sequence's segment whose first page is page `index` (a
/// multiple of `segment_pages`), about to be sealed from the full tail slot `tail` (host bytes):
/// each fitted (`format_traits::plan_segment`) to the rows an engine has of the segment, the
/// page's rows (the sinks left out of a first segment) and rows [next, next + segment_tokens -
/// page_size) of the call's `k`, `v` as far as they go (a prefill gives the whole segment; an
/// append, its first page). One function for both backends, so both fit the same bases to the
/// same rows. The KV heads are planned by `for_each_item` (on OpenMP's threads where built with
/// OpenMP), each as on one thread: the same segments, bit for bit, for any thread count. `sums`
/// (formats with `has_segment_sums_v`; [num_kv_heads][segment_sum_count]): the rows' sums as a
/// device computed them, in the order `format_traits::segment_sums` defines, which each head's
/// plan then takes with its rows (`plan_segment_from_sums`; a plan that reads no rows needs only
/// the sums, and no call of this function). Cost: the format's plan per KV head; per thread, two
/// [segment_tokens][head_dim] fp32 buffers.
template <class Format, class T>
std::vector<typename segment_type<Format>::type> plan_segments(const Format& format, const engine_shape& engine,
                                                               const arena_geometry& geometry, const std::byte* tail,
                                                               std::int64_t index, const tensor_view<const T, 3>& k,
                                                               const tensor_view<const T, 3>& v, std::int64_t next,
                                                               const double* sums = nullptr) {
  using traits = format_traits<Format>;
  using segment = typename segment_type<Format>::type;
  const page_shape shape = engine.page();
  const int per = traits::segment_pages(format, shape);
  const int p = engine.page_size, d = engine.head_dim, heads = engine.num_kv_heads;
  const std::int64_t ahead = std::min<std::int64_t>(k.extent(0) - next, static_cast<std::int64_t>(per - 1) * p);
  const segment_fit_rows fit = segment_fit_rows::of(geometry, p, index, ahead);
  const int skip = fit.skip;
  const std::int64_t n = fit.count;
  struct rows_scratch {
    std::vector<float> k_rows, v_rows, page;  // [n][d], [n][d], [p][d]
  };
  static_cast<void>(sums);  // formats without sums
  // Head h's K and V rows into the scratch, then its plan.
  const auto plan_head = [&](std::int64_t h, rows_scratch& s) {
    s.k_rows.resize(static_cast<std::size_t>(n) * d);
    s.v_rows.resize(s.k_rows.size());
    s.page.resize(static_cast<std::size_t>(p) * d);
    for (const bool is_v : {false, true}) {
      std::vector<float>& rows = is_v ? s.v_rows : s.k_rows;
      load_dense_rows(shape.storage, tail + geometry.tail_offset(is_v, static_cast<int>(h)) + geometry.tail_row_offset(),
                      static_cast<std::size_t>(p) * d, s.page.data());
      std::copy(s.page.begin() + static_cast<std::ptrdiff_t>(skip) * d, s.page.end(), rows.begin());
      const tensor_view<const T, 3>& src = is_v ? v : k;
      for (std::int64_t t = 0; t < ahead; ++t)
        for (int c = 0; c < d; ++c) rows[static_cast<std::size_t>((p - skip + t) * d + c)] = to_float(src(next + t, h, c));
    }
    if constexpr (has_segment_sums_v<Format>) {
      if (sums != nullptr)
        return traits::plan_segment_from_sums(format, shape, sums + h * traits::segment_sum_count(format, shape), n, s.k_rows.data(),
                                              s.v_rows.data());
    }
    return traits::plan_segment(format, shape, s.k_rows.data(), s.v_rows.data(), n);
  };
  std::vector<segment> planned(static_cast<std::size_t>(heads));
  const auto make_scratch = [] { return rows_scratch(); };
  for_each_item(heads, make_scratch, [&](std::int64_t h, rows_scratch& s) { planned[static_cast<std::size_t>(h)] = plan_head(h, s); });
  return planned;
}

}  // namespace detail

namespace host {

/// The host engine of one format: storage plus the CPU data path. The cache drives it with
/// validated arguments and does all bookkeeping (pool, block tables, lengths) itself.
template <class Format>
class engine {
  using traits = format_traits<Format>;
  using dense_traits = format_traits<format::dense>;

 public:
  /// What the pages of one segment and KV head share (formats with segments; else empty).
  using segment_t = typename detail::segment_type<Format>::type;
  /// Every format's attend path writes the scores of the tokens it reads (`plan`'s score_settings).
  static constexpr bool records_token_scores = true;
  /// No device: `cache::window_votes` scores the keys it reads back, in fp64.
  static constexpr bool computes_window_votes = false;

  /// Keeps the key bounds of every block of `selector_traits<Selector>::bounds_block_tokens`
  /// tokens of each sealed page (none when 0). Selectors with other per-sequence data keep it in
  /// their host state and pass it with each step (`select::sentence_chunks`: `chunk_list`).
  template <class Selector = select::all>
  engine(const detail::engine_shape& shape, const Format& format, const Selector& selector = {})
      : shape_(shape),
        format_(format),
        geometry_(shape, format),
        bounds_geometry_(shape, selector_traits<Selector>::bounds_block_tokens(selector, shape.page_size),
                         detail::block_summary_of<Selector>::value, block_key_bytes_for<Selector>(format, shape)),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        bounds_(static_cast<std::size_t>(shape.max_pages) * bounds_geometry_.page_bytes) {}

  const detail::arena_geometry& geometry() const noexcept { return geometry_; }
  const detail::bounds_geometry& bounds_geometry() const noexcept { return bounds_geometry_; }
  /// Whether the page blocks keep the format's block keys (`has_block_keys_v`: a mean key over
  /// such a format) rather than dense summary rows.
  bool format_block_keys() const noexcept { return bounds_geometry_.format_keys; }
  /// Bytes of one pool slot: one page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return geometry_.page_slot_bytes(); }
  /// Bytes a page costs besides its slot: the key bounds a selector keeps (0 for none).
  std::size_t page_bounds_bytes() const noexcept { return bounds_geometry_.page_bytes; }
  /// The key bounds of block `block` of `page`, KV head `head`: lo row then hi row.
  const std::byte* page_bounds(page_id page, int head, int block) const {
    return bounds_.data() + bounds_geometry_.offset(page, head, block);
  }
  /// What the last selected step read, per (batch entry, KV head): [b * num_kv_heads + h].
  const std::vector<detail::head_selection>& last_selection() const noexcept { return last_selection_; }

  /// Appends `rows` ([n][num_kv_heads][head_dim]) to the tail of `slot`, which holds `tail_rows`
  /// rows after `sealed_pages` pages. Each time the tail fills, it is encoded into the next page
  /// of `new_pages`. Until the next `commit`, `rollback` restores the tail rows this overwrote
  /// (the rows after a sealed page land where the old tail rows were).
  template <class T>
  void extend(std::int32_t slot, int tail_rows, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              const page_id* new_pages, std::int64_t sealed_pages) {
    const std::size_t row_bytes = static_cast<std::size_t>(shape_.head_dim) * size_of(shape_.storage);
    std::vector<float> row(static_cast<std::size_t>(shape_.head_dim));
    // Rows after a sealed page land on the old tail rows, and a seal rewrites the exact rows.
    if ((tail_rows > 0 && tail_rows + k.extent(0) > shape_.page_size) ||
        (geometry_.exact_rows > 0 && tail_rows + k.extent(0) >= shape_.page_size))
      save_tail(slot, tail_rows);
    const auto store = [&](tensor_view<const T, 3> src, bool is_v, std::int64_t t, int h) {
      for (int c = 0; c < shape_.head_dim; ++c) row[static_cast<std::size_t>(c)] = to_float(src(t, h, c));
      detail::store_dense_rows(shape_.storage, row.data(), row.size(), tail_head(slot, is_v, h) + tail_rows * row_bytes);
    };
    for (std::int64_t t = 0; t < k.extent(0); ++t) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        store(k, false, t, h);
        store(v, true, t, h);
      }
      if (++tail_rows == shape_.page_size) {
        if constexpr (has_segments_v<Format>) plan_segment_at(slot, sealed_pages, k, v, t + 1);
        seal_tail(slot, *new_pages++, sealed_pages++);
        tail_rows = 0;
      }
    }
  }

  /// Appends row b of `k`, `v` ([batch][num_kv_heads][head_dim]) to sequence items[b].
  template <class T>
  void append(const std::vector<detail::append_item>& items, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    for (std::size_t b = 0; b < items.size(); ++b) {
      const auto row = static_cast<std::int64_t>(b);
      extend(items[b].slot, items[b].tail_rows, detail::row_of(k, row), detail::row_of(v, row), &items[b].new_page,
             items[b].sealed_pages);
    }
  }

  /// Undoes the writes since the last `commit` that a caller can see: the tail rows an `extend`
  /// overwrote and the exact rows its seals rewrote, of every slot it saved (latest first). (Rows
  /// written past a tail's committed length, and fresh pages, are never read.)
  void rollback() noexcept {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      const std::size_t bytes = (geometry_.exact_rows + static_cast<std::size_t>(it->rows)) * geometry_.row_bytes;
      std::size_t at = it->at;
      for (int h = 0; h < shape_.num_kv_heads; ++h)
        for (const bool is_v : {false, true}) {
          std::memcpy(tail_slot(it->slot) + geometry_.tail_offset(is_v, h), saved_tail_.data() + at, bytes);
          at += bytes;
        }
    }
    saved_.clear();
    saved_tail_.clear();
  }
  /// Makes the writes since the last `commit` final.
  void commit() noexcept {
    saved_.clear();
    saved_tail_.clear();
  }

  /// Copies the page slots `pages[0 .. n)` (`page_slot_bytes()` each, in that order) into host
  /// memory at `out`: the bytes `cache::read` decodes. Cost: n slot copies.
  void copy_pages_out(const page_id* pages, std::size_t n, std::byte* out) const {
    for (std::size_t i = 0; i < n; ++i)
      std::memcpy(out + i * page_slot_bytes(), pages_.data() + static_cast<std::size_t>(pages[i]) * page_slot_bytes(),
                  page_slot_bytes());
  }
  /// Copies the tail slot of `slot` (`geometry().tail_slot_bytes()`: its tail rows, then its sink
  /// rows, per KV head, K then V) into host memory at `out`. Cost: one slot copy.
  void copy_tail_out(std::int32_t slot, std::byte* out) const {
    std::memcpy(out, tail_slot(slot), geometry_.tail_slot_bytes());
  }

  /// Copies the first `rows` tail rows of one slot to another (fork); the K weights go along.
  void copy_tail(std::int32_t from, std::int32_t to, int rows) {
    (void)rows;  // whole slot: simpler, and the bytes past `rows` are never read
    std::memcpy(tail_slot(to), tail_slot(from), geometry_.tail_slot_bytes());
    if constexpr (has_key_weights_v<Format>) {
      key_weights_[static_cast<std::size_t>(to)] = key_weights_[static_cast<std::size_t>(from)];
    }
    if constexpr (has_segments_v<Format>) segments_[static_cast<std::size_t>(to)] = segments_[static_cast<std::size_t>(from)];
  }

  /// The segment of KV head `head` that page `index` of the sequence in `slot` is stored in
  /// (formats with segments).
  const segment_t& segment(std::int32_t slot, std::int64_t index, int head) const {
    const std::int64_t s = index / traits::segment_pages(format_, shape_.page());
    return segments_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(s * shape_.num_kv_heads + head)];
  }
  /// Bytes the segments of a sequence of `pages` sealed pages keep (0 for formats without).
  std::size_t segment_bytes(std::int64_t pages) const {
    if constexpr (has_segments_v<Format>) {
      const std::int64_t per = traits::segment_pages(format_, shape_.page());
      return static_cast<std::size_t>((pages + per - 1) / per) * shape_.num_kv_heads * traits::segment_bytes(format_, shape_.page());
    } else {
      (void)pages;
      return 0;
    }
  }
  /// Decodes the first n rows of page `index` of the sequence in `slot` (stored at `page`), KV
  /// head `head`, K or V: the format's host decode, in the page's segment where it has them.
  void decode_page(std::int32_t slot, std::int64_t index, int head, bool is_v, const std::byte* page, int n, float* rows) const {
    const page_shape shape = shape_.page();
    if constexpr (has_segments_v<Format>) {
      const segment_t& seg = segment(slot, index, head);
      if (is_v) traits::decode_v(format_, shape, seg, page, n, rows);
      else traits::decode_k(format_, shape, seg, page, n, rows);
    } else {
      (void)slot, (void)index, (void)head;
      if (is_v) traits::decode_v(format_, shape, page, n, rows);
      else traits::decode_k(format_, shape, page, n, rows);
    }
  }

  /// Output-aware K pruning for the pages of `slot` sealed from now on: weights [num_kv_heads]
  /// [head_dim] (host memory), or null for plain magnitudes.
  void set_key_weights(std::int32_t slot, const float* weights) {
    static_assert(has_key_weights_v<Format>, "this format has no K weights");
    std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
    if (weights == nullptr)
      w.clear();
    else
      w.assign(weights, weights + shape_.row_elements());
  }

  /// A compaction pass over the sealed pages `pages` of the sequence in `slot` (`plan`, from
  /// memory/compaction_plan.hpp): every page a move reads or writes is decoded to dense rows, each
  /// moved row is taken from the decoded sources (so every source is read before any destination
  /// is written), and the pages written are encoded again from the moved rows rounded to the
  /// storage dtype, with the format's re-encoding mode (`detail::reencoding`: its format, and the
  /// sequence's K weights where it uses them), their key bounds rewritten. `first_page_sinks`: the
  /// sequence's first page keeps sink rows (they are hidden again, as at seal, before the bounds
  /// and the encode). Cost: one decode of each page touched and one encode of each page written,
  /// O(page_size x head_dim) each, per KV head.
  void move_slots(std::int32_t slot, const block_table& pages, const detail::compaction_plan& plan, bool first_page_sinks) {
    if (plan.moves.empty()) return;
    const page_shape shape = shape_.page();
    const int p = shape_.page_size, d = shape_.head_dim, heads = shape_.num_kv_heads;
    const std::size_t page_rows = static_cast<std::size_t>(p) * d;  // floats of one page, one head, K or V
    std::vector<std::int32_t> touched = plan.pages_written;
    for (const detail::slot_move& m : plan.moves) touched.push_back(static_cast<std::int32_t>(m.from / p));
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    const auto index_of = [&](std::int32_t page) {
      return static_cast<std::size_t>(std::lower_bound(touched.begin(), touched.end(), page) - touched.begin());
    };
    // [touched page][head][K, V][rows]: decoded once, read-only; the written pages' rows are copies.
    std::vector<float> decoded(touched.size() * heads * 2 * page_rows);
    const auto rows_of = [&](std::vector<float>& buffer, std::size_t i, int h, int is_v) {
      return buffer.data() + ((i * heads + h) * 2 + is_v) * page_rows;
    };
    for (std::size_t i = 0; i < touched.size(); ++i)
      for (int h = 0; h < heads; ++h) {
        const page_id page = pages[static_cast<std::size_t>(touched[i])];
        decode_page(slot, touched[i], h, false, k_page(page, h), p, rows_of(decoded, i, h, 0));
        decode_page(slot, touched[i], h, true, v_page(page, h), p, rows_of(decoded, i, h, 1));
      }
    // Pages are encoded from storage-dtype rows, at seal and here alike (the CUDA backend's
    // scratch rows are 16-bit): a decoded value between two of them is rounded to the nearest.
    for (float& x : decoded) x = detail::storage_value(detail::storage_bits(x, shape_.storage), shape_.storage);
    const Format reencoding = detail::reencoding<Format>::format(format_);
    std::vector<float> written = decoded;
    for (const detail::slot_move& m : plan.moves) {
      const std::size_t from = index_of(static_cast<std::int32_t>(m.from / p)), to = index_of(static_cast<std::int32_t>(m.to / p));
      for (int h = 0; h < heads; ++h)
        for (int is_v = 0; is_v < 2; ++is_v)
          std::copy_n(rows_of(decoded, from, h, is_v) + (m.from % p) * d, d, rows_of(written, to, h, is_v) + (m.to % p) * d);
    }
    std::vector<float> rows(page_rows);
    for (const std::int32_t index : plan.pages_written) {
      const std::size_t i = index_of(index);
      const page_id page = pages[static_cast<std::size_t>(index)];
      std::byte* base = pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes();
      const int sinks = detail::hides_sink_rows_v<Format> && first_page_sinks && index == 0 ? static_cast<int>(geometry_.sink_rows) : 0;
      for (int h = 0; h < heads; ++h) {
        for (int is_v = 0; is_v < 2; ++is_v) {
          std::copy_n(rows_of(written, i, h, is_v), page_rows, rows.begin());
          for (int t = 0; t < sinks; ++t)  // hidden as at seal: the first row after them
            std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(sinks) * d, d, rows.begin() + static_cast<std::ptrdiff_t>(t) * d);
          if (is_v == 0)
            for (int block = 0; block < bounds_geometry_.blocks_per_page; ++block)
              store_block(slot, index, page, h, block, rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * d);
          if constexpr (has_segments_v<Format>) {
            const segment_t& seg = segment(slot, index, h);
            if (is_v == 1) traits::encode_v(reencoding, shape, seg, rows.data(), base + geometry_.v_page_offset(h));
            else traits::encode_k(reencoding, shape, seg, rows.data(), base + geometry_.k_page_offset(h));
          } else if (is_v == 1) {
            traits::encode_v(reencoding, shape, rows.data(), base + geometry_.v_page_offset(h));
          } else if constexpr (has_key_weights_v<Format>) {
            const std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
            const bool weighted = detail::reencoding<Format>::key_weights && !w.empty();
            traits::encode_k(reencoding, shape, rows.data(), weighted ? w.data() + h * d : nullptr, base + geometry_.k_page_offset(h));
          } else {
            traits::encode_k(reencoding, shape, rows.data(), base + geometry_.k_page_offset(h));
          }
        }
      }
    }
  }

  /// The host half of a decode step (`cache::plan`): keeps the batch, the scale and the
  /// selection request for `run` (the batch's block tables are read when `run` runs).
  /// With `scores.use` other than none, `run` also writes each read token's score
  /// (select/token_scores.hpp) to the sequences' `scores`.
  void plan(const std::vector<detail::sequence_ref>& batch, float softmax_scale, const detail::selection_request* request = nullptr,
            const score_settings& scores = {}) {
    planned_batch_ = batch;
    planned_scale_ = softmax_scale;
    planned_request_ = request != nullptr ? *request : detail::selection_request{};
    planned_selects_ = request != nullptr;
    planned_scores_ = scores;
  }

  /// The planned step (`cache::run`): out[b][j] = softmax(scale * q[b][j] . K_b) V_b over every
  /// stored token of sequence b, or, with a selection request, over the tokens the selection
  /// reads (docs/selectors.md); lse[b][j] (optional, extent 0: not written) its log-sum-exp.
  /// q, out: [batch][num_kv_heads * group_size][head_dim], float, half or bfloat16, any strides.
  ///
  /// Each (sequence, KV head) is computed alone, from its own pages, into its own outputs, with
  /// the same operations in the same order whichever thread runs it: the outputs are the same
  /// bits for any thread count. The pairs are spread by `detail::for_each_item`: over OpenMP's
  /// threads where the consumer builds with OpenMP, else on the calling thread. Cost: per pair,
  /// one score and one accumulate per page read plus the tail and sinks; working memory per
  /// thread, no allocation per page or token.
  template <class Q, class O>
  void run(tensor_view<const Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse) {
    const std::int64_t heads = shape_.num_kv_heads;
    const std::int64_t items = static_cast<std::int64_t>(planned_batch_.size()) * heads;
    if (planned_selects_) last_selection_.assign(static_cast<std::size_t>(items), {});
    prepare_visible_rows();
    struct worker {
      attend_scratch s;
      std::vector<std::uint64_t> keep;
    };
    kvmosaic::detail::for_each_item(
        items, [&] { return worker{attend_scratch(shape_.group_size, shape_.head_dim, scratch_rows()), {}}; },
        [&](std::int64_t i, worker& w) {
          attend_head(q, out, lse, static_cast<std::size_t>(i / heads), static_cast<int>(i % heads), w.s, w.keep);
        });
  }

  const std::byte* k_page(page_id page, int head) const {
    return pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes() + geometry_.k_page_offset(head);
  }
  const std::byte* v_page(page_id page, int head) const {
    return pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes() + geometry_.v_page_offset(head);
  }

 private:
  /// Per-call working memory of attend, sized once per call rather than per page.
  struct attend_scratch {
    attend_scratch(int groups, int head_dim, int page_size)
        : q_group(static_cast<std::size_t>(groups) * head_dim),
          logits(static_cast<std::size_t>(groups) * page_size),
          o(q_group.size()),
          o_block(q_group.size()),
          state(static_cast<std::size_t>(groups)),
          block(state.size()),
          q_basis(q_group.size()),
          o_segment(q_group.size()),
          segment_state(state.size()) {}
    std::vector<float> q_group, logits, o, o_block;
    std::vector<softmax_state<float>> state, block;
    // Formats with segments: the queries, output and state of the segment being folded, in its
    // space (at most head_dim channels).
    std::vector<float> q_basis, o_segment;
    std::vector<softmax_state<float>> segment_state;
    // A step that records token scores: the positions of the block being folded, and per read
    // token its position and its G scaled logits ([token][G]).
    bool record = false;
    std::vector<std::int64_t> block_positions, read_positions;
    std::vector<float> read_logits;
  };

  /// Rows a step's block folds at most: a page, or the exact rows and the tail in one run.
  int scratch_rows() const noexcept { return shape_.page_size + static_cast<int>(geometry_.exact_rows); }

  /// Per planned sequence holding exact rows: the page rows read from the pages (live, and not
  /// one of the exact rows, which are read from their copies), [page][mask word]; empty otherwise.
  /// Cost: O(sealed tokens) per such sequence, once per step.
  void prepare_visible_rows() {
    const int p = shape_.page_size, mask_words = (p + 63) / 64;
    visible_rows_.resize(planned_batch_.size());
    for (std::size_t b = 0; b < planned_batch_.size(); ++b) {
      const detail::sequence_ref& seq = planned_batch_[b];
      const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
      std::vector<std::uint64_t>& visible = visible_rows_[b];
      visible.clear();
      if (geometry_.exact_rows_held(sealed) == 0) continue;
      visible.assign(seq.pages->size() * static_cast<std::size_t>(mask_words), 0);
      for (std::int64_t t = 0; t < sealed; ++t)
        if (!geometry_.exact_position(t, sealed))
          visible[static_cast<std::size_t>(t / p) * mask_words + static_cast<std::size_t>(t % p) / 64] |= std::uint64_t{1} << (t % p % 64);
      if (seq.live != nullptr)
        for (std::size_t w = 0; w < visible.size(); ++w) visible[w] &= seq.live[w];
    }
  }

  /// One (sequence, KV head) of the planned step: its selection (read-less selectors), every page
  /// it reads, the sinks and the tail folded in order, the outputs of its G query heads written.
  template <class Q, class O>
  void attend_head(const tensor_view<const Q, 3>& q, const tensor_view<O, 3>& out, const tensor_view<float, 2>& lse,
                   std::size_t b, int h, attend_scratch& s, std::vector<std::uint64_t>& keep) {
    const detail::selection_request* request = planned_selects_ ? &planned_request_ : nullptr;
    const float softmax_scale = planned_scale_;
    const int groups = shape_.group_size, d = shape_.head_dim, p = shape_.page_size;
    const int mask_words = (p + 63) / 64;
    const detail::sequence_ref& seq = planned_batch_[b];
    const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
    const int tail_rows = static_cast<int>(seq.length - sealed);
    // The exact rows (sinks, recent window) just before the tail rows; their page copies masked.
    const std::int64_t exact = geometry_.exact_rows_held(sealed);
    const std::uint64_t* rows_visible = exact > 0 ? visible_rows_[b].data() : seq.live;  // null: every row
    const auto row = static_cast<std::int64_t>(b);
    if (request != nullptr) {
      detail::head_selection& chosen = last_selection_[b * static_cast<std::size_t>(shape_.num_kv_heads) + h];
      select_tokens(*request, b, seq, q, h, keep, chosen);
      if (rows_visible != nullptr)  // evicted tokens are never read, exact ones from their copies
        for (std::size_t w = 0; w < keep.size(); ++w) keep[w] &= rows_visible[w];
      chosen.tokens_read = tail_rows + exact;
      for (std::size_t i = 0; i < seq.pages->size(); ++i) {
        int tokens = 0;
        for (int w = 0; w < mask_words; ++w) tokens += popcount64(keep[i * mask_words + w]);
        chosen.tokens_read += tokens;
        chosen.pages_read += tokens > 0;
      }
    }
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < d; ++c) s.q_group[g * d + c] = to_float(q(row, h * groups + g, c)) * softmax_scale;
    std::fill(s.o.begin(), s.o.end(), 0.0f);
    std::fill(s.state.begin(), s.state.end(), softmax_state<float>{});
    s.record = planned_scores_.use != score_use::none && seq.scores != nullptr;
    if (s.record) {
      s.read_positions.clear();
      s.read_logits.clear();
      s.block_positions.resize(static_cast<std::size_t>(scratch_rows()));
    }
    const auto page_positions = [&](std::size_t i) {  // the logical positions of page i's rows
      if (!s.record) return;
      for (int t = 0; t < p; ++t) {
        const std::size_t slot = i * static_cast<std::size_t>(p) + static_cast<std::size_t>(t);
        s.block_positions[static_cast<std::size_t>(t)] = seq.positions != nullptr ? seq.positions[slot] : static_cast<std::int64_t>(slot);
      }
    };
    const page_shape shape = shape_.page();
    const auto keep_of = [&](std::size_t i) -> const std::uint64_t* {
      return request != nullptr ? keep.data() + i * mask_words : rows_visible != nullptr ? rows_visible + i * mask_words : nullptr;
    };
    const auto skipped = [&](const std::uint64_t* page_keep) {
      return page_keep != nullptr && std::all_of(page_keep, page_keep + mask_words, [](std::uint64_t w) { return w == 0; });
    };
    if constexpr (has_segments_v<Format>) {
      // Per segment: the queries rotated in, its pages folded into a state of its own in the
      // segment's space, the output rotated back and merged (PackedAttention, once per segment).
      const std::size_t per = static_cast<std::size_t>(traits::segment_pages(format_, shape));
      const int kept = traits::basis_dim(format_, shape);
      for (std::size_t first = 0; first < seq.pages->size(); first += per) {
        const std::size_t last = std::min(seq.pages->size(), first + per);
        const segment_t& seg = segment(seq.slot, static_cast<std::int64_t>(first), h);
        traits::enter_segment(format_, shape, seg, s.q_group.data(), groups, s.q_basis.data());
        std::fill(s.o_segment.begin(), s.o_segment.end(), 0.0f);
        std::fill(s.segment_state.begin(), s.segment_state.end(), softmax_state<float>{});
        for (std::size_t i = first; i < last; ++i) {
          const page_id page = (*seq.pages)[i];
          const std::uint64_t* page_keep = keep_of(i);
          if (skipped(page_keep)) continue;
          page_positions(i);
          fold_block(
              p, kept, s, s.segment_state, s.o_segment,
              [&](float* logits) { traits::score(format_, shape, seg, k_page(page, h), p, s.q_basis.data(), groups, logits); },
              [&](const float* probabilities, float* o) {
                traits::accumulate(format_, shape, seg, v_page(page, h), p, probabilities, groups, o);
              },
              0, page_keep);
        }
        traits::leave_segment(format_, shape, seg, s.o_segment.data(), groups, s.o_block.data());
        for (int g = 0; g < groups; ++g) {
          if (!(s.segment_state[static_cast<std::size_t>(g)].l > 0)) continue;  // nothing of this head read
          float* o_g = s.o.data() + static_cast<std::size_t>(g) * d;
          merge_into(s.state[static_cast<std::size_t>(g)], o_g, s.segment_state[static_cast<std::size_t>(g)],
                     s.o_block.data() + static_cast<std::size_t>(g) * d, d);
        }
      }
    } else {
      for (std::size_t i = 0; i < seq.pages->size(); ++i) {
        const page_id page = (*seq.pages)[i];
        const std::uint64_t* page_keep = keep_of(i);
        if (skipped(page_keep)) continue;
        page_positions(i);
        fold_block<traits>(format_, shape, k_page(page, h), v_page(page, h), p, s, 0, page_keep);
      }
    }
    if (exact + tail_rows > 0) {  // one run of dense rows: the exact rows, then the tail
      if (s.record) {
        geometry_.exact_run_positions(sealed, s.block_positions.data());
        const std::int64_t tail_from = seq.tail_position >= 0 ? seq.tail_position : sealed;
        for (int r = 0; r < tail_rows; ++r) s.block_positions[static_cast<std::size_t>(exact + r)] = tail_from + r;
      }
      const std::size_t back = static_cast<std::size_t>(exact) * geometry_.row_bytes;
      fold_block<dense_traits>(format::dense{}, shape, tail_head(seq.slot, false, h) - back,
                               tail_head(seq.slot, true, h) - back, static_cast<int>(exact) + tail_rows, s);
    }
    for (int g = 0; g < groups; ++g) {
      for (int c = 0; c < d; ++c) out(row, h * groups + g, c) = O(s.o[g * d + c] / s.state[g].l);
      if (lse.extent(0) > 0) lse(row, h * groups + g) = s.state[g].log_sum_exp();
    }
    if (s.record) write_scores(seq, h, s);
  }

  /// The scores of the tokens one (sequence, KV head) read this step: per query head j of the
  /// group, p_j = exp(s_j - m_j) / l_j under the step's final (merged) softmax state, combined over
  /// the group, written to (last_step) or added to (cumulative) `seq.scores[position][h]`. Each
  /// (sequence, KV head) writes its own column: no two threads write one element.
  void write_scores(const detail::sequence_ref& seq, int h, const attend_scratch& s) const {
    const int groups = shape_.group_size, heads = shape_.num_kv_heads;
    for (std::size_t i = 0; i < s.read_positions.size(); ++i) {
      float combined = 0.0f;
      for (int g = 0; g < groups; ++g) {
        const softmax_state<float>& state = s.state[static_cast<std::size_t>(g)];
        const float logit = s.read_logits[i * static_cast<std::size_t>(groups) + static_cast<std::size_t>(g)];
        const float p = state.l > 0.0f ? std::exp(logit - state.m) / state.l : 0.0f;
        combined = planned_scores_.combine == group_combine::sum ? combined + p : std::max(combined, p);
      }
      float& slot = seq.scores[static_cast<std::size_t>(s.read_positions[i]) * static_cast<std::size_t>(heads) +
                               static_cast<std::size_t>(h)];
      slot = planned_scores_.use == score_use::cumulative ? slot + combined : combined;
    }
  }

  /// Folds one block of n tokens (a page or the tail) into the running states: logits on the
  /// stored form, a block-local softmax, p.v on the stored form, then the (m, l, o) merge. The
  /// first `masked` tokens (sinks, attended as dense rows instead) get p = 0, and so do the tokens
  /// whose bit in `keep` (a token mask, null: all) is clear. Heads are independent: a head with no
  /// token left (every logit -inf) folds nothing, and a block with no token left for any head is
  /// skipped.
  template <class Traits, class F>
  static void fold_block(const F& format, const page_shape& shape, const std::byte* k, const std::byte* v, int n,
                         attend_scratch& s, int masked = 0, const std::uint64_t* keep = nullptr) {
    const int groups = static_cast<int>(s.state.size());
    fold_block(
        n, shape.head_dim, s, s.state, s.o,
        [&](float* logits) { Traits::score(format, shape, k, n, s.q_group.data(), groups, logits); },
        [&](const float* probabilities, float* o) { Traits::accumulate(format, shape, v, n, probabilities, groups, o); }, masked,
        keep);
  }
  /// The same, with the primitives given: score(logits [G][n]) and accumulate(p [G][n],
  /// o [G][d] +=), folded into `state` and `o` ([G][d]).
  template <class Score, class Accumulate>
  static void fold_block(int n, int d, attend_scratch& s, std::vector<softmax_state<float>>& state, std::vector<float>& o,
                         Score&& score, Accumulate&& accumulate, int masked = 0, const std::uint64_t* keep = nullptr) {
    const int groups = static_cast<int>(state.size());
    constexpr float minus_infinity = -std::numeric_limits<float>::infinity();
    bool any = false;
    score(s.logits.data());
    if (s.record)  // the logits of the tokens this block reads, before the softmax overwrites them
      for (int t = masked; t < n; ++t) {
        if (keep != nullptr && ((keep[t / 64] >> (t % 64)) & 1) == 0) continue;
        s.read_positions.push_back(s.block_positions[static_cast<std::size_t>(t)]);
        for (int g = 0; g < groups; ++g) s.read_logits.push_back(s.logits[static_cast<std::size_t>(g) * n + t]);
      }
    for (int g = 0; g < groups; ++g) {
      float* row = s.logits.data() + static_cast<std::size_t>(g) * n;
      std::fill(row, row + masked, minus_infinity);
      if (keep != nullptr)
        for (int t = masked; t < n; ++t)
          if (((keep[t / 64] >> (t % 64)) & 1) == 0) row[t] = minus_infinity;
      float m = row[0];
      for (int t = 1; t < n; ++t) m = std::max(m, row[t]);
      s.block[g].m = m;
      if (m == minus_infinity) {  // nothing of this head to fold (masked, or logits below fp32)
        std::fill(row, row + n, 0.0f);
        s.block[g].l = 0.0f;
        continue;
      }
      float l = 0;
      for (int t = 0; t < n; ++t) l += (row[t] = std::exp(row[t] - m));
      s.block[g].l = l;
      any = true;
    }
    if (!any) return;  // no head has a token left: nothing to fold
    std::fill(s.o_block.begin(), s.o_block.begin() + static_cast<std::ptrdiff_t>(groups) * d, 0.0f);
    accumulate(s.logits.data(), s.o_block.data());
    for (int g = 0; g < groups; ++g) {
      float* o_g = o.data() + static_cast<std::size_t>(g) * d;
      merge_into(state[static_cast<std::size_t>(g)], o_g, s.block[static_cast<std::size_t>(g)], s.o_block.data() + static_cast<std::size_t>(g) * d, d);
    }
  }

  static int popcount64(std::uint64_t x) noexcept {
    int n = 0;
    for (; x != 0; x &= x - 1) ++n;
    return n;
  }

  /// A read-less step for one (sequence, KV head): scores the spans (the page blocks, or the
  /// sequence's chunks), picks them within the budget (`detail::budget_prefix`) and marks the page
  /// tokens the step reads in `keep` ([page][mask word]): the selected spans' tokens and every
  /// token from `always_from` on. The tail and sink rows are read besides.
  template <class Q>
  void select_tokens(const detail::selection_request& r, std::size_t b, const detail::sequence_ref& seq,
                     const tensor_view<const Q, 3>& q, int h, std::vector<std::uint64_t>& keep,
                     detail::head_selection& chosen) const {
    const int p = shape_.page_size, d = shape_.head_dim, groups = shape_.group_size;
    const std::size_t mask_words = static_cast<std::size_t>(p + 63) / 64;
    const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
    keep.assign(seq.pages->size() * mask_words, 0);
    std::vector<std::int64_t> begin;
    std::vector<const std::byte*> bounds;
    std::vector<std::int32_t> length;
    if (r.block_tokens > 0) {
      for (std::size_t i = 0; i < seq.pages->size(); ++i)
        for (int j = 0; j < bounds_geometry_.blocks_per_page; ++j) {
          begin.push_back(static_cast<std::int64_t>(i) * p + static_cast<std::int64_t>(j) * r.block_tokens);
          length.push_back(r.block_tokens);
          bounds.push_back(page_bounds((*seq.pages)[i], h, j));
        }
    } else {
      const detail::chunk_list& c = r.chunks[b];
      for (std::int32_t i = 0; i < c.count; ++i) {
        begin.push_back(c.starts[i]);
        length.push_back(static_cast<std::int32_t>(c.starts[i + 1] - c.starts[i]));
        bounds.push_back(reinterpret_cast<const std::byte*>(
            c.bounds + (static_cast<std::size_t>(i) * shape_.num_kv_heads + h) * 2 * static_cast<std::size_t>(d)));
      }
    }
    // Spans inside the recent window are read from its exact rows anyway: no candidates (spans
    // come in token order, so they are a suffix).
    if (b < r.candidates_before.size()) {
      std::size_t count = 0;
      while (count < begin.size() && begin[count] < r.candidates_before[b]) ++count;
      begin.resize(count);
      length.resize(count);
      bounds.resize(count);
    }
    std::vector<float> scores(begin.size()), head_scores(static_cast<std::size_t>(groups)), lo_hi(2 * static_cast<std::size_t>(d));
    std::vector<float> queries(static_cast<std::size_t>(groups) * d);  // unscaled: the order is what counts
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < d; ++c) queries[static_cast<std::size_t>(g) * d + c] = to_float(q(static_cast<std::int64_t>(b), h * groups + g, c));
    // Page blocks keep the selector's summary (a mean row is scored as lo = hi = mean), or the
    // format's block keys, scored with the queries in each page's segment; chunks keep bounds.
    if constexpr (has_block_keys_v<Format>) {
      if (r.block_tokens > 0 && bounds_geometry_.format_keys) {
        std::vector<float> q_key;
        std::int64_t key_segment = -1;
        const int per = traits::segment_pages(format_, shape_.page());
        for (std::size_t i = 0; i < begin.size(); ++i) {
          const std::int64_t index = begin[i] / p;
          if (index / per != key_segment) {  // spans come in token order: one query per segment
            const segment_t& seg = segment(seq.slot, index, h);
            key_segment = index / per;
            q_key.resize(static_cast<std::size_t>(groups) * seg.kept);
            traits::block_key_query(format_, shape_.page(), seg, queries.data(), groups, q_key.data());
          }
          const std::size_t kept = q_key.size() / static_cast<std::size_t>(groups);
          for (int g = 0; g < groups; ++g)
            head_scores[static_cast<std::size_t>(g)] = traits::score_block_key(format_, shape_.page(), q_key.data() + g * kept, bounds[i]);
          scores[i] = detail::combine_scores(head_scores.data(), groups, r.combine);
        }
      }
    }
    const int rows = r.block_tokens > 0 ? bounds_geometry_.rows_per_block : 2;
    for (std::size_t i = 0; i < begin.size() && !(r.block_tokens > 0 && bounds_geometry_.format_keys); ++i) {
      dense_traits::decode_k(format::dense{}, page_shape{rows, d, shape_.storage}, bounds[i], rows, lo_hi.data());
      for (int g = 0; g < groups; ++g)
        head_scores[static_cast<std::size_t>(g)] = detail::span_score(queries.data() + static_cast<std::size_t>(g) * d, d, [&](int c) {
          return std::make_pair(lo_hi[static_cast<std::size_t>(c)], lo_hi[static_cast<std::size_t>((rows - 1) * d + c)]);
        });
      scores[i] = detail::combine_scores(head_scores.data(), groups, r.combine);
    }
    const auto mark = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t t = std::max<std::int64_t>(from, 0); t < std::min(to, sealed); ++t)
        keep[static_cast<std::size_t>(t / p) * mask_words + static_cast<std::size_t>(t % p) / 64] |= std::uint64_t{1} << (t % p % 64);
    };
    for (const std::int32_t i : detail::budget_prefix(scores, length, r.budget[b])) {
      const std::int64_t from = begin[static_cast<std::size_t>(i)], to = from + length[static_cast<std::size_t>(i)];
      mark(from, to);
      chosen.tokens_selected += to - from;
      if (!chosen.selected.empty() && chosen.selected.back().second == from)
        chosen.selected.back().second = to;
      else
        chosen.selected.emplace_back(from, to);
    }
    mark(r.always_from[b], sealed);
  }

  std::byte* tail_slot(std::int32_t slot) const {
    return tails_.data() + static_cast<std::size_t>(slot) * geometry_.tail_slot_bytes();
  }
  /// Keeps the exact rows and the first `rows` tail rows of `slot` (every head, K and V) for
  /// `rollback`.
  /// A batch's appends may save several slots; each is restored by `rollback`.
  void save_tail(std::int32_t slot, int rows) {
    const std::size_t bytes = (geometry_.exact_rows + static_cast<std::size_t>(rows)) * geometry_.row_bytes;
    const std::size_t first = saved_tail_.size();
    saved_.reserve(saved_.size() + 1);
    saved_tail_.resize(first + 2 * static_cast<std::size_t>(shape_.num_kv_heads) * bytes);
    std::size_t at = first;
    for (int h = 0; h < shape_.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        std::memcpy(saved_tail_.data() + at, tail_slot(slot) + geometry_.tail_offset(is_v, h), bytes);
        at += bytes;
      }
    saved_.push_back(saved_rows{slot, rows, first});
  }
  /// Tail row 0 of one head of a slot (K or V); the exact rows precede it.
  std::byte* tail_head(std::int32_t slot, bool is_v, int head) const {
    return tail_slot(slot) + geometry_.tail_offset(is_v, head) + geometry_.tail_row_offset();
  }
  /// Before the first page of a segment (page `index`, a multiple of `segment_pages`) is sealed:
  /// fits the segment of every KV head (`detail::plan_segments`) to the full tail and this call's
  /// rows from `next` on; the slot's later segments are dropped (they belonged to a removed or
  /// rolled-back sequence).
  template <class T>
  void plan_segment_at(std::int32_t slot, std::int64_t index, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v,
                       std::int64_t next) {
    const int per = traits::segment_pages(format_, shape_.page());
    if (index % per != 0) return;
    std::vector<segment_t> planned = detail::plan_segments(format_, shape_, geometry_, tail_slot(slot), index, k, v, next);
    std::vector<segment_t>& list = segments_[static_cast<std::size_t>(slot)];
    list.resize(static_cast<std::size_t>(index / per) * shape_.num_kv_heads);
    list.insert(list.end(), std::make_move_iterator(planned.begin()), std::make_move_iterator(planned.end()));
  }

  /// Encodes a full tail into `page`, the sequence's page number `index`, with the format's
  /// encoder (reading the tail's exact values). The exact rows are copied first: the sinks (page
  /// 0) and the tokens among the last W sealed once this page is (the window ring); they are
  /// masked in the page. A format that hides its sinks (`detail::hides_sink_rows`) has them
  /// replaced by the first row after them in what the encoder sees.
  void seal_tail(std::int32_t slot, page_id page, std::int64_t index) {
    const page_shape shape = shape_.page();
    const int p = shape_.page_size;
    const int sinks = index == 0 ? static_cast<int>(geometry_.sink_rows) : 0;
    std::vector<float> rows(static_cast<std::size_t>(p) * shape_.head_dim);
    const auto hide_sinks = [&] {
      if constexpr (detail::hides_sink_rows_v<Format>)
        for (int t = 0; t < sinks; ++t)
          std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(sinks) * shape_.head_dim, shape_.head_dim,
                      rows.begin() + static_cast<std::ptrdiff_t>(t) * shape_.head_dim);
    };
    if (geometry_.exact_rows > 0) {
      const std::int64_t first = index * p, sealed = first + p;
      for (int r = 0; r < p; ++r) {
        const std::int64_t t = first + r;
        if (!geometry_.exact_position(t, sealed)) continue;
        for (int h = 0; h < shape_.num_kv_heads; ++h)
          for (const bool is_v : {false, true}) {
            std::byte* head = tail_slot(slot) + geometry_.tail_offset(is_v, h);
            std::memcpy(head + geometry_.exact_row_of(t) * geometry_.row_bytes, tail_head(slot, is_v, h) + r * geometry_.row_bytes,
                        geometry_.row_bytes);
          }
      }
    }
    std::byte* base = pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes();
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      dense_traits::decode_k(format::dense{}, shape, tail_head(slot, false, h), shape_.page_size, rows.data());
      for (int block = 0; block < bounds_geometry_.blocks_per_page; ++block)
        store_block(slot, index, page, h, block,
                    rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * shape_.head_dim);
      hide_sinks();
      if constexpr (has_segments_v<Format>) {
        traits::encode_k(format_, shape, segment(slot, index, h), rows.data(), base + geometry_.k_page_offset(h));
      } else if constexpr (has_key_weights_v<Format>) {
        const std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
        traits::encode_k(format_, shape, rows.data(), w.empty() ? nullptr : w.data() + h * shape_.head_dim,
                         base + geometry_.k_page_offset(h));
      } else {
        traits::encode_k(format_, shape, rows.data(), base + geometry_.k_page_offset(h));
      }
      dense_traits::decode_v(format::dense{}, shape, tail_head(slot, true, h), shape_.page_size, rows.data());
      hide_sinks();
      if constexpr (has_segments_v<Format>) traits::encode_v(format_, shape, segment(slot, index, h), rows.data(), base + geometry_.v_page_offset(h));
      else traits::encode_v(format_, shape, rows.data(), base + geometry_.v_page_offset(h));
    }
  }

  /// Bytes of the format's block key when `Selector` keeps mean keys and the format has block
  /// keys; 0 (dense summary rows) otherwise.
  template <class Selector>
  static std::size_t block_key_bytes_for(const Format& format, const detail::engine_shape& shape) {
    if constexpr (has_block_keys_v<Format>)
      if (detail::block_summary_of<Selector>::value == block_summary::mean) return traits::block_key_bytes(format, shape.page());
    return 0;
  }
  /// The summary of one block of `n` exact rows of head `h` of page `index` of the sequence in
  /// `slot` (page `page` of the pool): the selector's dense rows, or the format's block key of the
  /// rows' fp32 mean in the page's segment.
  void store_block(std::int32_t slot, std::int64_t index, page_id page, int h, int block, const float* rows) {
    std::byte* out = bounds_.data() + bounds_geometry_.offset(page, h, block);
    if constexpr (has_block_keys_v<Format>) {
      if (bounds_geometry_.format_keys) {
        std::vector<float> mean(static_cast<std::size_t>(shape_.head_dim));
        detail::mean_key(rows, bounds_geometry_.block_tokens, shape_.head_dim, mean.data());
        traits::encode_block_key(format_, shape_.page(), segment(slot, index, h), mean.data(), out);
        return;
      }
    }
    detail::store_block_summary(bounds_geometry_.summary, shape_.storage, rows, bounds_geometry_.block_tokens, shape_.head_dim, out);
  }

  detail::engine_shape shape_;
  Format format_;
  detail::arena_geometry geometry_;
  detail::bounds_geometry bounds_geometry_;
  detail::host_buffer pages_;
  detail::host_buffer tails_;
  detail::host_buffer bounds_;  ///< key bounds per page block (read-less selectors), else empty
  std::vector<detail::head_selection> last_selection_;
  std::vector<detail::sequence_ref> planned_batch_;  ///< the planned step (`plan`, then `run`)
  std::vector<std::vector<std::uint64_t>> visible_rows_;  ///< per planned sequence: `prepare_visible_rows`
  detail::selection_request planned_request_;
  float planned_scale_ = 1.0f;
  bool planned_selects_ = false;
  score_settings planned_scores_;
  /// Rows kept for `rollback`: per saved slot, its exact rows and `rows` tail rows at `at`.
  struct saved_rows {
    std::int32_t slot;
    int rows;
    std::size_t at;
  };
  std::vector<saved_rows> saved_;
  std::vector<std::byte> saved_tail_;
  /// Per tail slot: the segments of its sequence, [segment * num_kv_heads + head] (formats with
  /// segments; empty otherwise).
  std::vector<std::vector<segment_t>> segments_ = std::vector<std::vector<segment_t>>(static_cast<std::size_t>(shape_.max_sequences));
  /// Per tail slot: output-aware K weights [num_kv_heads][head_dim], empty for magnitudes.
  std::vector<std::vector<float>> key_weights_ = std::vector<std::vector<float>>(static_cast<std::size_t>(shape_.max_sequences));
};

}  // namespace host

namespace detail {
template <class Format, class Selector>
struct engine_for<backend::host, Format, Selector> {
  using type = host::engine<Format>;
};
}  // namespace detail
}  // namespace kvmosaic
// ---- end <kvmosaic/host/backend.hpp> ----

// ---- begin <kvmosaic/host/exact.hpp> ----
/// \file
/// The test oracle: exact decode attention in fp64, independent of every format, page and kernel,
/// and the fidelity numbers every part reports against it (relative L2 error and cosine).
///
/// For query head j of KV head h = j / group_size: out_j = sum_t softmax_t(scale * q_j . k_t,h) v_t,h,
/// computed two-pass (max, then exp-sum) in double. Cost: 2 * tokens * Hq * D multiply-adds.



namespace kvmosaic::host {

/// Exact attention of one query token over all tokens of one sequence.
///   q   [num_q_heads][head_dim]
///   k,v [tokens][num_kv_heads][head_dim]  (float, half or bfloat16; widened exactly to double)
/// Returns out [num_q_heads][head_dim] in double. num_q_heads must be num_kv_heads * group_size.
template <class QT, class KVT>
std::vector<double> exact_attention(tensor_view<const QT, 2> q, tensor_view<const KVT, 3> k,
                                    tensor_view<const KVT, 3> v, double softmax_scale) {
  const std::int64_t tokens = k.extent(0), kv_heads = k.extent(1), head_dim = k.extent(2);
  const std::int64_t q_heads = q.extent(0);
  detail::require(tokens >= 1, "exact_attention", "k.extent(0) (tokens)", tokens, ">= 1");
  detail::require(q.extent(1) == head_dim, "exact_attention", "q.extent(1) (head_dim)", q.extent(1),
                  "k.extent(2)");
  detail::require(v.extent(0) == tokens && v.extent(1) == kv_heads && v.extent(2) == head_dim, "exact_attention",
                  "v.extents", "mismatch", "the extents of k");
  detail::require(kv_heads >= 1 && q_heads % kv_heads == 0, "exact_attention", "q.extent(0) (query heads)",
                  q_heads, "a multiple of k.extent(1)");
  const std::int64_t group = q_heads / kv_heads;

  std::vector<double> out(static_cast<std::size_t>(q_heads * head_dim), 0.0);
  std::vector<double> logits(static_cast<std::size_t>(tokens));
  for (std::int64_t j = 0; j < q_heads; ++j) {
    const std::int64_t h = j / group;
    double max_logit = -HUGE_VAL;
    for (std::int64_t t = 0; t < tokens; ++t) {
      double dot = 0.0;
      for (std::int64_t c = 0; c < head_dim; ++c)
        dot += static_cast<double>(to_float(q(j, c))) * static_cast<double>(to_float(k(t, h, c)));
      logits[static_cast<std::size_t>(t)] = dot * softmax_scale;
      max_logit = std::max(max_logit, logits[static_cast<std::size_t>(t)]);
    }
    double sum = 0.0;
    double* o = out.data() + j * head_dim;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const double p = std::exp(logits[static_cast<std::size_t>(t)] - max_logit);
      sum += p;
      for (std::int64_t c = 0; c < head_dim; ++c) o[c] += p * static_cast<double>(to_float(v(t, h, c)));
    }
    for (std::int64_t c = 0; c < head_dim; ++c) o[c] /= sum;
  }
  return out;
}

/// How close an attention output is to the exact one.
struct fidelity {
  double rel_l2_error = 0;  ///< ||got - exact||_2 / ||exact||_2
  double cosine = 1;        ///< <got, exact> / (||got|| ||exact||)
  double max_abs_error = 0; ///< max_i |got_i - exact_i|
};

/// Compares `count` values of an output with the exact reference.
template <class T>
fidelity compare(const T* got, const double* exact, std::size_t count) {
  double diff2 = 0, exact2 = 0, got2 = 0, dot = 0, max_abs = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double g = static_cast<double>(got[i]), e = exact[i];
    diff2 += (g - e) * (g - e);
    exact2 += e * e;
    got2 += g * g;
    dot += g * e;
    max_abs = std::max(max_abs, std::abs(g - e));
  }
  fidelity f;
  f.rel_l2_error = exact2 > 0 ? std::sqrt(diff2 / exact2) : std::sqrt(diff2);
  f.cosine = (got2 > 0 && exact2 > 0) ? dot / std::sqrt(got2 * exact2) : (got2 == exact2 ? 1.0 : 0.0);
  f.max_abs_error = max_abs;
  return f;
}

}  // namespace kvmosaic::host
// ---- end <kvmosaic/host/exact.hpp> ----

// ---- begin <kvmosaic/cache.hpp> ----
/// \file
/// The composition: `kvmosaic::cache<Format, Selector, Compactor, Backend>`.
///
/// A cache holds the K and V of many sequences for one attention layer: per sequence, a block
/// table of compressed pages of `page_size` tokens (stored by `Format`, in a fixed-size page pool)
/// plus one dense tail of fewer than `page_size` tokens in the storage dtype. When the tail fills
/// it is encoded into a new page. A decode step attends one query token per sequence over the
/// pages `Selector` picks plus the tail; `Compactor` turns evicted tokens into freed pages.
///
/// The cache is the host object of the layering: it owns memory, validates every argument, and
/// keeps the bookkeeping (pool, block tables, lengths, reference counts) on the host for every
/// backend. The backend's engine owns the bytes and the data path (CPU code, or CUDA kernels).
/// Every operation is all or nothing: it checks its arguments and makes its allocations before it
/// changes anything, the engine undoes a write that fails (`rollback`), and the bookkeeping is
/// committed with operations that cannot throw; a call that throws, for bad input, an exhausted
/// pool, an allocation failure or a CUDA error short of a lost context, leaves the cache as it
/// was (docs/architecture.md, "Every call is all or nothing").
///
/// What a new part must provide: see format/format_traits.hpp, select/selector_traits.hpp and
/// compact/compactor_traits.hpp; docs/architecture.md walks through adding one.

#include <bitset>


namespace kvmosaic {

/// Run-time shape and capacity of a cache. Checked by the cache constructor (`validate`).
struct cache_config {
  int num_kv_heads = 8;      ///< KV heads of the layer, >= 1
  int group_size = 4;        ///< query heads per KV head (GQA): 1 to 8
  int head_dim = 128;        ///< 64, 128 or 256
  int page_size = limits::default_page_size;  ///< tokens per page: a multiple of 16, 16 to 1024
  dtype storage = dtype::bf16;                ///< dtype of uncompressed values: f16 or bf16
  std::int32_t max_pages = 1024;              ///< page pool capacity (pages of all KV heads, K and V)
  std::int32_t max_sequences = 64;            ///< concurrent sequences (one dense tail each)

  int num_q_heads() const noexcept { return num_kv_heads * group_size; }

  /// Throws `invalid_argument` naming the first field outside its allowed values.
  void validate() const {
    const char* where = "cache_config";
    detail::require(num_kv_heads >= 1, where, "num_kv_heads", num_kv_heads, ">= 1");
    detail::require(limits::is_supported_group_size(group_size), where, "group_size", group_size,
                    limits::supported_group_sizes);
    detail::require(limits::is_supported_head_dim(head_dim), where, "head_dim", head_dim,
                    limits::supported_head_dims);
    detail::require(limits::is_supported_page_size(page_size), where, "page_size", page_size,
                    limits::supported_page_sizes);
    detail::require(storage == dtype::f16 || storage == dtype::bf16, where, "storage", to_string(storage),
                    "f16 or bf16");
    detail::require(num_kv_heads <= limits::max_kv_heads, where, "num_kv_heads", num_kv_heads,
                    "at most limits::max_kv_heads (1024)");
    detail::require(max_pages >= 1 && max_pages <= limits::max_pool_pages, where, "max_pages", max_pages,
                    "1 to limits::max_pool_pages (2^24)");
    detail::require(max_sequences >= 1 && max_sequences <= limits::max_sequences, where, "max_sequences",
                    max_sequences, "1 to limits::max_sequences (2^20)");
  }
};

/// A compile-time shape: a config whose head_dim, group size and page size are checked by the
/// compiler. Kernels specialized on a shape use the same predicates.
template <int HeadDim, int GroupSize, int PageSize = limits::default_page_size>
struct static_shape {
  static_assert(limits::is_supported_head_dim(HeadDim), "kvmosaic: head_dim must be 64, 128 or 256");
  static_assert(limits::is_supported_group_size(GroupSize), "kvmosaic: group_size must be 1 to 8");
  static_assert(limits::is_supported_page_size(PageSize),
                "kvmosaic: page_size must be a multiple of 16 from 16 to 1024");
  static constexpr int head_dim = HeadDim;
  static constexpr int group_size = GroupSize;
  static constexpr int page_size = PageSize;

  /// A run-time config with this shape.
  static cache_config config(int num_kv_heads, dtype storage = dtype::bf16) {
    cache_config c;
    c.num_kv_heads = num_kv_heads;
    c.group_size = GroupSize;
    c.head_dim = HeadDim;
    c.page_size = PageSize;
    c.storage = storage;
    return c;
  }
};

/// Handle of a sequence in a cache (returned by `add_sequence`). Opaque: it names a sequence slot
/// and the generation of that slot, so a handle kept after `remove_sequence` is rejected with
/// `invalid_argument` instead of addressing the sequence that reuses the slot. A slot's generation
/// wraps after 2^31 / max_sequences removals (2^25 at the default 64 slots); `cache::slot` maps a
/// live handle to its slot, 0 to max_sequences - 1, the index the backends use.
using sequence_id = std::int32_t;

/// Options of one decode step.
struct attend_params {
  /// Multiplies q . k before the softmax. 0 means the default 1 / sqrt(head_dim).
  float softmax_scale = 0.0f;
};

/// Memory in use, in bytes, with every stored byte of the format counted.
struct memory_stats {
  std::int64_t tokens = 0;          ///< tokens stored
  std::int64_t stored_bytes = 0;    ///< pages (whole pages, by the format's accounting) + tail rows
                                    ///< + the exact sink and recent-window rows the tail slot holds
  std::int64_t dense_bytes = 0;     ///< the same tokens as 16-bit K and V rows
  std::int32_t pages_used = 0;      ///< pool pages held
  std::int32_t pages_free = 0;      ///< the free-page gauge

  /// stored_bytes / dense_bytes (DESIGN: all stored bytes over dense 16-bit bytes, same tokens).
  double compression_ratio() const noexcept {
    return dense_bytes > 0 ? static_cast<double>(stored_bytes) / static_cast<double>(dense_bytes) : 1.0;
  }
  double bytes_per_token() const noexcept {
    return tokens > 0 ? static_cast<double>(stored_bytes) / static_cast<double>(tokens) : 0.0;
  }
};

/// What the last decode step of a read-less selector read for one sequence: token and page counts
/// averaged over its KV heads (each KV head selects on its own); reuse over all of them.
struct selection_stats {
  double tokens_selected = 0;  ///< tokens of the selected spans (within the budget)
  double tokens_read = 0;      ///< tokens attended: selected, those the selector always reads,
                               ///< sink rows and tail
  double pages_read = 0;       ///< pages holding at least one attended token (the tail not counted)
  /// Of the previous step's selected tokens (every KV head's), the fraction this step read again
  /// (SentKVCompress's reuse); NaN before a sequence's second selected step.
  double reuse = std::numeric_limits<double>::quiet_NaN();
};

/// A paged, compressed KV cache for one attention layer. See the file comment.
///
/// \tparam Format    how a page is stored (`format::dense`, ...)
/// \tparam Selector  which tokens a query reads (`select::all`, ...)
/// \tparam Compactor how evicted tokens free pages (`compact::none`, ...)
/// \tparam Backend   where pages live and attention runs (`backend::host`, `backend::cuda`)
///
/// The selector takes part through its traits' hooks only (select/selector_traits.hpp): a state
/// per sequence that the cache stages, reserves and commits with each call, the engine's share of
/// its work, its bytes, its part of a step's selection request, and public members it adds
/// (`selector_traits<Selector>::cache_members`, a base of this class).
template <class FormatArg, class SelectorArg = select::all, class CompactorArg = compact::none,
          class BackendArg = backend::host>
class cache
    : public detail::selector_cache_members<SelectorArg, cache<FormatArg, SelectorArg, CompactorArg, BackendArg>>::type {
  static_assert(is_format_v<FormatArg>,
                "kvmosaic::cache: the first template argument (Format) must be a storage format, "
                "e.g. kvmosaic::format::dense");
  static_assert(is_selector_v<SelectorArg>,
                "kvmosaic::cache: the second template argument (Selector) must be a selector, "
                "e.g. kvmosaic::select::all");
  static_assert(is_compactor_v<CompactorArg>,
                "kvmosaic::cache: the third template argument (Compactor) must be a compactor, "
                "e.g. kvmosaic::compact::none");
  static_assert(is_backend_v<BackendArg>,
                "kvmosaic::cache: the fourth template argument (Backend) must be kvmosaic::backend::host "
                "or kvmosaic::backend::cuda");
  static_assert(!detail::is_per_kv_head<SelectorArg>::value,
                "kvmosaic::cache: a cache of select::per_kv_head<S> is declared in kvmosaic/per_kv_head_cache.hpp "
                "(kvmosaic/kvmosaic.hpp includes it)");

  // A policy in the wrong position fails its sentence above; the rest of the class then compiles
  // against a default of that kind, so that sentence is the only error a user reads.
  using Format = std::conditional_t<is_format_v<FormatArg>, FormatArg, format::dense>;
  using Selector = std::conditional_t<is_selector_v<SelectorArg> && !detail::is_per_kv_head<SelectorArg>::value, SelectorArg,
                                      select::all>;
  using Compactor = std::conditional_t<is_compactor_v<CompactorArg>, CompactorArg, compact::none>;
  using Backend = std::conditional_t<is_backend_v<BackendArg>, BackendArg, backend::host>;

  static_assert(!(selector_traits<Selector>::evicts && !compactor_traits<Compactor>::frees_memory),
                "kvmosaic::cache: a selector that evicts tokens needs a compactor that frees memory "
                "(e.g. compact::repack), not compact::none");
  static_assert(!(compactor_traits<Compactor>::frees_memory && detail::keeps_token_ranges<Selector>::value),
                "kvmosaic::cache: this selector's spans are runs of slots (select::sentence_chunks), which a "
                "compaction would move: use it with compact::none");

 public:
  using format_type = Format;
  using selector_type = Selector;
  using compactor_type = Compactor;
  using backend_type = Backend;
  using engine_type = typename detail::engine_for<Backend, Format, Selector>::type;
  static_assert(detail::token_scores_of<Selector>::value == score_use::none || engine_type::records_token_scores,
                "kvmosaic::cache: this selector reads each step's token scores (select::tova, select::h2o), which "
                "this backend's kernels do not write for this format: on backend::cuda use format::dense, "
                "format::bitmap_tiles, format::quant (quant2, quant4) or format::packed_bitmap, or use backend::host");

  explicit cache(const cache_config& config, const Format& format = {}, const Selector& selector = {},
                 const Compactor& compactor = {})
      : config_(validated(config, format, selector)),
        format_(format),
        selector_(selector),
        compactor_(compactor),
        pool_(config.max_pages),
        engine_(engine_shape(config), format, selector),
        sequences_(sequence_slots(config)) {}

  const cache_config& config() const noexcept { return config_; }
  const Format& format() const noexcept { return format_; }
  const Selector& selector() const noexcept { return selector_; }
  const Compactor& compactor() const noexcept { return compactor_; }
  const page_pool& pool() const noexcept { return pool_; }
  const engine_type& engine() const noexcept { return engine_; }
  /// The backend engine (e.g. to set the CUDA stream or capture a decode step in a graph).
  engine_type& engine() noexcept { return engine_; }

  /// "format/selector/compactor" with parameters, for reports.
  std::string describe() const {
    return format_traits<Format>::describe(format_) + "/" + selector_traits<Selector>::describe(selector_) + "/" +
           compactor_traits<Compactor>::describe(compactor_);
  }

  /// Starts an empty sequence. Throws `capacity_error` when max_sequences are live.
  sequence_id add_sequence() {
    const std::int32_t slot = free_slot("cache::add_sequence");
    sequence_state fresh;  // may throw (allocation): nothing changed yet
    if constexpr (has_key_weights_v<Format>) engine_.set_key_weights(slot, nullptr);  // magnitudes
    return activate(slot, std::move(fresh));
  }

  /// Ends a sequence and releases its pages (shared pages stay until their last holder ends). Its
  /// handle, and every copy of it, is invalid from now on.
  void remove_sequence(sequence_id seq) {
    sequence_state& s = live(seq, "cache::remove_sequence");
    const std::int32_t slot = slot_of(seq);
    for (const page_id page : s.pages) pool_.release(page);
    selector_traits<Selector>::template release<rows_on_device>(engine_, slot);
    if constexpr (has_key_weights_v<Format>) engine_.set_key_weights(slot, nullptr);
    const std::uint32_t generation = s.generation + 1 < generations_ ? s.generation + 1 : 0;
    s = sequence_state{};
    s.generation = generation;
  }

  /// A new sequence that shares every full page of `seq` (reference counted, no copy) and holds a
  /// copy of its tail: a common prefix stored once. All or nothing: on failure no slot is taken.
  sequence_id fork_sequence(sequence_id seq) {
    const sequence_state& parent = live(seq, "cache::fork_sequence");
    const std::int32_t from = slot_of(seq);
    const std::int32_t slot = free_slot("cache::fork_sequence");
    sequence_state child;  // copies (may throw): nothing changed yet
    child.pages = parent.pages;
    child.stored = parent.stored;
    child.seen = parent.seen;
    child.slots = parent.slots;
    child.selector_state = parent.selector_state;
    child.budget = parent.budget;
    child.own_budget = parent.own_budget;
    // The child's slot is not live until the end: a failed copy leaves nothing visible.
    write_then_commit({}, [&] {
      engine_.copy_tail(from, slot, tail_rows(parent));
      selector_traits<Selector>::template fork<rows_on_device>(engine_, from, slot);
    });
    for (const page_id page : child.pages) pool_.retain(page);
    return activate(slot, std::move(child));
  }

  /// The slot (0 to max_sequences - 1) of a live sequence: the index a backend's per-sequence
  /// storage (tail, a selector's engine state, `detail::sequence_ref::slot`) uses.
  std::int32_t slot(sequence_id seq) const {
    live(seq, "cache::slot");
    return slot_of(seq);
  }

  /// Output-aware K pruning (MUSTAFAR section 2.1), for formats with `has_key_weights_v`: K pages
  /// of `seq` sealed from now on keep, per token, the elements of largest |k_c| * weights(h, c)
  /// instead of largest |k_c|. `weights` is [num_kv_heads][head_dim] in host memory, e.g.
  /// `output_aware_key_weights` of the latest window of queries; an empty view (extent 0) goes
  /// back to magnitudes. Pages already sealed keep their pruning; forks inherit the weights.
  void set_key_weights(sequence_id seq, tensor_view<const float, 2> weights) {
    static_assert(has_key_weights_v<Format>,
                  "kvmosaic::cache::set_key_weights: this format does not prune K with channel weights "
                  "(format::bitmap_tiles does)");
    live(seq, "cache::set_key_weights");
    if (weights.extent(0) == 0) {
      engine_.set_key_weights(slot_of(seq), nullptr);
      return;
    }
    detail::require(weights.extent(0) == config_.num_kv_heads && weights.extent(1) == config_.head_dim,
                    "cache::set_key_weights", "weights shape", std::to_string(weights.extent(0)) + "x" +
                    std::to_string(weights.extent(1)), "num_kv_heads x head_dim");
    check_view("cache::set_key_weights", "weights", weights);
    std::vector<float> dense(static_cast<std::size_t>(weights.extent(0) * weights.extent(1)));
    for (std::int64_t h = 0; h < weights.extent(0); ++h)
      for (std::int64_t c = 0; c < weights.extent(1); ++c) {
        const float w = weights(h, c);
        detail::require(std::isfinite(w) && w >= 0.0f, "cache::set_key_weights", "weights", w,
                        "finite and >= 0 (sums of |q|)");
        dense[static_cast<std::size_t>(h * weights.extent(1) + c)] = w;
      }
    engine_.set_key_weights(slot_of(seq), dense.data());
  }

  /// Appends the tokens of `k` and `v` ([tokens][num_kv_heads][head_dim], float, half or bfloat16,
  /// any strides; on backend::cuda device memory whose head_dim elements are contiguous, and
  /// contiguous arrays for a format with segments; values are rounded to the storage dtype,
  /// finite values beyond its range saturated to its largest finite value, infinities and NaN
  /// kept) to one sequence: a prefill, or a piece of one
  /// of any size (pieces store exactly what one prefill of the same tokens stores). Full pages are
  /// encoded by the format; the rest stays in the dense tail. All or nothing: when the pool lacks
  /// the pages, it throws `capacity_error` and nothing is stored. NaN input gives unspecified
  /// outputs for the heads that read it, never undefined behaviour.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    static_assert(!selector_traits<Selector>::needs_token_ids,
                  "kvmosaic::cache::prefill: this selector cuts the stream at boundary tokens: pass the token "
                  "ids, prefill(seq, k, v, token_ids)");
    prefill_rows(seq, k, v, span<const std::int32_t>{});
  }
  /// `prefill` with the tokens' ids (`token_ids.size() == k.extent(0)`, host memory), which
  /// selectors with `selector_traits::needs_token_ids` read; other selectors ignore them.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == k.extent(0), "cache::prefill", "token_ids.size()", token_ids.size(),
                    "k.extent(0) (one id per token)");
    check_view("cache::prefill", "token_ids", token_ids);
    prefill_rows(seq, k, v, token_ids);
  }

 private:
  // All or nothing: everything that can fail (checks, allocations, the selector's staged update)
  // happens before the backend writes; the backend's write is undone if it fails (the
  // tail rows it may have overwritten are restored, its fresh pages go back to the pool); the
  // bookkeeping is then committed with operations that cannot throw.
  template <class T>
  void prefill_rows(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    sequence_state& s = live(seq, "cache::prefill");
    const std::int32_t slot = slot_of(seq);
    check_rows("cache::prefill", k, v);
    detail::require(k.extent(0) >= 1, "cache::prefill", "k.extent(0) (tokens)", k.extent(0), ">= 1");
    const int tail = tail_rows(s);
    const std::int64_t rows = k.extent(0), page = config_.page_size;
    // Pages the rows complete, without overflow for any row count (a count the pool cannot hold
    // is a capacity_error below).
    const std::int64_t completed = rows / page + (tail + rows % page) / page;
    const std::vector<page_id> fresh = pool_.allocate(completed);
    using traits = selector_traits<Selector>;
    typename traits::update staged;
    write_then_commit(fresh, [&] {
      staged = traits::template stage<rows_on_device>(selector_, selector_shape_of(), s.selector_state, k, token_ids, 0, rows);
      traits::reserve(s.selector_state, staged);
      s.pages.reserve(s.pages.size() + fresh.size());
      if constexpr (evicts_tokens) s.slots.reserve(s.pages.size() + fresh.size(), config_.page_size);
      engine_.extend(slot, tail, k, v, fresh.data(), static_cast<std::int64_t>(s.pages.size()));
      traits::template write<rows_on_device>(engine_, slot, staged, k, 0, rows);
    });
    s.pages.insert(s.pages.end(), fresh.begin(), fresh.end());  // within the reserved capacity
    if constexpr (evicts_tokens) s.slots.seal(fresh.size(), s.seen - tail, config_.page_size);  // reserved
    s.stored += rows;
    s.seen += rows;
    traits::commit(s.selector_state, staged);
    after_write(span<const sequence_id>(&seq, 1), rows);
  }

 public:

  /// Appends one token to each sequence of a decode batch: `k`, `v` are [batch][num_kv_heads]
  /// [head_dim], row b for `seqs[b]`. Sequences must be distinct. All or nothing, as prefill.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    static_assert(!selector_traits<Selector>::needs_token_ids,
                  "kvmosaic::cache::append: this selector cuts the stream at boundary tokens: pass the token "
                  "ids, append(seqs, k, v, token_ids)");
    append_rows(seqs, k, v, span<const std::int32_t>{});
  }
  /// `append` with each new token's id (`token_ids.size() == seqs.size()`); see `prefill`.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == seqs.size(), "cache::append", "token_ids.size()", token_ids.size(),
                    "seqs.size() (one id per sequence)");
    check_view("cache::append", "token_ids", token_ids);
    append_rows(seqs, k, v, token_ids);
  }

 private:
  template <class T>
  void append_rows(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                   span<const std::int32_t> token_ids) {
    check_view("cache::append", "seqs", seqs);
    check_rows("cache::append", k, v);
    detail::require(k.extent(0) == seqs.size(), "cache::append", "k.extent(0) (batch)", k.extent(0),
                    "seqs.size()");
    std::int64_t pages_needed = 0;
    std::vector<bool> seen(sequences_.size(), false);
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const sequence_state& s = live(seqs(b), "cache::append");
      const auto slot = static_cast<std::size_t>(slot_of(seqs(b)));
      detail::require(!seen[slot], "cache::append", "seqs", seqs(b),
                      "distinct sequence ids (one token per sequence per call)");
      seen[slot] = true;
      pages_needed += tail_rows(s) + 1 == config_.page_size;
    }
    // Staging (may throw; nothing changed yet): the selector's updates, room for the new pages.
    using traits = selector_traits<Selector>;
    std::vector<typename traits::update> staged(static_cast<std::size_t>(seqs.size()));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = state_of(seqs(b));
      staged[static_cast<std::size_t>(b)] =
          traits::template stage<rows_on_device>(selector_, selector_shape_of(), s.selector_state, k, token_ids, b, 1);
      traits::reserve(s.selector_state, staged[static_cast<std::size_t>(b)]);
      if (tail_rows(s) + 1 == config_.page_size) {
        s.pages.reserve(s.pages.size() + 1);
        if constexpr (evicts_tokens) s.slots.reserve(s.pages.size() + 1, config_.page_size);
      }
    }
    std::vector<detail::append_item> items;
    items.reserve(static_cast<std::size_t>(seqs.size()));
    const std::vector<page_id> fresh = pool_.allocate(pages_needed);
    auto next = fresh.begin();
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const sequence_state& s = state_of(seqs(b));
      const int tail = tail_rows(s);
      items.push_back(detail::append_item{slot_of(seqs(b)), tail, tail + 1 == config_.page_size ? *next++ : -1,
                                          static_cast<std::int64_t>(s.pages.size())});
    }
    write_then_commit(fresh, [&] {
      engine_.append(items, k, v);
      for (std::int64_t b = 0; b < seqs.size(); ++b)
        traits::template write<rows_on_device>(engine_, slot_of(seqs(b)), staged[static_cast<std::size_t>(b)], k, b, 1);
    });
    for (std::int64_t b = 0; b < seqs.size(); ++b) {  // cannot throw: capacities reserved above
      sequence_state& s = state_of(seqs(b));
      if (items[static_cast<std::size_t>(b)].new_page >= 0) {
        s.pages.push_back(items[static_cast<std::size_t>(b)].new_page);
        if constexpr (evicts_tokens) s.slots.seal(1, s.seen - (config_.page_size - 1), config_.page_size);
      }
      ++s.stored;
      ++s.seen;
      traits::commit(s.selector_state, staged[static_cast<std::size_t>(b)]);
    }
    after_write(seqs, 1);
  }

 public:

  /// One decode step: `plan(seqs, params)`, then `run(q, out)`. out[b] = attention of query q[b]
  /// ([num_q_heads][head_dim]) over the tokens of `seqs[b]` that the selector picks (all of them
  /// for `select::all`); query head j reads KV head j / group_size. q and out: float, half or
  /// bfloat16, any strides (host memory on backend::host, device memory on backend::cuda).
  template <class Q, class O>
  void attend(span<const sequence_id> seqs, tensor_view<Q, 3> q, tensor_view<O, 3> out, const attend_params& params = {}) {
    plan(seqs, params);
    run(q, out);
  }

  /// The host half of a decode step (FlashInfer's plan, CUTLASS's initialize): checks `seqs`,
  /// makes the split plan and the selector's request, and stages them; `run` executes the latest
  /// plan. Cost: O(batch + pages of the batch) on the host; on backend::cuda it writes page-locked
  /// staging and waits only for the previous step's copy out of it, never for kernels. A plan
  /// stays valid until the next call that changes the cache (append, prefill, fork, remove).
  void plan(span<const sequence_id> seqs, const attend_params& params = {}) {
    const char* where = "cache::plan";
    detail::require(params.softmax_scale >= 0.0f && std::isfinite(params.softmax_scale), where,
                    "params.softmax_scale", params.softmax_scale, "a finite value >= 0 (0: 1/sqrt(head_dim))");
    check_view(where, "seqs", seqs);
    std::vector<detail::sequence_ref> batch;
    batch.reserve(static_cast<std::size_t>(seqs.size()));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = live(seqs(b), where);
      detail::require(s.stored >= 1, where, "seqs (an empty sequence)", seqs(b),
                      "sequences holding at least one token");
      const std::uint64_t* live_rows = nullptr;
      if constexpr (evicts_tokens) live_rows = s.slots.dead > 0 ? s.slots.live.data() : nullptr;
      batch.push_back(detail::sequence_ref{&s.pages, s.stored, slot_of(seqs(b)), live_rows});
      if constexpr (records_scores) {  // the step writes each read token's score, by logical position
        if constexpr (rows_on_device) upload_positions(s, slot_of(seqs(b)));
        detail::sequence_ref& ref = batch.back();
        ref.scores = selector_traits<Selector>::scores(state_of(seqs(b)).selector_state).values.data();
        ref.positions = s.slots.position.data();
        ref.tail_position = s.seen - tail_rows(s);
      }
    }

    planned_.assign(seqs.data(), seqs.data() + seqs.size());
    const float scale = params.softmax_scale > 0.0f ? params.softmax_scale
                                                    : 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    if constexpr (records_scores) {  // backend::host: scores by the attend path itself
      engine_.plan(batch, scale, nullptr,
                   score_settings{detail::token_scores_of<Selector>::value, selector_traits<Selector>::score_combine(selector_)});
    } else if constexpr (selector_traits<Selector>::reads_all_pages) {
      engine_.plan(batch, scale);
    } else {
      const selector_shape shape = selector_shape_of();
      detail::selection_request request = selector_traits<Selector>::start_request(selector_, shape);
      for (std::int64_t b = 0; b < seqs.size(); ++b) {
        const sequence_state& s = state_of(seqs(b));
        selector_traits<Selector>::request(selector_, shape, s.selector_state, s.stored, tail_rows(s), request);
        // The recent window is read from its exact rows: its spans are no candidates.
        const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
        request.candidates_before.push_back(window_rows(format_) > 0 ? sealed - window_rows(format_)
                                                                     : std::numeric_limits<std::int64_t>::max());
      }
      engine_.plan(batch, scale, &request);
    }
  }

  /// The device half of the planned step (backend::cuda: enqueued on `engine().stream()`, no
  /// allocation and no synchronization, so a CUDA graph can capture it and replay it after each
  /// new `plan` of a batch no larger). q, out: [batch][num_q_heads][head_dim] in float, half or
  /// bfloat16 with any strides (contiguous float q is read in place; other queries are gathered
  /// to float first, one small kernel); `lse` (optional, [batch][num_q_heads] float) receives
  /// each head's log-sum-exp of its scaled logits (natural log), so an engine can merge this
  /// attention with attention over other tokens computed elsewhere (cascade, chunked prefill).
  /// A selector that reads token scores (select::tova, select::h2o): the step also writes them
  /// (on backend::cuda into the selector's device buffers, without waiting for the step).
  template <class Q, class O>
  void run(tensor_view<Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse = {}) {
    static_assert(detail::is_io_type<std::remove_const_t<Q>>::value && detail::is_io_type<O>::value,
                  "kvmosaic::cache::run: q and out hold float, kvmosaic::half or kvmosaic::bfloat16");
    const char* where = "cache::run";
    const auto batch = static_cast<std::int64_t>(planned_.size());
    detail::require(q.extent(0) == batch, where, "q.extent(0) (batch)", q.extent(0), "the batch of the last plan");
    detail::require(q.extent(1) == config_.num_q_heads(), where, "q.extent(1) (query heads)", q.extent(1),
                    "num_kv_heads * group_size");
    detail::require(q.extent(2) == config_.head_dim, where, "q.extent(2) (head_dim)", q.extent(2),
                    "cache_config::head_dim");
    detail::require(out.extent(0) == q.extent(0) && out.extent(1) == q.extent(1) && out.extent(2) == q.extent(2),
                    where, "out.extents", "mismatch", "the extents of q");
    detail::require(lse.extent(0) == 0 || (lse.extent(0) == batch && lse.extent(1) == q.extent(1)), where,
                    "lse.extents", "mismatch", "empty, or [batch][num_q_heads]");
    check_view(where, "q", q);
    check_view(where, "out", out);
    check_view(where, "lse", lse);
    detail::require(!detail::views_overlap(q, out), where, "out", "overlapping q",
                    "an array that shares no element with q (attention reads every query of a group "
                    "before it writes an output)");
    detail::require(lse.extent(0) == 0 || (!detail::views_overlap(lse, q) && !detail::views_overlap(lse, out)), where,
                    "lse", "overlapping q or out", "an array that shares no element with q or out");
    using query_type = std::remove_const_t<Q>;
    engine_.run(tensor_view<const query_type, 3>(q), out, lse);
    if constexpr (records_scores) {
      for (const sequence_id seq : planned_) {
        sequence_state& s = state_of(seq);
        selector_traits<Selector>::scores(s.selector_state).scored_tokens = s.seen;
      }
    }
    if constexpr (!selector_traits<Selector>::reads_all_pages) {
      // The host engine reports what it read; the CUDA engine keeps its selection on the device
      // (engine().selection().selected_pages), so a step never waits for it.
      record_selection(span<const sequence_id>(planned_.data(), batch));
    }
  }

  /// Sizes the buffers of decode steps for batches of up to `batch` sequences of up to
  /// `max_tokens` tokens each, so that `plan` and `run` within those bounds never reallocate:
  /// what a CUDA graph captured from `run` needs (a larger step reallocates, and the graph must be
  /// captured again). backend::host has nothing to size.
  void reserve_step(std::int32_t batch, std::int64_t max_tokens) {
    detail::require(batch >= 1 && batch <= config_.max_sequences, "cache::reserve_step", "batch", batch,
                    "1 to cache_config::max_sequences");
    detail::require(max_tokens >= 1, "cache::reserve_step", "max_tokens", max_tokens, ">= 1");
    if constexpr (!std::is_same<Backend, backend::host>::value) {
      const std::int64_t pages = std::min<std::int64_t>(max_tokens / config_.page_size + 1, config_.max_pages);
      engine_.reserve_step(batch, static_cast<std::int32_t>(pages));
    }
  }

  /// Changes a read-less selector's token budget from the next step on (engines vary it with load).
  void set_budget(const select::token_budget& budget) {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::set_budget: select::all has no budget");
    budget.validate("cache::set_budget");
    selector_.budget = budget;
  }

  /// A keep-less selector's budget for `seq` alone from its next write (or snapshot) on, in place
  /// of the selector's: engines give requests different budgets, and `select::per_kv_head` gives
  /// each KV head its own. Tokens already evicted stay evicted; a smaller budget evicts at the next
  /// write. Forks inherit it. Throws `invalid_argument` naming `budget.ratio` outside [0, 1], or
  /// for a dead handle. Cost: O(1).
  void set_budget(sequence_id seq, const select::token_budget& budget) {
    static_assert(selector_traits<Selector>::evicts && detail::has_token_budget<Selector>::value,
                  "kvmosaic::cache::set_budget(seq, budget): only a keep-less selector with a token budget (select::h2o, "
                  "tova, snapkv, streaming) keeps one per sequence; a read-less one takes set_budget(budget)");
    sequence_state& s = live(seq, "cache::set_budget");
    budget.validate("cache::set_budget");
    s.budget = budget;
    s.own_budget = true;
  }
  /// The budget a keep-less selector applies to `seq`: its own (`set_budget(seq, budget)`), else
  /// the selector's.
  select::token_budget budget(sequence_id seq) const {
    static_assert(selector_traits<Selector>::evicts && detail::has_token_budget<Selector>::value,
                  "kvmosaic::cache::budget(seq): only a keep-less selector with a token budget keeps one per sequence");
    const sequence_state& s = live(seq, "cache::budget");
    return s.own_budget ? s.budget : selector_.budget;
  }

  /// What the last step read for `seq` (read-less selectors; the sequence must have been in it).
  selection_stats selection(sequence_id seq) const {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::selection: select::all reads every token");
    static_assert(std::is_same<Backend, backend::host>::value,
                  "kvmosaic::cache::selection: on backend::cuda, read engine().selection().selected_pages(b, head)");
    return live(seq, "cache::selection").last_selection;
  }
  /// The token ranges the last step selected for `seq`, KV head `head` (merged, ascending).
  const std::vector<std::pair<std::int64_t, std::int64_t>>& selected_ranges(sequence_id seq, int head) const {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::selected_ranges: select::all reads every token");
    static_assert(std::is_same<Backend, backend::host>::value,
                  "kvmosaic::cache::selected_ranges: on backend::cuda, read engine().selection().selected_pages(b, head)");
    const sequence_state& s = live(seq, "cache::selected_ranges");
    detail::require(head >= 0 && head < config_.num_kv_heads, "cache::selected_ranges", "head", head, "0 to num_kv_heads - 1");
    detail::require(!s.selected.empty(), "cache::selected_ranges", "seq", seq, "a sequence of a selected decode step");
    return s.selected[static_cast<std::size_t>(head)];
  }
  /// The selector's state of a live sequence (`selector_traits<Selector>::sequence_state`; empty
  /// for selectors that keep none). The selector's `cache_members` read it.
  const typename selector_traits<Selector>::sequence_state& selector_state(sequence_id seq) const {
    return live(seq, "cache::selector_state").selector_state;
  }

  /// Tokens stored for a sequence.
  /// Evicts the tokens at logical `positions` (host memory) of `seq`: attention skips them from
  /// this call on, and every page left with no live token goes back to the pool at once (block-
  /// granular reclaim; a compaction pass frees the rest). Positions of the other tokens, and
  /// `length(seq)`, do not change. All or nothing: a position outside [0, length), in the open tail
  /// (its rows are not evictable), already evicted or listed twice is an `invalid_argument` and
  /// nothing changes. Cost: O(slots log slots) on the host (the position lookup); no device work
  /// (on backend::cuda each later step stages the sequence's live-row masks with its metadata).
  template <class C = Compactor>
  void evict(sequence_id seq, span<const std::int64_t> positions) {
    static_assert(compactor_traits<C>::frees_memory,
                  "kvmosaic::cache::evict: this cache's compactor frees no memory; use compact::repack or "
                  "compact::hole_fill");
    evict_positions(seq, positions, false);
  }

 private:
  /// `evict`; with `skip_evicted`, positions already evicted are passed over instead of rejected
  /// (a keep-less selector's own evictions after the caller's).
  void evict_positions(sequence_id seq, span<const std::int64_t> positions, bool skip_evicted) {
    const char* where = "cache::evict";
    sequence_state& s = live(seq, where);
    check_view(where, "positions", positions);
    const int page = config_.page_size;
    const std::int64_t open_from = s.seen - tail_rows(s);  // the tail's first position
    std::vector<std::pair<std::int64_t, std::int64_t>> by_position;  // (position, slot) of live sealed slots
    by_position.reserve(s.slots.position.size() - static_cast<std::size_t>(s.slots.dead));
    for (std::size_t slot = 0; slot < s.slots.position.size(); ++slot)
      if (s.slots.position[slot] >= 0) by_position.emplace_back(s.slots.position[slot], static_cast<std::int64_t>(slot));
    std::sort(by_position.begin(), by_position.end());
    std::vector<std::int64_t> slots;
    slots.reserve(static_cast<std::size_t>(positions.size()));
    for (std::int64_t i = 0; i < positions.size(); ++i) {
      const std::int64_t p = positions(i);
      detail::require(p >= 0 && p < s.seen, where, "positions", p, "0 to length(seq) - 1");
      detail::require(p < open_from, where, "positions", p,
                      ("a sealed token: below " + std::to_string(open_from) + " (the tail's open rows are not evictable)").c_str());
      detail::require(p >= sink_rows(format_), where, "positions", p,
                      "a token after the format's sink tokens (they are kept 16-bit and always read)");
      const auto it = std::lower_bound(by_position.begin(), by_position.end(), std::make_pair(p, std::int64_t{-1}));
      const bool found = it != by_position.end() && it->first == p;
      if (skip_evicted && !found) continue;
      detail::require(found, where, "positions", p, "a live token (this one was evicted before)");
      slots.push_back(it->second);
    }
    std::vector<std::int64_t> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    detail::require(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), where, "positions", "a repeated position",
                    "distinct positions");
    // Nothing below allocates past this point but the empty-page list: compute it on a copy first.
    detail::slot_positions next = s.slots;
    for (const std::int64_t slot : slots) next.evict(slot, page);
    const std::vector<std::int32_t> empty = detail::empty_pages(next.position, page);
    block_table pages;
    pages.reserve(s.pages.size() - empty.size());
    for (std::size_t i = 0, e = 0; i < s.pages.size(); ++i) {
      if (e < empty.size() && empty[e] == static_cast<std::int32_t>(i)) {
        ++e;
        continue;
      }
      pages.push_back(s.pages[i]);
    }
    next.drop_pages(empty, page);
    // Commit (cannot throw): the freed pages go back to the pool.
    for (const std::int32_t i : empty) pool_.release(s.pages[static_cast<std::size_t>(i)]);
    s.pages.swap(pages);
    s.slots = std::move(next);
    s.stored -= static_cast<std::int64_t>(empty.size()) * page;
    if (!sorted.empty()) s.device_positions = std::min(s.device_positions, sorted.front());
    if (!empty.empty()) s.device_positions = std::min(s.device_positions, static_cast<std::int64_t>(empty.front()) * page);
  }

  /// Evicts sealed `slots` of `seq` (ascending, distinct, live, past the sinks: a device ranking's
  /// choice, which the device mirror already marks). Cost: O(slots given) on the host, plus
  /// O(sealed slots) when a page empties (the position map drops it, as `evict` does).
  void evict_slots(sequence_id seq, const std::vector<std::int64_t>& slots) {
    sequence_state& s = state_of(seq);
    const int page = config_.page_size;
    const int words = detail::slot_positions::words(page);
    // Pages left with no live row, found before anything changes: a page empties when every live
    // row it has is among `slots` (ascending, so a page's slots are adjacent).
    std::vector<std::int32_t> empty;
    for (std::size_t i = 0; i < slots.size();) {
      const std::int64_t p = slots[i] / page;
      std::size_t j = i;
      while (j < slots.size() && slots[j] / page == p) ++j;
      int live = 0;
      for (int w = 0; w < words; ++w) live += static_cast<int>(std::bitset<64>(s.slots.live[static_cast<std::size_t>(p * words + w)]).count());
      if (live == static_cast<int>(j - i)) empty.push_back(static_cast<std::int32_t>(p));
      i = j;
    }
    if (!empty.empty()) {  // rare: the general path (it copies the map before changing it)
      // The mirror already marks these slots: re-uploaded from the first of them if that path throws.
      s.device_positions = std::min(s.device_positions, slots.front());
      std::vector<std::int64_t> positions;
      positions.reserve(slots.size());
      for (const std::int64_t slot : slots) positions.push_back(s.slots.position[static_cast<std::size_t>(slot)]);
      evict_positions(seq, span<const std::int64_t>(positions.data(), static_cast<std::int64_t>(positions.size())), false);
      return;
    }
    for (const std::int64_t slot : slots) s.slots.evict(slot, page);  // cannot throw
  }

  /// After a write of `written` tokens to each of `seqs` (committed): a keep-less selector's
  /// evictions, then its compaction cadence. Runs after the write's commit: a failure here (an
  /// allocation) leaves the written tokens stored and the evictions to the next write. A selector
  /// that reads token scores on backend::cuda ranks the whole batch's evictions in one pass on the
  /// device (`selection().lowest_scored`), where the scores are; the others rank on the host.
  void after_write(span<const sequence_id> seqs, std::int64_t written) {
    if constexpr (selector_traits<Selector>::evicts) {
      if constexpr (records_scores && rows_on_device) {
        using stage = typename engine_type::selection_type;
        std::vector<typename stage::ranking> rankings;
        std::vector<sequence_id> ranked;
        for (std::int64_t b = 0; b < seqs.size(); ++b) {
          sequence_state& s = state_of(seqs(b));
          const score_eviction quota = selector_traits<Selector>::eviction_quota(selector_of(s), s.selector_state, s.seen,
                                                                                 s.seen - tail_rows(s), s.stored - s.slots.dead);
          if (quota.count <= 0) continue;
          upload_positions(s, slot_of(seqs(b)));
          rankings.push_back({slot_of(seqs(b)), static_cast<std::int64_t>(s.slots.position.size()), sink_rows(format_),
                              quota.before, quota.count});
          ranked.push_back(seqs(b));
        }
        const std::vector<std::vector<std::int64_t>> chosen =
            rankings.empty() ? std::vector<std::vector<std::int64_t>>{} : engine_.selection().lowest_scored(rankings, engine_.stream());
        for (std::int64_t b = 0, i = 0; b < seqs.size(); ++b) {  // each sequence evicts, then compacts, in batch order
          if (i < static_cast<std::int64_t>(ranked.size()) && ranked[static_cast<std::size_t>(i)] == seqs(b))
            evict_slots(seqs(b), chosen[static_cast<std::size_t>(i++)]);
          if (selector_traits<Selector>::compaction_due(selector_, state_of(seqs(b)).selector_state, written)) compact(seqs(b));
        }
      } else {
        for (std::int64_t b = 0; b < seqs.size(); ++b) {
          sequence_state& s = state_of(seqs(b));
          const eviction_view view{s.stored - s.slots.dead, s.slots.position.data(),
                                   static_cast<std::int64_t>(s.slots.position.size()), sink_rows(format_)};
          const std::vector<std::int64_t> dead =
              selector_traits<Selector>::evictions(selector_of(s), s.selector_state, s.seen, s.seen - tail_rows(s), view);
          if (!dead.empty())
            evict_positions(seqs(b), span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())), true);
          if (selector_traits<Selector>::compaction_due(selector_, s.selector_state, written)) compact(seqs(b));
        }
      }
    }
  }

 public:

  /// A compaction pass over `seq` with the cache's compactor (`compact::repack`,
  /// `compact::hole_fill`): survivors move (memory/compaction_plan.hpp), the pages the pass empties
  /// go back to the pool at once, and the position map follows. Pages shared with another sequence
  /// (reference count above one), and every page before the last of them, are neither moved nor
  /// freed; nor, for a format that re-encodes what it moves, is any page up to the last one it has
  /// re-encoded as often as it allows (format::quant2's `max_reencodes`). Returns what the pass
  /// did. Cost: the plan, O(slots) on the host, and the engine's moves: a decode of every page a
  /// move touches and an encode of every page it writes (formats that encode pages compress the
  /// moved rows again: see the format's docs for what that does to its error).
  template <class C = Compactor>
  compaction_report compact(sequence_id seq) {
    static_assert(compactor_traits<C>::frees_memory, "kvmosaic::cache::compact: compact::none frees nothing");
    sequence_state& s = live(seq, "cache::compact");
    const int page = config_.page_size;
    // Frozen: every page up to the last one another sequence holds too (a fork's shared pages lead
    // the block table, but an eviction that drops a page can leave a page held alone before them),
    // and, for formats that re-encode what they move, up to the last one re-encoded as often as the
    // format allows.
    std::int32_t frozen = 0;
    for (std::size_t i = 0; i < s.pages.size(); ++i)
      if (pool_.ref_count(s.pages[i]) > 1) frozen = static_cast<std::int32_t>(i) + 1;
    constexpr bool reencodes = detail::reencodes_moved_rows_v<Format>;
    if constexpr (reencodes) {
      const int limit = detail::reencoding<Format>::limit(format_);
      for (std::size_t i = s.slots.reencoded.size(); i-- > 0;)
        if (s.slots.reencoded[i] >= limit) {
          frozen = std::max(frozen, static_cast<std::int32_t>(i) + 1);
          break;
        }
    }
    const std::int64_t round_start = std::max<std::int64_t>(s.slots.round_start, static_cast<std::int64_t>(frozen) * page);
    const detail::compaction_plan plan = compactor_traits<C>::plan(compactor_, s.slots.position, page, round_start, frozen);
    detail::slot_positions next;  // the map afterwards (allocates: before anything changes)
    next.reserve(static_cast<std::size_t>(plan.pages_kept), page);
    next.seal(static_cast<std::size_t>(plan.pages_kept), 0, page);
    for (std::size_t slot = 0; slot < plan.positions.size(); ++slot) {
      next.position[slot] = plan.positions[slot];
      if (plan.positions[slot] < 0) next.evict(static_cast<std::int64_t>(slot), page);
    }
    next.round_start = static_cast<std::int64_t>(plan.pages_kept) * page;
    std::copy_n(s.slots.reencoded.begin(), plan.pages_kept, next.reencoded.begin());  // the kept pages stay where they are
    if (reencodes)
      for (const std::int32_t i : plan.pages_written) {
        std::uint8_t& count = next.reencoded[static_cast<std::size_t>(i)];
        count = static_cast<std::uint8_t>(std::min(count + 1, 255));
      }
    engine_.move_slots(slot_of(seq), s.pages, plan, !s.pages.empty() && frozen == 0 && sink_rows(format_) > 0);
    for (const detail::slot_move& m : plan.moves) s.device_positions = std::min({s.device_positions, m.from, m.to});
    s.device_positions = std::min(s.device_positions, static_cast<std::int64_t>(plan.positions.size()));
    // Commit (cannot throw): emptied pages go back to the pool.
    for (std::size_t i = static_cast<std::size_t>(plan.pages_kept); i < s.pages.size(); ++i) pool_.release(s.pages[i]);
    s.pages.resize(static_cast<std::size_t>(plan.pages_kept));
    s.stored -= static_cast<std::int64_t>(plan.pages_freed) * page;
    s.slots = std::move(next);
    return plan.report(detail::reencodes_moved_rows_v<Format>);
  }
  /// `compact(seq)` for every live sequence; the reports summed.
  template <class C = Compactor>
  compaction_report compact() {
    compaction_report total;
    for (std::size_t i = 0; i < sequences_.size(); ++i)
      if (sequences_[i].live)
        total += compact<C>(static_cast<sequence_id>(static_cast<std::int64_t>(sequences_[i].generation) * config_.max_sequences +
                                                     static_cast<std::int64_t>(i)));
    return total;
  }

  /// The logical position of each sealed slot of `seq` (block-table order, -1 for an evicted
  /// token), then its tail rows' positions: what position-dependent code (RoPE, prefix hashing)
  /// reads once a compaction has moved tokens.
  template <class C = Compactor>
  std::vector<std::int64_t> positions(sequence_id seq) const {
    static_assert(compactor_traits<C>::frees_memory,
                  "kvmosaic::cache::positions: without a compactor that frees memory, slot i holds position i");
    const sequence_state& s = live(seq, "cache::positions");
    std::vector<std::int64_t> out = s.slots.position;
    for (std::int64_t p = s.seen - tail_rows(s); p < s.seen; ++p) out.push_back(p);
    return out;
  }

  /// Tokens the sequence has been given: the position of its next token. Eviction and compaction
  /// do not change it.
  std::int64_t length(sequence_id seq) const { return live(seq, "cache::length").seen; }
  /// Tokens the sequence holds in its slots (its sealed pages' rows, dead ones included until a
  /// compaction reclaims them, and its tail rows); `length` when nothing was evicted.
  std::int64_t stored_tokens(sequence_id seq) const { return live(seq, "cache::stored_tokens").stored; }

  /// Reads back the K and V a sequence holds, decoded, for inspection and tests: `k`, `v` are
  /// [stored_tokens(seq)][num_kv_heads][head_dim] in host memory, float, half or bfloat16 with any
  /// strides (on every backend). Row i is slot i of the sequence (its sealed pages' rows in
  /// block-table order, then its tail rows) as attention reads it: the format's host decode of
  /// each page (`format_traits::decode_k/v`: format::dense the stored rows, format::bitmap_tiles
  /// the pruned rows with zeros where pruned, format::quant2 the dequantized codes, min + scale *
  /// code), the exact rows (sink tokens and the recent window, `sink_tokens` / `recent_tokens`)
  /// from their 16-bit copies, the tail rows as stored. Evicted slots hold whatever their page
  /// decodes to (`positions(seq)` maps slots to positions). Values are converted to T (exact unless T is narrower than the storage dtype or
  /// the decode). On backend::cuda the page and tail bytes are copied to the host after the work
  /// on the engine's stream (which this synchronizes: not inside a graph capture) and decoded
  /// there with the same host decode, so both backends read the same values from the same bytes.
  /// Cost: one copy and one decode of each page of the sequence (in chunks of 64 pages), plus its
  /// tail slot; O(stored_tokens x num_kv_heads x head_dim). Throws `invalid_argument` for a
  /// dead handle or views of the wrong extents; writes nothing then.
  template <class T>
  void read(sequence_id seq, tensor_view<T, 3> k, tensor_view<T, 3> v) const {
    static_assert(detail::is_io_type<T>::value,
                  "kvmosaic::cache::read: k and v hold float, kvmosaic::half or kvmosaic::bfloat16 (not const)");
    const char* where = "cache::read";
    const sequence_state& s = live(seq, where);
    detail::require(k.extent(0) == s.stored, where, "k.extent(0) (tokens)", k.extent(0), "stored_tokens(seq)");
    detail::require(k.extent(1) == config_.num_kv_heads, where, "k.extent(1) (kv heads)", k.extent(1),
                    "cache_config::num_kv_heads");
    detail::require(k.extent(2) == config_.head_dim, where, "k.extent(2) (head_dim)", k.extent(2), "cache_config::head_dim");
    detail::require(v.extent(0) == k.extent(0) && v.extent(1) == k.extent(1) && v.extent(2) == k.extent(2), where,
                    "v.extents", "mismatch", "the extents of k");
    check_view(where, "k", k);
    check_view(where, "v", v);
    detail::require(!detail::views_overlap(k, v), where, "v", "overlapping k", "an array that shares no element with k");
    if (s.stored == 0) return;
    using dense_traits = format_traits<format::dense>;
    const detail::arena_geometry& g = engine_.geometry();
    const page_shape shape{config_.page_size, config_.head_dim, config_.storage};
    const int p = config_.page_size, d = config_.head_dim;
    std::vector<float> rows(static_cast<std::size_t>(p) * d);
    // Rows [from, to) of `rows` into out[first + t][h].
    const auto put = [&](const tensor_view<T, 3>& out, std::int64_t first, int h, int from, int to) {
      for (int t = from; t < to; ++t)
        for (int c = 0; c < d; ++c) out(first + t, h, c) = T(rows[static_cast<std::size_t>(t) * d + c]);
    };
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * p;
    const std::int64_t exact = g.exact_rows_held(sealed);  // sinks and window: read from their copies
    const std::size_t chunk = std::min<std::size_t>(64, s.pages.size());
    if (chunk > 0) {
      detail::host_buffer bytes(chunk * engine_.page_slot_bytes());
      for (std::size_t first = 0; first < s.pages.size(); first += chunk) {
        const std::size_t n = std::min(chunk, s.pages.size() - first);
        engine_.copy_pages_out(s.pages.data() + first, n, bytes.data());
        for (std::size_t i = 0; i < n; ++i) {
          const std::byte* slot = bytes.data() + i * engine_.page_slot_bytes();
          const auto row0 = static_cast<std::int64_t>(first + i) * p;
          for (int h = 0; h < config_.num_kv_heads; ++h)
            for (const bool is_v : {false, true}) {
              if constexpr (has_segments_v<Format>) {  // in the page's segment: the engine keeps them
                engine_.decode_page(slot_of(seq), static_cast<std::int64_t>(first + i), h, is_v,
                                    slot + (is_v ? g.v_page_offset(h) : g.k_page_offset(h)), p, rows.data());
              } else if (is_v) {
                format_traits<Format>::decode_v(format_, shape, slot + g.v_page_offset(h), p, rows.data());
              } else {
                format_traits<Format>::decode_k(format_, shape, slot + g.k_page_offset(h), p, rows.data());
              }
              for (int t = 0; t < p; ++t)
                if (exact == 0 || !g.exact_position(row0 + t, sealed)) put(is_v ? v : k, row0, h, t, t + 1);
            }
        }
      }
    }
    const int tail = tail_rows(s);
    if (tail == 0 && exact == 0) return;
    detail::host_buffer tail_bytes(g.tail_slot_bytes());
    engine_.copy_tail_out(slot_of(seq), tail_bytes.data());
    for (int h = 0; h < config_.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        const std::byte* head = tail_bytes.data() + g.tail_offset(is_v, h);
        const tensor_view<T, 3>& out = is_v ? v : k;
        for (std::int64_t t = 0; t < sealed && exact > 0; ++t) {
          if (!g.exact_position(t, sealed)) continue;
          dense_traits::decode_k(format::dense{}, shape, head + g.exact_row_of(t) * g.row_bytes, 1, rows.data());
          put(out, t, h, 0, 1);
        }
        if (tail > 0) {
          dense_traits::decode_k(format::dense{}, shape, head + g.tail_row_offset(), tail, rows.data());
          put(out, sealed, h, 0, tail);
        }
      }
  }
  /// The attention the last W = `queries.extent(0)` positions of `seq` pay each earlier token: an
  /// observation window's votes (SnapKV; `select::snapkv`'s snapshot ranks by them, and any
  /// window-based policy may). For each position t < length(seq) - W that holds a live token and
  /// each KV head h,
  ///
  ///     vote(t, h) = sum over w < W of combine over the group's query heads j of softmax_w,j(t)
  ///
  /// where window query w (position length - W + w) attends causally to every live token the
  /// sequence stores up to its own position, as attention reads them. `queries`:
  /// [W][num_q_heads][head_dim] in host memory (float, half or bfloat16); softmax_scale 0 means
  /// 1 / sqrt(head_dim). Returns [length - W][num_kv_heads] by position, -inf where no live token
  /// is.
  ///
  /// On backend::cuda over a format whose split kernels write exact logits, in a cache whose
  /// selector reads window votes (format::dense or bitmap_tiles with select::snapkv:
  /// `engine_type::computes_window_votes`), the votes are computed on the device, in fp32: decode
  /// steps of up to 8 copies of the sequence write each row's logits, a kernel takes each query's
  /// causal log-sum-exp and another sums the probabilities (`cuda::engine::window_votes`); 4 bytes
  /// per row and KV head come back. This invalidates the last plan and may grow the step buffers
  /// (re-capture a graph of `run` after it). Elsewhere the keys are read back (`read`) and scored
  /// on the host in fp64, one pass over them per window query and query head (no W x N matrix).
  /// Throws `invalid_argument`, before anything changes, for a dead handle, W < 1 or longer than
  /// the sequence, or queries of the wrong extents.
  template <class Q>
  std::vector<double> window_votes(sequence_id seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f,
                                   group_combine combine = group_combine::sum) {
    static_assert(detail::is_io_type<std::remove_const_t<Q>>::value,
                  "kvmosaic::cache::window_votes: queries hold float, kvmosaic::half or kvmosaic::bfloat16");
    const char* where = "cache::window_votes";
    const sequence_state& s = live(seq, where);
    const std::int64_t window = queries.extent(0);
    detail::require(window >= 1 && window <= s.seen, where, "queries.extent(0) (window)", window,
                    "1 to length(seq): the window's tokens must be stored");
    detail::require(queries.extent(1) == config_.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                    "num_kv_heads x group_size");
    detail::require(queries.extent(2) == config_.head_dim, where, "queries.extent(2) (head_dim)", queries.extent(2),
                    "cache_config::head_dim");
    detail::require(softmax_scale >= 0.0f && std::isfinite(softmax_scale), where, "softmax_scale", softmax_scale,
                    "a finite value >= 0 (0: 1/sqrt(head_dim))");
    check_view(where, "queries", queries);
    const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    const std::int64_t window_start = s.seen - window;
    const int heads = config_.num_kv_heads, group = config_.group_size, d = config_.head_dim;
    if constexpr (engine_type::computes_window_votes) {
      std::vector<float> q(static_cast<std::size_t>(window) * heads * group * d);
      for (std::int64_t w = 0; w < window; ++w)
        for (int j = 0; j < heads * group; ++j)
          for (int c = 0; c < d; ++c) q[(static_cast<std::size_t>(w) * heads * group + j) * d + c] = to_float(queries(w, j, c));
      const std::vector<std::int64_t> rows = read_order_positions(s);
      const std::uint64_t* live_rows = nullptr;
      if constexpr (evicts_tokens) live_rows = s.slots.dead > 0 ? s.slots.live.data() : nullptr;
      const std::vector<float> votes = engine_.window_votes(detail::sequence_ref{&s.pages, s.stored, slot_of(seq), live_rows},
                                                            q.data(), static_cast<int>(window), rows, window_start, scale,
                                                            combine);
      std::vector<double> out(static_cast<std::size_t>(window_start) * heads, -std::numeric_limits<double>::infinity());
      for (std::size_t r = 0; r < rows.size(); ++r) {
        if (rows[r] < 0 || rows[r] >= window_start) continue;
        for (int h = 0; h < heads; ++h)
          out[static_cast<std::size_t>(rows[r]) * heads + h] = votes[static_cast<std::size_t>(h) * rows.size() + r];
      }
      return out;
    } else {
      std::vector<std::int64_t> positions(static_cast<std::size_t>(s.stored));
      if constexpr (evicts_tokens) {
        positions = this->positions(seq);
      } else {
        for (std::int64_t i = 0; i < s.stored; ++i) positions[static_cast<std::size_t>(i)] = i;
      }
      std::vector<float> k(static_cast<std::size_t>(s.stored) * heads * d), v(k.size());
      read(seq, tensor_view<float, 3>(k.data(), s.stored, heads, d), tensor_view<float, 3>(v.data(), s.stored, heads, d));
      const auto key = [&](std::int64_t i, int h, int c) { return k[(static_cast<std::size_t>(i) * heads + h) * d + c]; };
      const auto query = [&](int w, int j, int c) { return static_cast<double>(to_float(queries(w, j, c))) * scale; };
      return detail::window_votes(key, positions, query, window_start, static_cast<int>(window), heads, group, d, combine);
    }
  }

  /// A selector that reads token scores (select::tova, select::h2o): the scores of `seq`,
  /// [position][num_kv_heads] for every position it has held (select/token_scores.hpp; evicted
  /// positions keep their last value). On backend::cuda they are copied from the device (this
  /// waits for the engine's stream). Cost: 4 bytes per position and KV head.
  std::vector<float> token_scores(sequence_id seq) const {
    static_assert(records_scores, "kvmosaic::cache::token_scores: this cache's selector reads no token scores "
                                  "(select::tova and select::h2o do)");
    const sequence_state& s = live(seq, "cache::token_scores");
    const detail::token_score_buffer& buffer = selector_traits<Selector>::scores(s.selector_state);
    if constexpr (rows_on_device) return engine_.selection().scores(slot_of(seq), buffer.tokens(), engine_.stream());
    else return buffer.values;
  }

  /// The page ids of a sequence's full pages, in order.
  const block_table& pages(sequence_id seq) const { return live(seq, "cache::pages").pages; }

  /// Memory of one sequence as if it were alone (its pages counted in full, shared or not).
  memory_stats sequence_memory(sequence_id seq) const {
    const sequence_state& s = live(seq, "cache::sequence_memory");
    memory_stats m = pool_gauge();
    m.tokens = s.stored;
    m.stored_bytes = static_cast<std::int64_t>(s.pages.size()) * page_bytes() +
                     (tail_rows(s) + exact_rows_of(s)) * tail_row_bytes() + selector_bytes(s) + segment_bytes(s);
    m.dense_bytes = s.stored * tail_row_bytes();
    return m;
  }

  /// Memory of the whole cache: every pool page in use once, plus every live tail.
  memory_stats memory() const {
    memory_stats m = pool_gauge();
    m.stored_bytes = static_cast<std::int64_t>(m.pages_used) * page_bytes();
    for (const sequence_state& s : sequences_) {
      if (!s.live) continue;
      m.tokens += s.stored;
      m.stored_bytes += (tail_rows(s) + exact_rows_of(s)) * tail_row_bytes() + selector_bytes(s) + segment_bytes(s);
      m.dense_bytes += s.stored * tail_row_bytes();
    }
    return m;
  }

 private:
  struct sequence_state {
    bool live = false;
    std::uint32_t generation = 0;  ///< of the slot: bumped by each removal (stale handles)
    std::int64_t stored = 0;  ///< slots in use: the sealed pages' rows and the tail rows
    std::int64_t seen = 0;    ///< tokens given: the next token's position
    block_table pages;
    detail::slot_positions slots;  ///< caches whose compactor frees memory: per sealed slot, its position
    typename selector_traits<Selector>::sequence_state selector_state;  ///< the selector's, per sequence
    selection_stats last_selection;
    /// The previous selected step's ranges per KV head (for reuse).
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> selected;
    /// Sealed slots whose positions the device mirror holds as `slots.position` does (backend::cuda
    /// with a selector that reads token scores: its stage's `upload_positions`).
    std::int64_t device_positions = 0;
    select::token_budget budget;  ///< a keep-less selector's budget for this sequence, when `own_budget`
    bool own_budget = false;
  };

  /// The selector as it applies to `s`: a copy of the cache's, with the sequence's own budget when
  /// it has one. Cost: one copy of the selector (a few scalars) per write and sequence.
  Selector selector_of(const sequence_state& s) const {
    Selector copy = selector_;
    if constexpr (detail::has_token_budget<Selector>::value)
      if (s.own_budget) copy.budget = s.budget;
    return copy;
  }

  /// Bytes of one pool page, with the key bounds a selector keeps per page.
  std::int64_t page_bytes() const {
    return static_cast<std::int64_t>(engine_.page_slot_bytes() + engine_.page_bounds_bytes());
  }
  /// Bytes the selector keeps for a sequence (e.g. key bounds of its spans).
  std::int64_t selector_bytes(const sequence_state& s) const {
    return selector_traits<Selector>::extra_bytes(selector_shape_of(), s.selector_state);
  }
  /// Bytes the format keeps per sequence besides pages and tail: the segments' bases of a format
  /// with segments (format::packed_bitmap), else 0.
  std::int64_t segment_bytes(const sequence_state& s) const {
    if constexpr (has_segments_v<Format>) return static_cast<std::int64_t>(engine_.segment_bytes(static_cast<std::int64_t>(s.pages.size())));
    else return 0;
  }
  /// What the selector's hooks know of this cache.
  selector_shape selector_shape_of() const noexcept {
    return selector_shape{config_.num_kv_heads, config_.head_dim, config_.page_size, config_.storage};
  }
  /// The backend keeps K and V rows in device memory (backend::cuda): the selector's hooks then
  /// leave work on the keys to the engine.
  static constexpr bool rows_on_device = !std::is_same<Backend, backend::host>::value;
  /// The compactor frees memory: the cache keeps each sequence's position map and can evict.
  static constexpr bool evicts_tokens = compactor_traits<Compactor>::frees_memory;
  /// The selector reads the attend path's token scores (select::tova, select::h2o).
  static constexpr bool records_scores = detail::token_scores_of<Selector>::value != score_use::none;

  /// Brings the device mirror of `s`'s position map up to date (backend::cuda, a selector that
  /// reads token scores): the slots from the first one changed since the last upload. Cost: 8
  /// bytes per slot copied; a decode step copies only what sealing and evictions changed.
  void upload_positions(sequence_state& s, std::int32_t slot) {
    const auto slots = static_cast<std::int64_t>(s.slots.position.size());
    if (s.device_positions < slots)
      engine_.selection().upload_positions(slot, s.slots.position.data(), s.device_positions, slots, engine_.stream());
    s.device_positions = slots;
  }

  /// The logical position of each row of a sequence's read order on backend::cuda (its sealed
  /// pages' rows in block-table order, then its exact rows' run, then its tail rows): -1 for an
  /// evicted row and for a page row attended from its exact copy (sinks, recent window).
  /// Cost: O(rows).
  std::vector<std::int64_t> read_order_positions(const sequence_state& s) const {
    const auto& geometry = engine_.geometry();
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
    const std::int64_t exact = geometry.exact_rows_held(sealed);
    std::vector<std::int64_t> out(static_cast<std::size_t>(sealed + exact + tail_rows(s)));
    for (std::int64_t r = 0; r < sealed; ++r) {
      std::int64_t position = r;
      if constexpr (evicts_tokens) position = s.slots.position[static_cast<std::size_t>(r)];
      out[static_cast<std::size_t>(r)] = exact > 0 && geometry.exact_position(r, sealed) ? -1 : position;
    }
    geometry.exact_run_positions(sealed, out.data() + sealed);
    const std::int64_t tail_from = s.seen - tail_rows(s);
    for (std::int64_t t = 0; t < tail_rows(s); ++t) out[static_cast<std::size_t>(sealed + exact + t)] = tail_from + t;
    return out;
  }

  /// Tokens of [from, to) inside the union of `ranges` (which may overlap: each token counts once).
  static std::int64_t overlap(std::int64_t from, std::int64_t to, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) {
    std::vector<std::pair<std::int64_t, std::int64_t>> hits;
    for (const auto& [a, z] : ranges)
      if (std::max(a, from) < std::min(z, to)) hits.emplace_back(std::max(a, from), std::min(z, to));
    std::sort(hits.begin(), hits.end());
    std::int64_t total = 0, reach = from;
    for (const auto& [a, z] : hits) {
      const std::int64_t start = std::max(a, reach);
      if (z > start) total += z - start;
      reach = std::max(reach, z);
    }
    return total;
  }

  /// After a selected step: each sequence's stats, and its reuse of the previous step's selection.
  void record_selection(span<const sequence_id> seqs) {
    if constexpr (std::is_same<Backend, backend::host>::value) record_host_selection(seqs);
  }
  void record_host_selection(span<const sequence_id> seqs) {
    const auto& heads = engine_.last_selection();
    const int num_heads = config_.num_kv_heads;
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = state_of(seqs(b));
      selection_stats stats;
      double reused = 0, previous = 0;
      // Always read: the sink rows, and everything from the selector's always-read region (or the
      // tail) on.
      const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
      const std::int64_t always_from = selector_traits<Selector>::always_from(s.selector_state, sealed);
      const std::int64_t sinks = s.pages.empty() ? 0 : static_cast<std::int64_t>(sink_rows(format_));
      const std::int64_t window_from = sealed - window_rows(format_);
      std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> current(static_cast<std::size_t>(num_heads));
      for (int h = 0; h < num_heads; ++h) {
        const detail::head_selection& e = heads[static_cast<std::size_t>(b * num_heads + h)];
        stats.tokens_selected += static_cast<double>(e.tokens_selected) / num_heads;
        stats.tokens_read += static_cast<double>(e.tokens_read) / num_heads;
        stats.pages_read += static_cast<double>(e.pages_read) / num_heads;
        current[static_cast<std::size_t>(h)] = e.selected;
        if (s.selected.empty()) continue;
        std::vector<std::pair<std::int64_t, std::int64_t>> read = e.selected;
        if (sinks > 0) read.emplace_back(0, sinks);
        read.emplace_back(std::min(always_from, window_from), std::numeric_limits<std::int64_t>::max());
        for (const auto& [from, to] : s.selected[static_cast<std::size_t>(h)]) {
          previous += static_cast<double>(to - from);
          reused += static_cast<double>(overlap(from, to, read));
        }
      }
      if (!s.selected.empty()) stats.reuse = previous > 0 ? reused / previous : 1.0;
      s.last_selection = stats;
      s.selected = std::move(current);
    }
  }

  static cache_config validated(const cache_config& config, const Format& format, const Selector& selector) {
    config.validate();
    format_traits<Format>::validate(format, page_shape{config.page_size, config.head_dim, config.storage});
    // The recent window's ring is indexed by position, which a compaction's moves break.
    detail::require(!compactor_traits<Compactor>::frees_memory || window_rows(format) == 0,
                    (std::string(format_traits<Format>::name) + " with compact::" + compactor_traits<Compactor>::name).c_str(),
                    "recent_tokens", window_rows(format), "0 with a compactor that frees memory (evicted caches keep no exact window)");
    selector_traits<Selector>::validate(selector, config.page_size);
    return config;
  }
  static std::vector<sequence_state> sequence_slots(const cache_config& c) {
    try {
      return std::vector<sequence_state>(static_cast<std::size_t>(c.max_sequences));
    } catch (const std::bad_alloc&) {
      throw capacity_error("max_sequences", "kvmosaic: cache: cannot allocate the state of " +
                                                std::to_string(c.max_sequences) +
                                                " sequences; allowed: a max_sequences that fits in host memory");
    }
  }
  static detail::engine_shape engine_shape(const cache_config& c) {
    return detail::engine_shape{c.num_kv_heads, c.group_size, c.head_dim, c.page_size,
                                c.storage,      c.max_pages,  c.max_sequences};
  }

  // A handle is slot + max_sequences * generation (sequence_id's comment).
  std::int32_t slot_of(sequence_id seq) const noexcept { return seq % config_.max_sequences; }
  sequence_state& state_of(sequence_id seq) noexcept { return sequences_[static_cast<std::size_t>(slot_of(seq))]; }
  const sequence_state& state_of(sequence_id seq) const noexcept {
    return sequences_[static_cast<std::size_t>(slot_of(seq))];
  }

  const sequence_state& live(sequence_id seq, const char* where) const {
    detail::require(seq >= 0, where, "seq", seq, "an id returned by add_sequence or fork_sequence and not removed");
    const sequence_state& s = state_of(seq);
    detail::require(s.live && static_cast<std::uint32_t>(seq / config_.max_sequences) == s.generation, where, "seq", seq,
                    "an id returned by add_sequence or fork_sequence and not removed (this one was removed, "
                    "or never handed out)");
    return s;
  }
  sequence_state& live(sequence_id seq, const char* where) {
    return const_cast<sequence_state&>(static_cast<const cache&>(*this).live(seq, where));
  }

  /// A slot with no live sequence, or `capacity_error`.
  std::int32_t free_slot(const char* where) const {
    for (std::size_t i = 0; i < sequences_.size(); ++i)
      if (!sequences_[i].live) return static_cast<std::int32_t>(i);
    throw capacity_error("max_sequences", std::string("kvmosaic: ") + where + ": all " +
                                              std::to_string(config_.max_sequences) +
                                              " sequence slots are in use; allowed: at most "
                                              "cache_config::max_sequences live sequences");
  }
  /// Makes `state` the live sequence of `slot` (cannot throw) and returns its handle.
  sequence_id activate(std::int32_t slot, sequence_state&& state) noexcept {
    sequence_state& s = sequences_[static_cast<std::size_t>(slot)];
    state.generation = s.generation;
    state.live = true;
    s = std::move(state);
    return static_cast<sequence_id>(static_cast<std::int64_t>(s.generation) * config_.max_sequences + slot);
  }

  /// Rejects a view whose extents are negative, or that has elements but no data.
  template <class T, int Rank>
  static void check_view(const char* where, const char* name, const tensor_view<T, Rank>& view) {
    bool empty = false;
    for (int d = 0; d < Rank; ++d) {
      detail::require(view.extent(d) >= 0, where, name, "an extent < 0", "extents >= 0");
      empty = empty || view.extent(d) == 0;
    }
    detail::require(empty || view.data() != nullptr, where, name, "null", "a non-null pointer to its elements");
  }

  int tail_rows(const sequence_state& s) const {
    return static_cast<int>(s.stored - static_cast<std::int64_t>(s.pages.size()) * config_.page_size);
  }
  /// Exact rows the format keeps besides the pages: the sinks and the recent window's ring, as far
  /// as the sealed tokens fill them (min(S + W, sealed tokens); none before the first seal).
  std::int64_t exact_rows_of(const sequence_state& s) const {
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
    return s.pages.empty() ? 0 : std::min<std::int64_t>(exact_rows(format_), sealed);
  }
  /// Bytes of one token's K and V across all KV heads at 16 bits: the dense reference.
  std::int64_t tail_row_bytes() const {
    return 2 * static_cast<std::int64_t>(config_.num_kv_heads) * config_.head_dim * 2;
  }

  template <class T>
  void check_rows(const char* where, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v) const {
    detail::require(k.extent(1) == config_.num_kv_heads, where, "k.extent(1) (kv heads)", k.extent(1),
                    "cache_config::num_kv_heads");
    detail::require(k.extent(2) == config_.head_dim, where, "k.extent(2) (head_dim)", k.extent(2),
                    "cache_config::head_dim");
    detail::require(v.extent(0) == k.extent(0) && v.extent(1) == k.extent(1) && v.extent(2) == k.extent(2), where,
                    "v.extents", "mismatch", "the extents of k");
    check_view(where, "k", k);
    check_view(where, "v", v);
  }

  /// Runs a backend write into freshly allocated pages. If it fails (an allocation or a CUDA
  /// error), the engine undoes what it wrote (`rollback`: the tail rows it overwrote, its pending
  /// selector updates), the pages go back to the pool and the bookkeeping is left untouched;
  /// otherwise the engine commits (`commit`, which cannot throw).
  template <class Write>
  void write_then_commit(const std::vector<page_id>& fresh, Write&& write) {
    try {
      write();
    } catch (...) {
      engine_.rollback();
      for (const page_id page : fresh) pool_.release(page);
      throw;
    }
    engine_.commit();
  }

  memory_stats pool_gauge() const {
    memory_stats m;
    m.pages_used = pool_.used_pages();
    m.pages_free = pool_.free_pages();
    return m;
  }

  cache_config config_;
  std::vector<sequence_id> planned_;  ///< the sequences of the last plan
  /// Generations a slot's handles run through before they wrap (sequence_id's comment).
  std::uint32_t generations_ = static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max() / config_.max_sequences);
  Format format_;
  Selector selector_;
  Compactor compactor_;
  page_pool pool_;
  engine_type engine_;
  std::vector<sequence_state> sequences_;
};

}  // namespace kvmosaic
// ---- end <kvmosaic/cache.hpp> ----

// ---- begin <kvmosaic/per_kv_head_cache.hpp> ----
/// \file
/// `cache<Format, select::per_kv_head<S>, Compactor, Backend>`: a cache whose KV heads keep
/// different tokens, with different budgets, and free their memory on their own. Each (sequence,
/// KV head) is a *lane*: a one-head sequence of an inner `cache<Format, S, Compactor, Backend>`
/// with `num_kv_heads = 1`, so a pool page is one head's `[K page][V page]` of P tokens and each
/// lane has its own block table, tail, scores, evictions and compactions. All lanes share the one
/// pool. A decode step runs the inner cache's kernels, unchanged, over batch x num_kv_heads lanes:
/// a [batch][num_q_heads][head_dim] query is the same memory as [batch x num_kv_heads][group]
/// [head_dim] (docs/architecture.md, "Per-KV-head eviction").
///
/// Cost against a cache of S: the same bytes per token; per step, num_kv_heads times as many
/// sequences to plan and stage (their block-table entries are as many in total: one per head page
/// instead of one per all-heads page); per write, one eviction decision per lane, ranked together
/// on backend::cuda. Memory: pool pages are head pages (`memory_stats::pages_used` and
/// `pages_free` count them), num_kv_heads x `cache_config::max_pages` of them.



namespace kvmosaic {

namespace detail {

/// Whether dims 0 and 1 of `view` collapse into one: one row, or stride(0) == extent(1) x
/// stride(1) (a contiguous tensor's).
template <class T, int Rank>
bool first_dims_collapse(const tensor_view<T, Rank>& view) noexcept {
  return view.extent(0) <= 1 || view.stride(0) == view.extent(1) * view.stride(1);
}

/// `view`, [batch][heads x per][...] with dims 0 and 1 collapsible, as [batch x heads][per][...]:
/// lane b x heads + h is head h's `per` entries of row b. Collapsible: one row, or
/// stride(0) == heads x per x stride(1) (a contiguous tensor's). Throws `invalid_argument` naming
/// `name` otherwise.
template <class T, int Rank>
tensor_view<T, Rank> rows_by_head(const tensor_view<T, Rank>& view, int heads, const char* where, const char* name) {
  static_assert(Rank == 2 || Rank == 3, "kvmosaic::detail::rows_by_head: rank 2 or 3");
  const std::int64_t per = view.extent(1) / heads;
  detail::require(first_dims_collapse(view), where, name,
                  "strides whose first two dimensions do not collapse",
                  "stride(0) == extent(1) x stride(1), as a contiguous tensor's (a per_kv_head cache reads each KV "
                  "head's rows as a row of its own)");
  std::int64_t extents[Rank], strides[Rank];
  extents[0] = view.extent(0) * heads;
  strides[0] = per * view.stride(1);
  extents[1] = per;
  strides[1] = view.stride(1);
  if constexpr (Rank == 3) {
    extents[2] = view.extent(2);
    strides[2] = view.stride(2);
  }
  return tensor_view<T, Rank>::strided(view.data(), extents, strides);
}

/// Head `head` of `view`, [rows][heads][head_dim], as [rows][1][head_dim] (a strided view).
template <class T>
tensor_view<T, 3> one_head(const tensor_view<T, 3>& view, int head) {
  const std::int64_t extents[3] = {view.extent(0), 1, view.extent(2)};
  const std::int64_t strides[3] = {view.stride(0), view.stride(1), view.stride(2)};
  return tensor_view<T, 3>::strided(view.data() + static_cast<std::ptrdiff_t>(head) * view.stride(1), extents, strides);
}

}  // namespace detail

/// A cache of `select::per_kv_head<S>` (see the file comment). Its calls are the primary cache's,
/// with a KV head named where the heads' tokens differ (`evict`, `positions`, `stored_tokens`,
/// `read`, `token_scores`, `set_budget`); the rest take and return what the primary's do.
template <class FormatArg, class S, class CompactorArg, class BackendArg>
class cache<FormatArg, select::per_kv_head<S>, CompactorArg, BackendArg> {
  using traits = selector_traits<select::per_kv_head<S>>;

 public:
  /// The inner cache: one one-head sequence per (sequence, KV head).
  using lane_cache = cache<FormatArg, S, CompactorArg, BackendArg>;
  using format_type = typename lane_cache::format_type;
  using selector_type = select::per_kv_head<S>;
  using compactor_type = typename lane_cache::compactor_type;
  using backend_type = typename lane_cache::backend_type;
  using engine_type = typename lane_cache::engine_type;

  /// `config` as for any cache (its `max_pages` counts all-heads pages: the pool holds
  /// num_kv_heads head pages for each). Throws `invalid_argument` naming the field at fault.
  explicit cache(const cache_config& config, const format_type& format = {}, const selector_type& selector = {},
                 const compactor_type& compactor = {})
      : config_(checked(config, selector)),
        selector_(selector),
        lanes_(lane_config(config_), format, selector.selector, compactor),
        heads_of_(static_cast<std::size_t>(lane_config(config_).max_sequences)) {}

  const cache_config& config() const noexcept { return config_; }
  const format_type& format() const noexcept { return lanes_.format(); }
  const selector_type& selector() const noexcept { return selector_; }
  const compactor_type& compactor() const noexcept { return lanes_.compactor(); }
  const page_pool& pool() const noexcept { return lanes_.pool(); }
  /// The engine of every lane (on backend::cuda, its stream orders every step).
  const engine_type& engine() const noexcept { return lanes_.engine(); }
  engine_type& engine() noexcept { return lanes_.engine(); }
  /// The inner cache of one-head lanes (its sequences: `lanes(seq)`).
  const lane_cache& lanes() const noexcept { return lanes_; }
  lane_cache& lanes() noexcept { return lanes_; }
  /// The lanes of `seq`, one per KV head in head order: handles of `lanes()`.
  const std::vector<sequence_id>& lanes(sequence_id seq) const { return lanes_of(seq, "cache::lanes"); }

  /// "format/selector/compactor" with parameters, for reports.
  std::string describe() const {
    return format_traits<format_type>::describe(format()) + "/" + traits::describe(selector_) + "/" +
           compactor_traits<compactor_type>::describe(compactor());
  }

  /// Starts an empty sequence: one lane per KV head, each with its head's budget. Throws
  /// `capacity_error` when max_sequences are live; all or nothing.
  sequence_id add_sequence() {
    check_slots("cache::add_sequence");
    std::vector<sequence_id> lanes;
    lanes.reserve(static_cast<std::size_t>(config_.num_kv_heads));
    try {
      for (int h = 0; h < config_.num_kv_heads; ++h) {
        lanes.push_back(lanes_.add_sequence());
        lanes_.set_budget(lanes.back(), selector_.budget_of(h));
      }
    } catch (...) {
      for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
      throw;
    }
    return adopt(std::move(lanes));
  }
  /// Ends a sequence: every lane's pages go back to the pool (shared ones when their last holder ends).
  void remove_sequence(sequence_id seq) {
    std::vector<sequence_id>& entry = heads_of_[index_of(lanes_of(seq, "cache::remove_sequence"))];
    const std::vector<sequence_id> lanes = std::move(entry);
    entry.clear();
    for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
    --live_;
  }
  /// A new sequence sharing each lane's full pages (`cache::fork_sequence`, per lane); all or nothing.
  sequence_id fork_sequence(sequence_id seq) {
    const std::vector<sequence_id> parent = lanes_of(seq, "cache::fork_sequence");
    check_slots("cache::fork_sequence");
    std::vector<sequence_id> lanes;
    lanes.reserve(parent.size());
    try {
      for (const sequence_id lane : parent) lanes.push_back(lanes_.fork_sequence(lane));
    } catch (...) {
      for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
      throw;
    }
    return adopt(std::move(lanes));
  }

  /// `cache::prefill`: `k`, `v` [tokens][num_kv_heads][head_dim]; head h goes to lane h. All or
  /// nothing: the pages every head needs are counted first (`capacity_error` when the pool lacks
  /// them), and the first head checks the input for all.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    const char* where = "cache::prefill";
    const std::vector<sequence_id>& lanes = lanes_of(seq, where);
    check_heads(where, "k", k.extent(1));
    check_heads(where, "v", v.extent(1));
    check_room(where, lanes, k.extent(0));
    for (int h = 0; h < config_.num_kv_heads; ++h)
      lanes_.prefill(lanes[static_cast<std::size_t>(h)], detail::one_head(k, h), detail::one_head(v, h));
  }
  /// `prefill` with the tokens' ids (`cache::prefill`'s overload: one per token; S reads none).
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == k.extent(0), "cache::prefill", "token_ids.size()", token_ids.size(),
                    "k.extent(0) (one id per token)");
    prefill(seq, k, v);
  }

  /// `cache::append`: one token per sequence, `k`, `v` [batch][num_kv_heads][head_dim]; all or
  /// nothing, as prefill. Every lane of the batch is written by one call of the inner cache (its
  /// evictions ranked together), or, when k's or v's first two dimensions do not collapse, one call
  /// per head.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    const char* where = "cache::append";
    check_heads(where, "k", k.extent(1));
    check_heads(where, "v", v.extent(1));
    const std::vector<sequence_id> lanes = batch_lanes(seqs, where);
    check_room(where, lanes, 1);  // the fallback below writes head by head
    if (detail::first_dims_collapse(k) && detail::first_dims_collapse(v)) {
      lanes_.append(span<const sequence_id>(lanes.data(), static_cast<std::int64_t>(lanes.size())),
                    detail::rows_by_head(k, config_.num_kv_heads, where, "k"),
                    detail::rows_by_head(v, config_.num_kv_heads, where, "v"));
      return;
    }
    std::vector<sequence_id> of_head(static_cast<std::size_t>(seqs.size()));
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      for (std::size_t b = 0; b < of_head.size(); ++b) of_head[b] = lanes[b * config_.num_kv_heads + h];
      lanes_.append(span<const sequence_id>(of_head.data(), static_cast<std::int64_t>(of_head.size())), detail::one_head(k, h),
                    detail::one_head(v, h));
    }
  }

  /// `append` with each new token's id (`cache::append`'s overload: one per sequence; S reads none).
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == seqs.size(), "cache::append", "token_ids.size()", token_ids.size(),
                    "seqs.size() (one id per sequence)");
    append(seqs, k, v);
  }

  /// `cache::plan` for `seqs`: plans their batch x num_kv_heads lanes.
  void plan(span<const sequence_id> seqs, const attend_params& params = {}) {
    std::vector<sequence_id> lanes = batch_lanes(seqs, "cache::plan");
    lanes_.plan(span<const sequence_id>(lanes.data(), static_cast<std::int64_t>(lanes.size())), params);
    planned_ = std::move(lanes);  // after the plan: a failed one leaves the last plan as it was
  }
  /// `cache::run`: q, out [batch][num_q_heads][head_dim], lse [batch][num_q_heads] (optional), whose
  /// first two dimensions collapse (a contiguous tensor's do), read as the lanes' [batch x
  /// num_kv_heads][group][...]. Throws `invalid_argument` naming the view that does not.
  template <class Q, class O>
  void run(tensor_view<Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse = {}) {
    const char* where = "cache::run";
    const std::int64_t batch = static_cast<std::int64_t>(planned_.size()) / config_.num_kv_heads;
    detail::require(q.extent(0) == batch, where, "q.extent(0) (batch)", q.extent(0), "the batch of the last plan");
    detail::require(q.extent(1) == config_.num_q_heads(), where, "q.extent(1) (query heads)", q.extent(1),
                    "num_kv_heads * group_size");
    detail::require(out.extent(0) == q.extent(0) && out.extent(1) == q.extent(1) && out.extent(2) == q.extent(2), where,
                    "out.extents", "mismatch", "the extents of q");
    detail::require(lse.extent(0) == 0 || (lse.extent(0) == batch && lse.extent(1) == q.extent(1)), where, "lse.extents",
                    "mismatch", "empty, or [batch][num_q_heads]");
    const int heads = config_.num_kv_heads;
    const tensor_view<float, 2> lane_lse =
        lse.extent(0) == 0 ? tensor_view<float, 2>{} : detail::rows_by_head(lse, heads, where, "lse");
    lanes_.run(detail::rows_by_head(q, heads, where, "q"), detail::rows_by_head(out, heads, where, "out"), lane_lse);
  }
  /// `plan` then `run`.
  template <class Q, class O>
  void attend(span<const sequence_id> seqs, tensor_view<Q, 3> q, tensor_view<O, 3> out, const attend_params& params = {}) {
    plan(seqs, params);
    run(q, out);
  }
  /// `cache::reserve_step` for batches of up to `batch` sequences (batch x num_kv_heads lanes).
  void reserve_step(std::int32_t batch, std::int64_t max_tokens) {
    detail::require(batch >= 1 && batch <= config_.max_sequences, "cache::reserve_step", "batch", batch,
                    "1 to cache_config::max_sequences");
    lanes_.reserve_step(batch * config_.num_kv_heads, max_tokens);
  }

  /// Head `head`'s budget for `seq` from its next write on (Ada-KV-style reallocation between
  /// heads); `cache::set_budget(seq, budget)` of that lane.
  void set_budget(sequence_id seq, int head, const select::token_budget& budget) {
    lanes_.set_budget(lane(seq, head, "cache::set_budget"), budget);
  }
  /// Head `head`'s budget for `seq`.
  select::token_budget budget(sequence_id seq, int head) const { return lanes_.budget(lane(seq, head, "cache::budget")); }

  /// `cache::evict` of head `head` of `seq`: its tokens at `positions` leave that head only.
  void evict(sequence_id seq, int head, span<const std::int64_t> positions) {
    lanes_.evict(lane(seq, head, "cache::evict"), positions);
  }
  /// `cache::compact` of every lane of `seq`; the reports summed.
  compaction_report compact(sequence_id seq) {
    compaction_report total;
    for (const sequence_id lane : lanes_of(seq, "cache::compact")) total += lanes_.compact(lane);
    return total;
  }
  /// `compact(seq)` of every live sequence.
  compaction_report compact() { return lanes_.compact(); }

  /// `cache::positions` of head `head`: the logical position of each of its slots (-1 evicted).
  std::vector<std::int64_t> positions(sequence_id seq, int head) const {
    return lanes_.positions(lane(seq, head, "cache::positions"));
  }
  /// Tokens `seq` has been given (every head has been given the same).
  std::int64_t length(sequence_id seq) const { return lanes_.length(lanes_of(seq, "cache::length").front()); }
  /// Slots head `head` of `seq` holds (`cache::stored_tokens`).
  std::int64_t stored_tokens(sequence_id seq, int head) const {
    return lanes_.stored_tokens(lane(seq, head, "cache::stored_tokens"));
  }
  /// `cache::read` of head `head`: k, v [stored_tokens(seq, head)][1][head_dim].
  template <class T>
  void read(sequence_id seq, int head, tensor_view<T, 3> k, tensor_view<T, 3> v) const {
    lanes_.read(lane(seq, head, "cache::read"), k, v);
  }
  /// `cache::token_scores` of head `head`: [position] for every position it has held.
  std::vector<float> token_scores(sequence_id seq, int head) const {
    return lanes_.token_scores(lane(seq, head, "cache::token_scores"));
  }
  /// select::snapkv: a snapshot of every head, each voted by its own query heads' window queries
  /// ([window][num_q_heads][head_dim], as the primary's `snapshot`). Without `adaptive`, each head
  /// keeps its own budget (`cache::snapshot` of its lane); with it, Ada-KV's allocation
  /// (`select::per_kv_head::adaptive`): the heads evict as many tokens in all as their budgets
  /// ask, chosen together by pooled vote. Returns the tokens evicted, summed over the heads.
  /// Throws `invalid_argument`, before anything changes, for queries of the wrong extents or a
  /// window longer than the sequence.
  template <class Q, class Lanes = lane_cache>
  auto snapshot(sequence_id seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f)
      -> decltype(std::declval<Lanes&>().snapshot(seq, queries, softmax_scale)) {
    const char* where = "cache::snapshot";
    const std::vector<sequence_id> lanes = lanes_of(seq, where);
    detail::require(queries.extent(1) == config_.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                    "num_kv_heads x group_size");
    if (selector_.adaptive) return adaptive_snapshot(lanes, queries, softmax_scale);
    std::int64_t evicted = 0;
    for (int h = 0; h < config_.num_kv_heads; ++h)
      evicted += lanes_.snapshot(lanes[static_cast<std::size_t>(h)], query_heads_of(queries, h), softmax_scale);
    return evicted;
  }

  /// Memory of one sequence as if it were alone: its lanes' summed (pages are head pages).
  memory_stats sequence_memory(sequence_id seq) const {
    memory_stats total;
    for (const sequence_id lane : lanes_of(seq, "cache::sequence_memory")) {
      const memory_stats m = lanes_.sequence_memory(lane);
      total.tokens += m.tokens;
      total.stored_bytes += m.stored_bytes;
      total.dense_bytes += m.dense_bytes;
      total.pages_used = m.pages_used;
      total.pages_free = m.pages_free;
    }
    total.tokens /= config_.num_kv_heads;  // a token is one row of each head: its heads' mean
    return total;
  }
  /// Memory of the whole cache (`cache::memory` of the lanes; pages are head pages). `tokens` is
  /// the mean over the heads of the tokens each stores.
  memory_stats memory() const {
    memory_stats m = lanes_.memory();
    m.tokens /= config_.num_kv_heads;
    return m;
  }

 private:
  /// Head `head`'s query heads of `queries` ([window][num_q_heads][head_dim]): [window][group]
  /// [head_dim], a strided view.
  template <class Q>
  tensor_view<const Q, 3> query_heads_of(const tensor_view<const Q, 3>& queries, int head) const {
    const std::int64_t extents[3] = {queries.extent(0), config_.group_size, queries.extent(2)};
    const std::int64_t strides[3] = {queries.stride(0), queries.stride(1), queries.stride(2)};
    return tensor_view<const Q, 3>::strided(
        queries.data() + static_cast<std::ptrdiff_t>(head) * config_.group_size * queries.stride(1), extents, strides);
  }

  /// Ada-KV's allocation over SnapKV's pooled votes (`select::per_kv_head::adaptive`). Each head h
  /// scores its candidates (live tokens after the sinks, before the window and its open tail) by
  /// its pooled votes and would evict e_h = live_h - budget_h of them; the top
  /// floor(safeguard x (candidates_h - e_h)) of each head are kept whatever the others score (the
  /// safeguard), and of all the heads' other candidates the sum of the e_h lowest, ranked
  /// together (score, then position, then head; NaN highest), are evicted; then each head
  /// compacts. Cost: each head's window votes (as its snapshot), then O(N log N) on the host for
  /// N candidates in all.
  template <class Q>
  std::int64_t adaptive_snapshot(const std::vector<sequence_id>& lanes, const tensor_view<const Q, 3>& queries,
                                 float softmax_scale) {
    const char* where = "cache::snapshot";
    const select::snapkv& s = selector_.selector;
    const std::int64_t length = lanes_.length(lanes.front());
    detail::require(queries.extent(0) == s.window, where, "queries.extent(0) (window)", queries.extent(0),
                    "select::snapkv::window");
    detail::require(s.window <= length, where, "select::snapkv::window", s.window,
                    "at most length(seq): the window's tokens must be stored");
    const std::int64_t window_start = length - s.window;
    struct candidate {
      double score;
      std::int64_t position;
      int head;
      bool operator<(const candidate& o) const noexcept {
        if (score != o.score) return score < o.score;
        return position != o.position ? position < o.position : head < o.head;
      }
    };
    std::vector<candidate> pool;  // every head's candidates but its safeguarded ones
    std::int64_t to_evict = 0;
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      const sequence_id lane = lanes[static_cast<std::size_t>(h)];
      const std::vector<double> votes = lanes_.window_votes(lane, query_heads_of(queries, h), softmax_scale, s.combine);
      const std::vector<double> score = detail::snapkv_pool(votes, window_start, 1, s.pool_kernel);
      const std::int64_t open_from = length - lanes_.stored_tokens(lane) % config_.page_size;
      const detail::snapshot_candidates c =
          detail::candidates_of(lanes_.positions(lane), sink_rows(format()), std::min(window_start, open_from));
      const auto n = static_cast<std::int64_t>(c.positions.size());
      const std::int64_t evict = std::min(n, std::max<std::int64_t>(0, c.live - lanes_.budget(lane).resolve(length)));
      const auto safe = static_cast<std::int64_t>(std::floor(selector_.safeguard * static_cast<double>(n - evict)));
      std::vector<candidate> mine;
      mine.reserve(c.positions.size());
      for (const std::int64_t p : c.positions) {
        const double x = score[static_cast<std::size_t>(p)];
        mine.push_back({std::isnan(x) ? std::numeric_limits<double>::infinity() : x, p, h});
      }
      std::sort(mine.begin(), mine.end());
      pool.insert(pool.end(), mine.begin(), mine.end() - safe);  // the top `safe` stay
      to_evict += evict;
    }
    to_evict = std::min<std::int64_t>(to_evict, static_cast<std::int64_t>(pool.size()));
    std::partial_sort(pool.begin(), pool.begin() + to_evict, pool.end());
    std::vector<std::vector<std::int64_t>> dead(lanes.size());
    for (std::int64_t i = 0; i < to_evict; ++i)
      dead[static_cast<std::size_t>(pool[static_cast<std::size_t>(i)].head)].push_back(pool[static_cast<std::size_t>(i)].position);
    for (std::size_t h = 0; h < lanes.size(); ++h) {
      if (dead[h].empty()) continue;
      lanes_.evict(lanes[h], span<const std::int64_t>(dead[h].data(), static_cast<std::int64_t>(dead[h].size())));
      lanes_.compact(lanes[h]);
    }
    return to_evict;
  }

  static const cache_config& checked(const cache_config& config, const selector_type& selector) {
    config.validate();
    traits::validate(selector, config.num_kv_heads, config.page_size);
    const std::int64_t pages = static_cast<std::int64_t>(config.max_pages) * config.num_kv_heads;
    const std::int64_t sequences = static_cast<std::int64_t>(config.max_sequences) * config.num_kv_heads;
    detail::require(pages <= limits::max_pool_pages, "cache_config", "max_pages", config.max_pages,
                    "at most limits::max_pool_pages / num_kv_heads (a per_kv_head cache's pool holds head pages)");
    detail::require(sequences <= limits::max_sequences, "cache_config", "max_sequences", config.max_sequences,
                    "at most limits::max_sequences / num_kv_heads (a per_kv_head cache has a lane per head)");
    return config;
  }
  static cache_config lane_config(const cache_config& config) {
    cache_config lane = config;
    lane.num_kv_heads = 1;
    lane.max_pages = config.max_pages * config.num_kv_heads;
    lane.max_sequences = config.max_sequences * config.num_kv_heads;
    return lane;
  }

  std::size_t index_of(const std::vector<sequence_id>& lanes) const { return static_cast<std::size_t>(lanes_.slot(lanes.front())); }
  sequence_id adopt(std::vector<sequence_id>&& lanes) noexcept {
    const sequence_id seq = lanes.front();
    heads_of_[index_of(lanes)] = std::move(lanes);
    ++live_;
    return seq;
  }
  /// The lanes of a live sequence (its handle is its head-0 lane's), or `invalid_argument`.
  const std::vector<sequence_id>& lanes_of(sequence_id seq, const char* where) const {
    const auto slots = static_cast<std::int64_t>(heads_of_.size());
    const std::vector<sequence_id>* lanes = seq >= 0 ? &heads_of_[static_cast<std::size_t>(seq % slots)] : nullptr;
    detail::require(lanes != nullptr && !lanes->empty() && lanes->front() == seq, where, "seq", seq,
                    "an id returned by add_sequence or fork_sequence and not removed");
    return *lanes;
  }
  sequence_id lane(sequence_id seq, int head, const char* where) const {
    const std::vector<sequence_id>& lanes = lanes_of(seq, where);
    detail::require(head >= 0 && head < config_.num_kv_heads, where, "head", head, "0 to num_kv_heads - 1");
    return lanes[static_cast<std::size_t>(head)];
  }
  /// The lanes of a batch, sequence-major: lane b x num_kv_heads + h is head h of seqs[b].
  std::vector<sequence_id> batch_lanes(span<const sequence_id> seqs, const char* where) const {
    std::vector<sequence_id> lanes;
    lanes.reserve(static_cast<std::size_t>(seqs.size()) * static_cast<std::size_t>(config_.num_kv_heads));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const std::vector<sequence_id>& of = lanes_of(seqs(b), where);
      lanes.insert(lanes.end(), of.begin(), of.end());
    }
    return lanes;
  }
  /// `capacity_error` when max_sequences are live.
  void check_slots(const char* where) const {
    if (live_ < config_.max_sequences) return;
    throw capacity_error("max_sequences", std::string("kvmosaic: ") + where + ": all " + std::to_string(config_.max_sequences) +
                                              " sequence slots are in use; allowed: at most cache_config::max_sequences "
                                              "live sequences");
  }
  /// `capacity_error`, before anything changes, when writing `rows` more tokens to every lane of
  /// `lanes` seals more head pages than the pool has free: lane by lane, (tail rows + rows) / P.
  void check_room(const char* where, const std::vector<sequence_id>& lanes, std::int64_t rows) const {
    const std::int64_t page = config_.page_size;
    std::int64_t needed = 0;
    for (const sequence_id l : lanes) {
      const std::int64_t tail = lanes_.stored_tokens(l) - static_cast<std::int64_t>(lanes_.pages(l).size()) * page;
      needed += (tail + std::max<std::int64_t>(rows, 0)) / page;
    }
    if (needed <= pool().free_pages()) return;
    throw capacity_error("max_pages", std::string("kvmosaic: ") + where + ": the write seals " + std::to_string(needed) +
                                          " head pages and the pool has " + std::to_string(pool().free_pages()) +
                                          " free; allowed: writes within cache_config::max_pages x num_kv_heads head pages");
  }
  void check_heads(const char* where, const char* name, std::int64_t heads) const {
    detail::require(heads == config_.num_kv_heads, where, name, heads, "num_kv_heads in dimension 1");
  }

  cache_config config_;
  selector_type selector_;
  lane_cache lanes_;
  /// By the inner slot of each sequence's head-0 lane: its lanes in head order (empty elsewhere).
  std::vector<std::vector<sequence_id>> heads_of_;
  std::vector<sequence_id> planned_;  ///< the lanes of the last plan
  std::int32_t live_ = 0;             ///< live sequences
};

}  // namespace kvmosaic
// ---- end <kvmosaic/per_kv_head_cache.hpp> ----

// ---- begin <kvmosaic/model_cache.hpp> ----
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

#include <unordered_map>


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
// ---- end <kvmosaic/model_cache.hpp> ----
// ---- end <kvmosaic/kvmosaic.hpp> ----

// ---- begin <kvmosaic/support/synthetic.hpp> ----
/// \file
/// Seeded, reproducible synthetic KV caches for tests, demos and benchmarks.
///
/// Real KV caches have a shape that compression methods rely on, and a generator that produces
/// i.i.d. gaussians would make every method look either perfect or useless. This generator
/// reproduces the statistics the source papers describe:
///
/// * Keys have a few *outlier channels* per head: channels whose magnitude is many times that of
///   the others and whose sign/mean is the same for every token (the KIVI observation that the
///   MUSTAFAR paper builds on when it prunes the key cache per token: magnitude pruning keeps the
///   outlier elements). The remaining channels are roughly gaussian around a small per-channel mean.
/// * Values have no outlier channels: every channel has about the same magnitude (MUSTAFAR's
///   "more uniform distribution" of the value cache), with a per-token scale that varies.
/// * Keys and queries are rotated with RoPE (GPT-NeoX layout: channel i pairs with i + D/2).
/// * Neighbouring tokens are correlated (a slowly drifting per-head "topic" plus a per-sentence
///   component), so pages and sentences are coherent units, which block and sentence selectors
///   (Quest-style pages, SentKVCompress sentence chunks) exploit.
/// * Attention is peaky, not flat: the first tokens are attention sinks, some tokens (boundary
///   tokens above all) are persistent heavy hitters, and every query retrieves a few regions of the
///   past plus its recent neighbourhood. The defaults give, with softmax scale 1/sqrt(head_dim),
///   tens to a few hundred effective tokens at 8K-32K context (see `test/unit/test_synthetic.cpp`).
/// * Token ids have sentence structure: sentences of varying length end in a boundary token
///   (period, question mark, ...) with a semantic weight S(b), the input of SentKVCompress's
///   sentence split (its Algorithm 2).
///
/// Reproducibility: every number is a pure function of (seed, sequence, token, head, channel) computed
/// with a counter-based hash (splitmix64 finalizer), never with `std::*_distribution`, whose output
/// is implementation-defined. A prefix or any window of a sequence therefore holds exactly the values
/// of the full sequence, and appending tokens one at a time sees the same data as a prefill. The bulk
/// per-element noise uses only integer arithmetic and one IEEE multiplication, so it is bitwise
/// identical everywhere; the few values that go through `std::log`/`std::cos`/`std::sin`/`std::exp`
/// (gaussians of the per-head structure, RoPE angles) can differ by an ulp between C libraries.
///
/// Host-only standard C++17.

#include <array>
#include <climits>


namespace kvmosaic::synthetic {

/// Shape and statistics of a synthetic KV stream. Model-like properties (which channels are outliers,
/// per-channel means and scales, sink and heavy-hitter directions, each query head's mix) depend on
/// `seed` only; the content of a sequence (tokens, topics, noise, which tokens are heavy hitters)
/// depends on `seed` and the sequence number. The defaults are tuned for head_dim 128 and give
/// realistic attention at 1K-32K context (see `generate_query` for measured entropies); queries are
/// scaled by sqrt(128 / head_dim) so that head_dim 64 and 256 give similar attention.
struct kv_config {
  /// Number of KV heads.
  int num_kv_heads = 8;
  /// Query heads per KV head (GQA group size); query head q belongs to KV head q / group_size.
  int group_size = 4;
  /// Channels per head; must be even (RoPE pairs channel i with i + head_dim / 2).
  int head_dim = 128;
  /// Root of all randomness.
  std::uint64_t seed = 0x6b766d6f73616963ULL;

  /// Key outlier channels per KV head (MUSTAFAR/KIVI: the key cache has a few channels of large,
  /// consistent magnitude). They are chosen per head as whole RoPE pairs (both channels of a pair,
  /// so RoPE keeps the magnitude in those channels) among the lower-frequency pairs; an odd count
  /// adds one channel of one more pair. 0 to head_dim.
  int outlier_channels = 4;
  /// Magnitude of the outlier channels relative to the others: their mean is about
  /// 0.75 * outlier_scale (sign fixed per channel) and their spread 0.35 * outlier_scale, against
  /// unit spread and a small mean in the other channels.
  float outlier_scale = 8.0f;
  /// RoPE base; keys and queries are rotated with angle position * rope_theta^(-2i/head_dim) on the
  /// pair (i, i + head_dim/2).
  double rope_theta = 10000.0;

  /// Attention sinks: token t < sink_tokens gets a component of per-channel RMS
  /// sink_strength / (1 + t) along the head's sink direction, which every query contains. Token 0 is
  /// the strongest sink, as in StreamingLLM-style observations.
  float sink_strength = 4.0f;
  /// Number of leading tokens that act as sinks.
  int sink_tokens = 4;
  /// Values of the sink tokens are scaled by this (sinks absorb attention but carry little content).
  float sink_value_scale = 0.25f;

  /// Heavy hitters (H2O): a token that is one gets a component along the head's heavy-hitter
  /// direction, which every query of the head contains, so it draws attention at every decode
  /// step. Its per-channel RMS is heavy_hitter_strength * (0.25 + 0.75 u), u uniform.
  float heavy_hitter_strength = 3.0f;
  /// Probability (per token and KV head) that an ordinary token is a heavy hitter.
  float heavy_hitter_rate = 1.0f / 512.0f;
  /// Probability (per token and KV head) that a boundary token (sentence end) is a heavy hitter;
  /// punctuation draws disproportionate attention in real models.
  float boundary_heavy_hitter_rate = 0.15f;

  /// Tokens between the knots of the slowly drifting per-head topic vector (linear interpolation
  /// between gaussian knots, renormalized to unit variance). Gives page-level locality.
  int topic_span = 64;
  /// Weight of the topic component in the (pre-RoPE, centred, per-channel-scaled) key.
  float topic_weight = 0.6f;
  /// Weight of the per-sentence component (constant within a sentence): sentences are coherent.
  float sentence_weight = 0.45f;
  /// Weight of the per-token noise. topic^2 + sentence^2 + noise^2 ~ 1 keeps unit channel spread.
  float noise_weight = 0.65f;
  /// Weight of the (separate) topic component in values; the rest is per-token noise.
  float value_topic_weight = 0.5f;
  /// Log-standard deviation of the per-(token, head) value scale.
  float value_token_spread = 0.25f;

  /// Retrieval targets per query head: past tokens whose (rotated, centred) key the query contains,
  /// so the query attends to them and their neighbourhood. Target 0 is shared by the query heads of
  /// a GQA group. Targets stay fixed for `query_drift` consecutive decode positions.
  int retrieval_targets = 4;
  /// Decode positions during which a query head keeps its retrieval targets.
  int query_drift = 32;
  /// Per-channel RMS of each retrieval component of the query (before the per-head mix).
  float retrieval_strength = 0.5f;
  /// Per-channel RMS of the recency component: the current position's topic and sentence, rotated
  /// to the current position, so recent tokens (same sentence, same topic) get more attention.
  float recency_strength = 1.1f;
  /// Distance scale (tokens) of the recency component: RoPE pairs turning faster than about one
  /// radian per `recency_reach` tokens are down-weighted in it, so recency covers a neighbourhood of
  /// roughly this size instead of spiking on the previous token.
  float recency_reach = 16.0f;
  /// Per-channel RMS of the sink component of the query.
  float query_sink_strength = 0.22f;
  /// Per-channel RMS of the heavy-hitter component of the query.
  float query_heavy_hitter_strength = 0.22f;
  /// Weight of the key mean (rotated to the query position) in the query: queries share the keys'
  /// outlier channels, which adds a smooth relative-position bias.
  float query_mean_weight = 0.03f;
  /// Per-channel RMS of gaussian noise in the query.
  float query_noise = 0.3f;
  /// Each query head scales each of its sink / heavy-hitter / retrieval / recency components by its
  /// own factor in [1 - head_variation, 1 + head_variation), fixed by the seed: heads differ, some
  /// leaning on sinks, others on recent or retrieved tokens.
  float head_variation = 0.15f;

  /// Vocabulary size for ordinary token ids (drawn from [100, vocab_size), small ids more often).
  /// Must exceed every boundary id (29991).
  int vocab_size = 32000;
  /// Shortest sentence in tokens, boundary token included.
  int min_sentence_len = 4;
  /// Longest sentence in tokens. Lengths are min + floor((max - min + 1) * u1 * u2), mean about
  /// min + (max - min) / 4 (~23 tokens with the defaults), skewed towards short sentences.
  int max_sentence_len = 80;
};

/// A boundary token and its semantic weight S(b) in [0, 1]: how strongly it ends a semantic unit.
/// SentKVCompress (Algorithm 2) splits at the boundary token b within +-delta of the ideal end that
/// maximizes 0.7 S(b) + 0.3 (1 - |ideal_end - b| / delta), so stronger delimiters win over closer ones.
struct boundary_token {
  /// Token id (the id of that punctuation in the 32000-token LLaMA-2 SentencePiece vocabulary).
  std::int32_t id;
  /// Semantic weight S(b).
  float weight;
};

/// The boundary tokens and their weights. SentKVCompress names periods, question marks and
/// exclamation marks as boundaries and gives per-model weights only in a figure; these weights are
/// ours: full stops strongest, then ?, !, line breaks, semicolons and colons.
inline constexpr std::array<boundary_token, 6> boundary_tokens{{
    {29889, 1.00f},  // "."
    {29973, 0.95f},  // "?"
    {29991, 0.90f},  // "!"
    {13, 0.80f},     // "\n" (<0x0A>)
    {29936, 0.60f},  // ";"
    {29901, 0.50f},  // ":"
}};

/// Comma token id: appears inside sentences, is not a boundary.
inline constexpr std::int32_t comma_token_id = 29892;

/// Whether `id` is one of `boundary_tokens`.
constexpr bool is_boundary_id(std::int32_t id) noexcept {
  for (const auto& b : boundary_tokens)
    if (b.id == id) return true;
  return false;
}

/// S(b) of token `id`: its weight in `boundary_tokens`, 0 for other tokens.
constexpr float boundary_weight(std::int32_t id) noexcept {
  for (const auto& b : boundary_tokens)
    if (b.id == id) return b.weight;
  return 0.0f;
}

/// Token ids of one sequence with sentence structure: sentences of varying length
/// (`kv_config::min_sentence_len` to `max_sentence_len`), each ending in a boundary token.
/// `is_boundary[t]` is 1 exactly where `ids[t]` is a boundary id.
struct token_stream {
  /// Token id per position.
  std::vector<std::int32_t> ids;
  /// 1 where the token ends a sentence (a boundary token), else 0.
  std::vector<std::uint8_t> is_boundary;
};

/// K and V of a window of one sequence, float, layout [token][kv_head][channel]. Tokens are indexed
/// relative to the window: local token i is sequence position `first_token + i`.
struct kv_data {
  /// Tokens in the window.
  int num_tokens = 0;
  /// KV heads.
  int num_kv_heads = 0;
  /// Channels per head.
  int head_dim = 0;
  /// Sequence position of local token 0.
  int first_token = 0;
  /// Keys (RoPE applied, unless produced by `generate_keys_pre_rope`).
  std::vector<float> k;
  /// Values.
  std::vector<float> v;

  /// Offset of (token, head, channel) in `k` and `v`.
  std::size_t index(int token, int head, int channel) const noexcept {
    return (static_cast<std::size_t>(token) * static_cast<std::size_t>(num_kv_heads) +
            static_cast<std::size_t>(head)) *
               static_cast<std::size_t>(head_dim) +
           static_cast<std::size_t>(channel);
  }
  /// Key element of local token `token`.
  float& k_at(int token, int head, int channel) noexcept { return k[index(token, head, channel)]; }
  /// Key element of local token `token`.
  float k_at(int token, int head, int channel) const noexcept { return k[index(token, head, channel)]; }
  /// Value element of local token `token`.
  float& v_at(int token, int head, int channel) noexcept { return v[index(token, head, channel)]; }
  /// Value element of local token `token`.
  float v_at(int token, int head, int channel) const noexcept { return v[index(token, head, channel)]; }
  /// The head_dim keys of (token, head), contiguous.
  float* k_row(int token, int head) noexcept { return k.data() + index(token, head, 0); }
  /// The head_dim keys of (token, head), contiguous.
  const float* k_row(int token, int head) const noexcept { return k.data() + index(token, head, 0); }
  /// The head_dim values of (token, head), contiguous.
  float* v_row(int token, int head) noexcept { return v.data() + index(token, head, 0); }
  /// The head_dim values of (token, head), contiguous.
  const float* v_row(int token, int head) const noexcept { return v.data() + index(token, head, 0); }
};

namespace detail {

/// splitmix64 increment (2^64 / golden ratio).
inline constexpr std::uint64_t golden = 0x9e3779b97f4a7c15ULL;

/// splitmix64 finalizer: a bijective 64-bit mix with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Hash of the pair (h, x); chaining it hashes a tuple (seed, stream, a, b, ...).
constexpr std::uint64_t combine(std::uint64_t h, std::uint64_t x) noexcept {
  return mix64(h ^ mix64(x + golden));
}

/// Hash of element `i` of the family keyed by `base` (the splitmix64 sequence seeded at `base`).
constexpr std::uint64_t element(std::uint64_t base, std::uint64_t i) noexcept {
  return mix64(base + (i + 1) * golden);
}

/// Independent streams of randomness, one per quantity.
enum stream : std::uint64_t {
  s_outlier = 0x5100,
  s_kmean,
  s_ksig,
  s_vmean,
  s_vsig,
  s_sink_dir,
  s_hh_dir,
  s_personality,
  s_sentence,
  s_token,
  s_ktopic,
  s_vtopic,
  s_ksentence,
  s_knoise,
  s_vnoise,
  s_vscale,
  s_heavy,
  s_target,
  s_qnoise,
};

/// Uniform double in [0, 1) from the top 53 bits of `h`: k * 2^-53, exact (no rounding anywhere).
constexpr double uniform53(std::uint64_t h) noexcept {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

/// Standard normal by Box-Muller (cosine branch) from the hash `h`; uses log/sqrt/cos.
inline double box_muller(std::uint64_t h) noexcept {
  const double u1 = 1.0 - uniform53(h);  // (0, 1], exact
  const double u2 = uniform53(mix64(h + golden));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// Cheap gaussian-like variate with mean 0 and variance ~1: the sum of the four 16-bit fields of `h`
/// (Irwin-Hall, n = 4), centred and scaled. Integer arithmetic and one multiplication, so bitwise
/// reproducible without libm; bounded by +-3.46.
constexpr double fast_normal(std::uint64_t h) noexcept {
  const std::int64_t s = static_cast<std::int64_t>((h & 0xffffu) + ((h >> 16) & 0xffffu) +
                                                   ((h >> 32) & 0xffffu) + (h >> 48));
  return static_cast<double>(s - 131070) * (1.7320508075688772 / 65536.0);
}

/// Checks `cfg` (throws `kvmosaic::invalid_argument`).
inline void validate(const kv_config& cfg, const char* where) {
  using kvmosaic::detail::require;
  require(cfg.num_kv_heads >= 1, where, "num_kv_heads", cfg.num_kv_heads, ">= 1");
  require(cfg.group_size >= 1, where, "group_size", cfg.group_size, ">= 1");
  require(cfg.head_dim >= 2 && cfg.head_dim % 2 == 0, where, "head_dim", cfg.head_dim,
          "an even number >= 2");
  require(cfg.outlier_channels >= 0 && cfg.outlier_channels <= cfg.head_dim, where,
          "outlier_channels", cfg.outlier_channels, "0 to head_dim");
  require(cfg.rope_theta > 1.0, where, "rope_theta", cfg.rope_theta, "> 1");
  require(cfg.sink_tokens >= 0, where, "sink_tokens", cfg.sink_tokens, ">= 0");
  require(cfg.topic_span >= 1, where, "topic_span", cfg.topic_span, ">= 1");
  require(cfg.retrieval_targets >= 0, where, "retrieval_targets", cfg.retrieval_targets, ">= 0");
  require(cfg.query_drift >= 1, where, "query_drift", cfg.query_drift, ">= 1");
  require(cfg.vocab_size > 29991, where, "vocab_size", cfg.vocab_size, "> 29991");
  require(cfg.min_sentence_len >= 1, where, "min_sentence_len", cfg.min_sentence_len, ">= 1");
  require(cfg.max_sentence_len >= cfg.min_sentence_len, where, "max_sentence_len",
          cfg.max_sentence_len, ">= min_sentence_len");
}

/// The seed-dependent ("model") part of the generator: per-head channel statistics and directions.
struct head_model {
  int heads = 0;                 ///< KV heads
  int dim = 0;                   ///< head_dim
  int pairs = 0;                 ///< head_dim / 2 RoPE pairs
  std::vector<double> inv_freq;  ///< [pair] RoPE angular frequency
  std::vector<double> kmu;       ///< [head][channel] key mean (large in outlier channels)
  std::vector<double> ksig;      ///< [head][channel] key spread (large in outlier channels)
  std::vector<double> vmu;       ///< [head][channel] value mean (small)
  std::vector<double> vsig;      ///< [head][channel] value spread (0.85 to 1.15)
  std::vector<double> sink_dir;  ///< [head][channel] sink direction, |x|^2 = dim
  std::vector<double> hh_dir;    ///< [head][channel] heavy-hitter direction, |x|^2 = dim
  std::vector<int> outliers;     ///< [head][i] outlier channels, ascending
  int outliers_per_head = 0;     ///< kv_config::outlier_channels
};

/// Scales `x[0, n)` so that its squared norm is n (per-element RMS 1); leaves a zero vector alone.
inline void normalize_rms(double* x, int n) noexcept {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  if (s <= 0.0) return;
  const double f = std::sqrt(static_cast<double>(n) / s);
  for (int i = 0; i < n; ++i) x[i] *= f;
}

/// Builds the model part of `cfg`.
inline head_model make_model(const kv_config& cfg) {
  head_model m;
  const int H = cfg.num_kv_heads, D = cfg.head_dim, P = D / 2;
  m.heads = H;
  m.dim = D;
  m.pairs = P;
  m.inv_freq.resize(static_cast<std::size_t>(P));
  for (int j = 0; j < P; ++j)
    m.inv_freq[static_cast<std::size_t>(j)] =
        std::pow(cfg.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
  const std::size_t HD = static_cast<std::size_t>(H) * static_cast<std::size_t>(D);
  m.kmu.assign(HD, 0.0);
  m.ksig.assign(HD, 0.0);
  m.vmu.assign(HD, 0.0);
  m.vsig.assign(HD, 0.0);
  m.sink_dir.assign(HD, 0.0);
  m.hh_dir.assign(HD, 0.0);
  m.outliers_per_head = cfg.outlier_channels;
  m.outliers.reserve(static_cast<std::size_t>(H) * static_cast<std::size_t>(cfg.outlier_channels));
  const std::uint64_t seed = cfg.seed;
  const double oscale = static_cast<double>(cfg.outlier_scale);
  std::vector<int> cand;
  std::vector<int> chosen;
  for (int h = 0; h < H; ++h) {
    const std::size_t row = static_cast<std::size_t>(h) * static_cast<std::size_t>(D);
    const std::uint64_t hk = combine(combine(seed, s_kmean), static_cast<std::uint64_t>(h));
    const std::uint64_t hs = combine(combine(seed, s_ksig), static_cast<std::uint64_t>(h));
    const std::uint64_t hvm = combine(combine(seed, s_vmean), static_cast<std::uint64_t>(h));
    const std::uint64_t hvs = combine(combine(seed, s_vsig), static_cast<std::uint64_t>(h));
    const std::uint64_t hsd = combine(combine(seed, s_sink_dir), static_cast<std::uint64_t>(h));
    const std::uint64_t hhd = combine(combine(seed, s_hh_dir), static_cast<std::uint64_t>(h));
    for (int c = 0; c < D; ++c) {
      const auto uc = static_cast<std::uint64_t>(c);
      m.kmu[row + uc] = 0.3 * box_muller(element(hk, uc));
      m.ksig[row + uc] = 0.8 + 0.4 * uniform53(element(hs, uc));
      m.vmu[row + uc] = 0.2 * box_muller(element(hvm, uc));
      m.vsig[row + uc] = 0.85 + 0.3 * uniform53(element(hvs, uc));
      m.sink_dir[row + uc] = box_muller(element(hsd, uc));
      m.hh_dir[row + uc] = box_muller(element(hhd, uc));
    }
    normalize_rms(&m.sink_dir[row], D);
    {  // make the heavy-hitter direction orthogonal to the sink direction
      double dot = 0.0;
      for (int c = 0; c < D; ++c) dot += m.hh_dir[row + static_cast<std::size_t>(c)] * m.sink_dir[row + static_cast<std::size_t>(c)];
      dot /= static_cast<double>(D);
      for (int c = 0; c < D; ++c) m.hh_dir[row + static_cast<std::size_t>(c)] -= dot * m.sink_dir[row + static_cast<std::size_t>(c)];
    }
    normalize_rms(&m.hh_dir[row], D);

    // Outlier channels: whole RoPE pairs drawn (partial Fisher-Yates) from the pairs
    // [D/4, 3D/8), i.e. the lower-frequency half but not its slowest part, so that RoPE keeps their
    // magnitude in those channels and their mean turns slowly; all pairs if that range is too small.
    const int n_out = cfg.outlier_channels;
    const int n_pairs = (n_out + 1) / 2;
    int lo = P / 2, hi = (3 * P) / 4;
    if (hi - lo < n_pairs) {
      lo = 0;
      hi = P;
    }
    cand.clear();
    for (int j = lo; j < hi; ++j) cand.push_back(j);
    const std::uint64_t ho = combine(combine(seed, s_outlier), static_cast<std::uint64_t>(h));
    chosen.clear();
    for (int i = 0; i < n_pairs; ++i) {
      const auto left = static_cast<std::uint64_t>(static_cast<int>(cand.size()) - i);
      const int pick = i + static_cast<int>(element(ho, static_cast<std::uint64_t>(i)) % left);
      std::swap(cand[static_cast<std::size_t>(i)], cand[static_cast<std::size_t>(pick)]);
      const int j = cand[static_cast<std::size_t>(i)];
      if (2 * (i + 1) <= n_out) {
        chosen.push_back(j);
        chosen.push_back(j + P);
      } else {  // odd count: one channel of the last pair
        chosen.push_back((element(ho, 1000u + static_cast<std::uint64_t>(i)) & 1u) ? j + P : j);
      }
    }
    std::sort(chosen.begin(), chosen.end());
    for (int c : chosen) {
      const auto uc = static_cast<std::uint64_t>(c);
      const std::uint64_t hc = element(ho, 2000u + uc);
      const double sign = (hc & 1u) ? 1.0 : -1.0;
      m.kmu[row + uc] = sign * 0.75 * oscale * (0.8 + 0.4 * uniform53(mix64(hc)));
      m.ksig[row + uc] = 0.35 * oscale;
      m.outliers.push_back(c);
    }
  }
  return m;
}

/// Length of sentence `s` of sequence `seq`.
inline int sentence_length(const kv_config& cfg, std::uint64_t seq, std::uint64_t s) noexcept {
  const std::uint64_t h = combine(combine(combine(cfg.seed, s_sentence), seq), s);
  const double u = uniform53(h) * uniform53(mix64(h));
  const int span = cfg.max_sentence_len - cfg.min_sentence_len + 1;
  return cfg.min_sentence_len + static_cast<int>(static_cast<double>(span) * u);
}

/// Sentence starts of one sequence, generated lazily from token 0 (sentence lengths are hashed by
/// sentence index, so walking from 0 is the only way to place a token in its sentence; it is cheap).
class sentence_map {
 public:
  sentence_map(const kv_config& cfg, std::uint64_t seq) : cfg_(&cfg), seq_(seq), starts_{0} {}

  /// Makes sure the sentence containing token `t` is known.
  void extend_to(int t) {
    while (starts_.back() <= t)
      starts_.push_back(starts_.back() +
                        sentence_length(*cfg_, seq_, static_cast<std::uint64_t>(starts_.size() - 1)));
  }
  /// Index of the sentence containing token `t` (after `extend_to(t)`).
  int sentence_of(int t) const noexcept {
    return static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), t) - starts_.begin()) -
           1;
  }
  /// First token of sentence `s` (s may be one past the last complete sentence known).
  int start(int s) const noexcept { return starts_[static_cast<std::size_t>(s)]; }

 private:
  const kv_config* cfg_;
  std::uint64_t seq_;
  std::vector<int> starts_;
};

/// Id of token `t` of sequence `seq`; `last` says whether it ends its sentence.
inline std::int32_t token_id(const kv_config& cfg, std::uint64_t seq, int t, bool last) noexcept {
  const std::uint64_t h =
      combine(combine(combine(cfg.seed, s_token), seq), static_cast<std::uint64_t>(t));
  if (last) {
    // Sentence ends: . 66%, ? 8%, ! 5%, newline 12%, ; 5%, : 4%.
    constexpr std::array<std::uint32_t, 6> cumulative{{660, 740, 790, 910, 960, 1000}};
    const auto r = static_cast<std::uint32_t>(h % 1000u);
    for (std::size_t i = 0; i < cumulative.size(); ++i)
      if (r < cumulative[i]) return boundary_tokens[i].id;
    return boundary_tokens[0].id;
  }
  if (h % 100u < 6u) return comma_token_id;
  const double u = uniform53(mix64(h));
  auto id = static_cast<std::int32_t>(100 + static_cast<int>(static_cast<double>(cfg.vocab_size - 100) *
                                                              (u * u * u)));
  if (is_boundary_id(id) || id == comma_token_id) id -= 7;  // keep ordinary ids ordinary
  return id;
}

/// Gaussian knot `knot` of the topic path of (sequence, head), written to out[0, D).
inline void topic_knot(const kv_config& cfg, std::uint64_t stream_id, std::uint64_t seq, int knot,
                       int head, double* out) noexcept {
  const std::uint64_t b = combine(combine(combine(combine(cfg.seed, stream_id), seq),
                                          static_cast<std::uint64_t>(knot)),
                                  static_cast<std::uint64_t>(head));
  for (int c = 0; c < cfg.head_dim; ++c) out[c] = box_muller(element(b, static_cast<std::uint64_t>(c)));
}

/// Per-sentence key component of (sequence, sentence, head), written to out[0, D).
inline void sentence_vector(const kv_config& cfg, std::uint64_t seq, int sentence, int head,
                            double* out) noexcept {
  const std::uint64_t b = combine(combine(combine(combine(cfg.seed, s_ksentence), seq),
                                          static_cast<std::uint64_t>(sentence)),
                                  static_cast<std::uint64_t>(head));
  for (int c = 0; c < cfg.head_dim; ++c) out[c] = fast_normal(element(b, static_cast<std::uint64_t>(c)));
}

/// Interpolation weights (a, b) of the knots around token offset r within a topic span: linear
/// interpolation renormalized so the interpolated gaussian keeps unit variance.
inline void topic_weights(int r, int span, double& a, double& b) noexcept {
  const double w = static_cast<double>(r) / static_cast<double>(span);
  const double f = 1.0 / std::sqrt((1.0 - w) * (1.0 - w) + w * w);
  a = (1.0 - w) * f;
  b = w * f;
}

/// Hash base of the key noise of (sequence, token, head); channel c uses element(base, c).
inline std::uint64_t key_noise_base(const kv_config& cfg, std::uint64_t seq, int t, int h) noexcept {
  return combine(combine(combine(combine(cfg.seed, s_knoise), seq), static_cast<std::uint64_t>(t)),
                 static_cast<std::uint64_t>(h));
}

/// Heavy-hitter strength (per-channel RMS of the heavy-hitter component) of (token, head); 0 if the
/// token is not a heavy hitter.
inline double heavy_hitter(const kv_config& cfg, std::uint64_t seq, int t, int h, bool boundary) noexcept {
  if (t < cfg.sink_tokens) return 0.0;
  const std::uint64_t x = combine(combine(combine(combine(cfg.seed, s_heavy), seq), static_cast<std::uint64_t>(t)),
                                  static_cast<std::uint64_t>(h));
  const double rate = boundary ? static_cast<double>(cfg.boundary_heavy_hitter_rate)
                               : static_cast<double>(cfg.heavy_hitter_rate);
  if (uniform53(x) >= rate) return 0.0;
  return static_cast<double>(cfg.heavy_hitter_strength) * (0.25 + 0.75 * uniform53(mix64(x)));
}

/// Sink strength (per-channel RMS of the sink component) of token t.
inline double sink_weight(const kv_config& cfg, int t) noexcept {
  return t < cfg.sink_tokens ? static_cast<double>(cfg.sink_strength) / (1.0 + static_cast<double>(t)) : 0.0;
}

/// Rotates x (D values, NeoX half-split pairs) by the angles whose cosines/sines are given per pair.
inline void rotate(double* x, const double* cs, const double* sn, int pairs) noexcept {
  for (int j = 0; j < pairs; ++j) {
    const double a = x[j], b = x[j + pairs];
    x[j] = a * cs[j] - b * sn[j];
    x[j + pairs] = a * sn[j] + b * cs[j];
  }
}

/// cos/sin of position * inv_freq[j] for every pair j.
inline void rope_angles(const head_model& m, int position, double* cs, double* sn) noexcept {
  for (int j = 0; j < m.pairs; ++j) {
    const double ang = static_cast<double>(position) * m.inv_freq[static_cast<std::size_t>(j)];
    cs[j] = std::cos(ang);
    sn[j] = std::sin(ang);
  }
}

/// One pre-RoPE key element without the sink/heavy-hitter components (shared by the bulk generator
/// and the query's retrieval targets so both compute the same number).
inline double key_element(double mu, double sig, double tw, double topic, double sw, double sent,
                          double nw, double noise) noexcept {
  return mu + sig * (tw * topic + sw * sent + nw * noise);
}

/// Generates K (rotated if `rope`, else pre-RoPE) and V for tokens [first, first + n).
inline kv_data generate(const kv_config& cfg, std::uint64_t seq, int first, int n, bool rope,
                        const char* where) {
  validate(cfg, where);
  kvmosaic::detail::require(first >= 0, where, "first_token", first, ">= 0");
  kvmosaic::detail::require(n >= 0 && n <= INT_MAX - first, where, "num_tokens", n,
                            ">= 0, first_token + num_tokens <= INT_MAX");
  const head_model m = make_model(cfg);
  const int H = cfg.num_kv_heads, D = cfg.head_dim, P = D / 2;
  const auto uD = static_cast<std::size_t>(D);
  const std::size_t HD = static_cast<std::size_t>(H) * uD;
  kv_data out;
  out.num_tokens = n;
  out.num_kv_heads = H;
  out.head_dim = D;
  out.first_token = first;
  out.k.resize(static_cast<std::size_t>(n) * HD);
  out.v.resize(static_cast<std::size_t>(n) * HD);
  if (n == 0) return out;
  const int last = first + n - 1;

  const int span = cfg.topic_span;
  const int knot0 = first / span, knot1 = last / span + 1;
  const auto nknots = static_cast<std::size_t>(knot1 - knot0 + 1);
  std::vector<double> ktopic(nknots * HD), vtopic(nknots * HD);
  for (int kk = knot0; kk <= knot1; ++kk)
    for (int h = 0; h < H; ++h) {
      const std::size_t off = static_cast<std::size_t>(kk - knot0) * HD + static_cast<std::size_t>(h) * uD;
      topic_knot(cfg, s_ktopic, seq, kk, h, &ktopic[off]);
      topic_knot(cfg, s_vtopic, seq, kk, h, &vtopic[off]);
    }
  std::vector<double> wa(static_cast<std::size_t>(span)), wb(static_cast<std::size_t>(span));
  for (int r = 0; r < span; ++r) topic_weights(r, span, wa[static_cast<std::size_t>(r)], wb[static_cast<std::size_t>(r)]);

  sentence_map sm(cfg, seq);
  sm.extend_to(last);
  int sent = sm.sentence_of(first);
  std::vector<double> svec(HD);
  for (int h = 0; h < H; ++h) sentence_vector(cfg, seq, sent, h, &svec[static_cast<std::size_t>(h) * uD]);

  const std::uint64_t vnoise_key = combine(combine(cfg.seed, s_vnoise), seq);
  const std::uint64_t vscale_key = combine(combine(cfg.seed, s_vscale), seq);
  const double tw = cfg.topic_weight, sw = cfg.sentence_weight, nw = cfg.noise_weight;
  const double vtw = cfg.value_topic_weight;
  const double vnw = std::sqrt(std::max(0.0, 1.0 - vtw * vtw));
  std::vector<double> cs(static_cast<std::size_t>(P)), sn(static_cast<std::size_t>(P));
  std::vector<double> x(uD), e(uD);

  for (int t = first; t <= last; ++t) {
    while (sm.start(sent + 1) <= t) {
      ++sent;
      for (int h = 0; h < H; ++h) sentence_vector(cfg, seq, sent, h, &svec[static_cast<std::size_t>(h) * uD]);
    }
    const bool boundary = (sm.start(sent + 1) - 1 == t);
    rope_angles(m, t, cs.data(), sn.data());
    const std::size_t kn = static_cast<std::size_t>(t / span - knot0) * HD;
    const double a = wa[static_cast<std::size_t>(t % span)], b = wb[static_cast<std::size_t>(t % span)];
    const double sink = sink_weight(cfg, t);
    for (int h = 0; h < H; ++h) {
      const std::size_t hrow = static_cast<std::size_t>(h) * uD;
      const double* ka = &ktopic[kn + hrow];
      const double* kb = &ktopic[kn + HD + hrow];
      const double* va = &vtopic[kn + hrow];
      const double* vb = &vtopic[kn + HD + hrow];
      const double* sv = &svec[hrow];
      const double* kmu = &m.kmu[hrow];
      const double* ksig = &m.ksig[hrow];
      const std::uint64_t nb = key_noise_base(cfg, seq, t, h);
      for (int c = 0; c < D; ++c) {
        const double topic = a * ka[c] + b * kb[c];
        x[static_cast<std::size_t>(c)] = key_element(kmu[c], ksig[c], tw, topic, sw, sv[c], nw,
                                                     fast_normal(element(nb, static_cast<std::uint64_t>(c))));
      }
      const double hh = heavy_hitter(cfg, seq, t, h, boundary);
      if (sink != 0.0 || hh != 0.0) {
        // Sink / heavy-hitter components live in the rotated frame (queries contain the same fixed
        // vectors, so the match does not decay with distance); the pre-RoPE key holds them
        // counter-rotated by the token's position.
        for (int c = 0; c < D; ++c)
          e[static_cast<std::size_t>(c)] = sink * m.sink_dir[hrow + static_cast<std::size_t>(c)] +
                                           hh * m.hh_dir[hrow + static_cast<std::size_t>(c)];
        for (int j = 0; j < P; ++j) {  // rotate by -t
          const double p = e[static_cast<std::size_t>(j)], q = e[static_cast<std::size_t>(j + P)];
          e[static_cast<std::size_t>(j)] = p * cs[static_cast<std::size_t>(j)] + q * sn[static_cast<std::size_t>(j)];
          e[static_cast<std::size_t>(j + P)] = -p * sn[static_cast<std::size_t>(j)] + q * cs[static_cast<std::size_t>(j)];
        }
        for (int c = 0; c < D; ++c) x[static_cast<std::size_t>(c)] += e[static_cast<std::size_t>(c)];
      }
      float* kout = out.k.data() + static_cast<std::size_t>(t - first) * HD + hrow;
      if (rope) {
        for (int j = 0; j < P; ++j) {
          const auto uj = static_cast<std::size_t>(j);
          const double p = x[uj], q = x[uj + static_cast<std::size_t>(P)];
          kout[j] = static_cast<float>(p * cs[uj] - q * sn[uj]);
          kout[j + P] = static_cast<float>(p * sn[uj] + q * cs[uj]);
        }
      } else {
        for (int c = 0; c < D; ++c) kout[c] = static_cast<float>(x[static_cast<std::size_t>(c)]);
      }

      // Values: per-(token, head) scale times (small mean + spread * (topic + noise)).
      const std::uint64_t vkey = combine(combine(vscale_key, static_cast<std::uint64_t>(t)), static_cast<std::uint64_t>(h));
      double scale = std::exp(static_cast<double>(cfg.value_token_spread) * fast_normal(vkey));
      if (t < cfg.sink_tokens) scale *= static_cast<double>(cfg.sink_value_scale);
      const std::uint64_t vb_hash =
          combine(combine(vnoise_key, static_cast<std::uint64_t>(t)), static_cast<std::uint64_t>(h));
      const double* vmu = &m.vmu[hrow];
      const double* vsig = &m.vsig[hrow];
      float* vout = out.v.data() + static_cast<std::size_t>(t - first) * HD + hrow;
      for (int c = 0; c < D; ++c) {
        const double topic = a * va[c] + b * vb[c];
        const double noise = fast_normal(element(vb_hash, static_cast<std::uint64_t>(c)));
        vout[c] = static_cast<float>(scale * (vmu[c] + vsig[c] * (vtw * topic + vnw * noise)));
      }
    }
  }
  return out;
}

}  // namespace detail

/// Token ids [0, num_tokens) of sequence `sequence`: sentences of min_sentence_len to
/// max_sentence_len tokens (mean ~23 with the defaults), each ending in a boundary token drawn from
/// `boundary_tokens` (. 66%, newline 12%, ? 8%, ! 5%, ; 5%, : 4%); inside sentences ~6% commas and
/// ordinary ids from [100, vocab_size), small (frequent) ids more likely. A prefix of a longer
/// stream equals the shorter stream.
inline token_stream generate_tokens(const kv_config& cfg, std::uint64_t sequence, int num_tokens) {
  detail::validate(cfg, "synthetic::generate_tokens");
  kvmosaic::detail::require(num_tokens >= 0, "synthetic::generate_tokens", "num_tokens", num_tokens, ">= 0");
  token_stream ts;
  ts.ids.resize(static_cast<std::size_t>(num_tokens));
  ts.is_boundary.resize(static_cast<std::size_t>(num_tokens));
  if (num_tokens == 0) return ts;
  detail::sentence_map sm(cfg, sequence);
  sm.extend_to(num_tokens - 1);
  int sent = 0;
  for (int t = 0; t < num_tokens; ++t) {
    while (sm.start(sent + 1) <= t) ++sent;
    const bool last = (sm.start(sent + 1) - 1 == t);
    const std::int32_t id = detail::token_id(cfg, sequence, t, last);
    ts.ids[static_cast<std::size_t>(t)] = id;
    ts.is_boundary[static_cast<std::size_t>(t)] = last ? 1 : 0;
  }
  return ts;
}

/// K (RoPE applied) and V of tokens [first_token, first_token + num_tokens) of sequence `sequence`,
/// bitwise equal to the same slice of a longer generation.
///
/// Pre-RoPE key of token t, head h, channel c:
///   mean[h][c] + spread[h][c] * (topic_weight * topic(t) + sentence_weight * sentence(t)
///                                + noise_weight * noise(t))
/// plus, counter-rotated by t, the sink component (t < sink_tokens) and the heavy-hitter component.
/// mean/spread are large in the outlier channels (MUSTAFAR/KIVI channel outliers), small/unit
/// elsewhere. Values: scale(t, h) * (small mean + spread in [0.85, 1.15] * (topic + noise)), no
/// outlier channels (MUSTAFAR: uniform value magnitudes).
inline kv_data generate_kv(const kv_config& cfg, std::uint64_t sequence, int first_token, int num_tokens) {
  return detail::generate(cfg, sequence, first_token, num_tokens, true, "synthetic::generate_kv");
}

/// K (RoPE applied) and V of tokens [0, num_tokens) of sequence `sequence`.
inline kv_data generate_kv(const kv_config& cfg, std::uint64_t sequence, int num_tokens) {
  return generate_kv(cfg, sequence, 0, num_tokens);
}

/// Like `generate_kv`, but `k` holds the keys before RoPE (for checking rotations: each pair
/// (i, i + head_dim/2) of `generate_kv`'s key has the norm of the same pair here). `v` is identical.
inline kv_data generate_keys_pre_rope(const kv_config& cfg, std::uint64_t sequence, int first_token,
                                      int num_tokens) {
  return detail::generate(cfg, sequence, first_token, num_tokens, false, "synthetic::generate_keys_pre_rope");
}

/// The key outlier channels of KV head `head`, ascending (`outlier_channels` of them).
inline std::vector<int> outlier_channel_list(const kv_config& cfg, int head) {
  detail::validate(cfg, "synthetic::outlier_channel_list");
  kvmosaic::detail::require(head >= 0 && head < cfg.num_kv_heads, "synthetic::outlier_channel_list", "head",
                            head, "0 to num_kv_heads - 1");
  const detail::head_model m = detail::make_model(cfg);
  const auto per = static_cast<std::size_t>(m.outliers_per_head);
  return std::vector<int>(m.outliers.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(head)),
                          m.outliers.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(head + 1)));
}

/// Applies RoPE in place to `x` (head_dim values, GPT-NeoX half-split pairs (i, i + head_dim/2)) at
/// `position` with base `cfg.rope_theta`: the rotation the generator applies to keys and queries
/// (same angles, computed in double, rounded to float once).
inline void apply_rope(const kv_config& cfg, int position, float* x) {
  detail::validate(cfg, "synthetic::apply_rope");
  const int D = cfg.head_dim, P = D / 2;
  std::vector<double> y(static_cast<std::size_t>(D));
  for (int c = 0; c < D; ++c) y[static_cast<std::size_t>(c)] = static_cast<double>(x[c]);
  for (int j = 0; j < P; ++j) {
    const double ang = static_cast<double>(position) *
                       std::pow(cfg.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
    const double cs = std::cos(ang), sn = std::sin(ang);
    const double a = y[static_cast<std::size_t>(j)], b = y[static_cast<std::size_t>(j + P)];
    y[static_cast<std::size_t>(j)] = a * cs - b * sn;
    y[static_cast<std::size_t>(j + P)] = a * sn + b * cs;
  }
  for (int c = 0; c < D; ++c) x[c] = static_cast<float>(y[static_cast<std::size_t>(c)]);
}

/// Softmax scale the statistics are tuned for: 1 / sqrt(head_dim).
inline double softmax_scale(const kv_config& cfg) noexcept {
  return 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
}

/// Queries of the decode step at `position` (the position of the token being decoded; it attends to
/// the cached tokens [0, position), optionally plus itself), all num_kv_heads * group_size query
/// heads, layout [q_head][channel] with q_head = kv_head * group_size + g. RoPE at `position`.
///
/// Each query head mixes, with per-head factors in [1 - head_variation, 1 + head_variation) fixed by
/// the seed (some heads lean on sinks, others on retrieval or recency):
/// * the head's sink and heavy-hitter directions (fixed in the rotated frame, projected out of
///   everything else): sinks and heavy hitters get high scores at every step;
/// * `retrieval_targets` keys of past tokens, centred and divided by the per-channel key variance
///   (a matched filter, so outlier channels do not swamp the match) and rotated to their own
///   positions. Even-numbered targets are uniform over the past, odd-numbered ones lie 128 to 2176
///   tokens back; all stay fixed for `query_drift` steps. The query retrieves those tokens and,
///   through the topic/sentence correlation, their neighbourhood (a few pages, a sentence);
/// * the topic and sentence of `position` (slow RoPE pairs weighted up, see `recency_reach`)
///   rotated to `position`: recency bias over the current sentence and the last tens of tokens;
/// * a little of the key mean and gaussian noise.
/// Everything is scaled by sqrt(128 / head_dim).
///
/// With the defaults (D = 128, 8 KV heads x 4) the mean attention entropy over query heads at
/// position 8192 is about 3.5-3.8 nats (30-45 effective tokens; single heads 4 to ~700), at 32768
/// about 4.7-5.4 nats (110-220 effective tokens); top-256 tokens hold ~90% (8K) / ~80% (32K) of the
/// mass, the first 4 tokens 5-20%, heavy hitters a large share of the rest.
inline std::vector<float> generate_query(const kv_config& cfg, std::uint64_t sequence, int position) {
  const char* where = "synthetic::generate_query";
  detail::validate(cfg, where);
  kvmosaic::detail::require(position >= 0, where, "position", position, ">= 0");
  using namespace detail;
  const head_model m = make_model(cfg);
  const int H = cfg.num_kv_heads, G = cfg.group_size, D = cfg.head_dim, P = D / 2;
  const auto uD = static_cast<std::size_t>(D);
  const int span = cfg.topic_span;
  const double tw = cfg.topic_weight, sw = cfg.sentence_weight, nw = cfg.noise_weight;
  const double qscale = std::sqrt(128.0 / static_cast<double>(D));
  std::vector<float> q(static_cast<std::size_t>(H) * static_cast<std::size_t>(G) * uD);

  sentence_map sm(cfg, sequence);
  sm.extend_to(position);
  std::vector<double> cs_p(static_cast<std::size_t>(P)), sn_p(static_cast<std::size_t>(P));
  std::vector<double> cs_t(static_cast<std::size_t>(P)), sn_t(static_cast<std::size_t>(P));
  rope_angles(m, position, cs_p.data(), sn_p.data());
  std::vector<double> ka(uD), kb(uD), sv(uD), rec(uD), mean(uD), acc(uD), tmp(uD);

  // Retrieval targets: epoch-based so they stay put for query_drift steps.
  const int epoch = position / cfg.query_drift;
  const int p0 = epoch * cfg.query_drift;
  const int range = p0 > 0 ? p0 : position;
  const std::uint64_t tkey = combine(combine(cfg.seed, s_target), sequence);
  constexpr int recent_gap = 128, recent_window = 2048;  // "recent" targets: [range-2176, range-128)
  const double recency_reach = static_cast<double>(cfg.recency_reach);

  for (int h = 0; h < H; ++h) {
    const std::size_t hrow = static_cast<std::size_t>(h) * uD;
    // Recency: topic and sentence component of the current position, rotated to it.
    {
      double a = 0, b = 0;
      topic_weights(position % span, span, a, b);
      topic_knot(cfg, s_ktopic, sequence, position / span, h, ka.data());
      topic_knot(cfg, s_ktopic, sequence, position / span + 1, h, kb.data());
      sentence_vector(cfg, sequence, sm.sentence_of(position), h, sv.data());
      for (int c = 0; c < D; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        rec[uc] = (tw * (a * ka[uc] + b * kb[uc]) + sw * sv[uc]) / m.ksig[hrow + uc];
      }
      // Down-weight the fast-rotating pairs: a match through them dies within a few tokens, which
      // would make recency a single-token spike; the slow pairs carry the neighbourhood.
      for (int j = 0; j < P; ++j) {
        const double w = 1.0 / (1.0 + recency_reach * m.inv_freq[static_cast<std::size_t>(j)]);
        rec[static_cast<std::size_t>(j)] *= w;
        rec[static_cast<std::size_t>(j + P)] *= w;
      }
      normalize_rms(rec.data(), D);
      rotate(rec.data(), cs_p.data(), sn_p.data(), P);
      for (int c = 0; c < D; ++c) mean[static_cast<std::size_t>(c)] = m.kmu[hrow + static_cast<std::size_t>(c)];
      rotate(mean.data(), cs_p.data(), sn_p.data(), P);
    }
    for (int g = 0; g < G; ++g) {
      const int qh = h * G + g;
      const std::uint64_t pers = combine(combine(cfg.seed, s_personality), static_cast<std::uint64_t>(qh));
      const double hv = static_cast<double>(cfg.head_variation);
      const double f_sink = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 0));
      const double f_hh = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 1));
      const double f_ret = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 2));
      const double f_rec = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 3));
      const double a_sink = cfg.query_sink_strength * f_sink, a_hh = cfg.query_heavy_hitter_strength * f_hh;
      const double a_rec = cfg.recency_strength * f_rec;
      for (int c = 0; c < D; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        acc[uc] = a_rec * rec[uc] + static_cast<double>(cfg.query_mean_weight) * mean[uc];
      }
      // Noise, rotated to the position.
      const std::uint64_t nb = combine(combine(combine(combine(cfg.seed, s_qnoise), sequence),
                                               static_cast<std::uint64_t>(position)),
                                       static_cast<std::uint64_t>(qh));
      for (int c = 0; c < D; ++c)
        tmp[static_cast<std::size_t>(c)] =
            box_muller(element(nb, static_cast<std::uint64_t>(c))) / m.ksig[hrow + static_cast<std::size_t>(c)];
      rotate(tmp.data(), cs_p.data(), sn_p.data(), P);
      for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += static_cast<double>(cfg.query_noise) * tmp[static_cast<std::size_t>(c)];
      // Retrieval targets.
      if (range > 0) {
        for (int r = 0; r < cfg.retrieval_targets; ++r) {
          const std::uint64_t th = r == 0 ? combine(combine(combine(tkey, static_cast<std::uint64_t>(h)), static_cast<std::uint64_t>(epoch)), 0u)
                                          : combine(combine(combine(tkey, (std::uint64_t{1} << 32) + static_cast<std::uint64_t>(qh)),
                                                            static_cast<std::uint64_t>(epoch)),
                                                    static_cast<std::uint64_t>(r));
          const double u = uniform53(th);
          int t;
          if (r % 2 == 0 || range <= 2 * recent_gap) {  // anywhere in the past
            t = static_cast<int>(u * static_cast<double>(range));
          } else {  // the recent past, beyond the reach of the recency component
            const int window = std::min(range - recent_gap, recent_window);
            t = range - recent_gap - 1 - static_cast<int>(u * static_cast<double>(window));
          }
          const double weight = cfg.retrieval_strength * f_ret * (0.8 + 0.4 * uniform53(mix64(th))) *
                                std::max(0.25, 1.0 - 0.15 * r);
          double a = 0, b = 0;
          topic_weights(t % span, span, a, b);
          topic_knot(cfg, s_ktopic, sequence, t / span, h, ka.data());
          topic_knot(cfg, s_ktopic, sequence, t / span + 1, h, kb.data());
          sentence_vector(cfg, sequence, sm.sentence_of(t), h, sv.data());
          const std::uint64_t kn = key_noise_base(cfg, sequence, t, h);
          for (int c = 0; c < D; ++c) {
            const auto uc = static_cast<std::size_t>(c);
            const double topic = a * ka[uc] + b * kb[uc];
            // Matched filter: the centred key divided by its per-channel variance (the key is
            // mean + ksig * z, so this is z / ksig); outlier channels weigh less.
            tmp[uc] = key_element(0.0, 1.0, tw, topic, sw, sv[uc], nw,
                                  fast_normal(element(kn, static_cast<std::uint64_t>(c)))) /
                      m.ksig[hrow + uc];
          }
          normalize_rms(tmp.data(), D);
          rope_angles(m, t, cs_t.data(), sn_t.data());
          rotate(tmp.data(), cs_t.data(), sn_t.data(), P);
          for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += weight * tmp[static_cast<std::size_t>(c)];
        }
      }
      // Sinks and heavy hitters: project those directions out of the rest and add them with their
      // own weights, so their scores do not depend on chance overlaps with the other components.
      const double* sd = &m.sink_dir[hrow];
      const double* hd = &m.hh_dir[hrow];
      double ds = 0.0, dh = 0.0;
      for (int c = 0; c < D; ++c) {
        ds += acc[static_cast<std::size_t>(c)] * sd[c];
        dh += acc[static_cast<std::size_t>(c)] * hd[c];
      }
      ds = a_sink - ds / static_cast<double>(D);
      dh = a_hh - dh / static_cast<double>(D);
      for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += ds * sd[c] + dh * hd[c];
      float* qo = &q[static_cast<std::size_t>(qh) * uD];
      for (int c = 0; c < D; ++c) qo[c] = static_cast<float>(qscale * acc[static_cast<std::size_t>(c)]);
    }
  }
  return q;
}

}  // namespace kvmosaic::synthetic
// ---- end <kvmosaic/support/synthetic.hpp> ----
