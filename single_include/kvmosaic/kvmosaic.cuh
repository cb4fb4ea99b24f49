// SPDX-License-Identifier: Apache-2.0
//
// single_include/kvmosaic/kvmosaic.cuh: kvmosaic as one file.
// kvmosaic with its CUDA part: <kvmosaic/kvmosaic.cuh> (the host part, the CUDA backend and its
// kernels) and <kvmosaic/support/synthetic.hpp>. Needs nvcc (C++17; the CUDA toolkit's CCCL) and
// Eigen 3.3 or newer. Stands alone: include it instead of kvmosaic.hpp, never with it.
//
// GENERATED FILE: do not edit. Written by scripts/amalgamate.py from the headers in include/
// (each kvmosaic header inlined once, in dependency order); after changing include/, run
//     python3 scripts/amalgamate.py
// and commit the result (CTest single_include_up_to_date checks that it is current).
#pragma once

// ---- begin <kvmosaic/kvmosaic.cuh> ----
/// \file
/// kvmosaic with its CUDA part. Include from a `.cu` file compiled by nvcc; it brings the whole host
/// part (<kvmosaic/kvmosaic.hpp>) and the device-side pieces (the 16-bit types' device conversions,
/// the online-softmax state in device code, the CUDA error check).

#if !defined(__CUDACC__)
#  error "kvmosaic/kvmosaic.cuh needs a CUDA compiler (nvcc); host-only code includes kvmosaic/kvmosaic.hpp"
#endif

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

/// The basis of rows x ([n][head_dim]): the first `kept` eigenvectors of sum_t x_t x_t^T (fp64),
/// by decreasing eigenvalue, each with its largest-magnitude component positive; [head_dim][kept]
/// row-major. Non-finite input or n = 0: the first `kept` columns of the identity.
/// A template (Float is float at every call), as are `packed_search` and `plan_segment`, so that
/// Eigen's eigensolver and products are instantiated only in the units that encode this format,
/// not in every unit that includes the library.
template <class Float>
std::vector<float> packed_basis(const Float* rows, std::int64_t n, int head_dim, int kept) {
  using real_matrix = Eigen::Matrix<decltype(Float{} * 1.0), Eigen::Dynamic, Eigen::Dynamic>;  // fp64
  std::vector<float> basis(static_cast<std::size_t>(head_dim) * kept, 0.0f);
  real_matrix covariance = real_matrix::Zero(head_dim, head_dim);
  if (n > 0) {
    const Eigen::Map<const Eigen::Matrix<Float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> x(rows, n, head_dim);
    covariance.template selfadjointView<Eigen::Lower>().rankUpdate(x.template cast<double>().transpose());
    covariance = covariance.template selfadjointView<Eigen::Lower>();
  }
  if (n == 0 || !covariance.allFinite()) {
    for (int j = 0; j < kept; ++j) basis[static_cast<std::size_t>(j) * kept + j] = 1.0f;
    return basis;
  }
  const Eigen::SelfAdjointEigenSolver<real_matrix> solver(covariance);
  for (int j = 0; j < kept; ++j) {
    Eigen::Matrix<double, Eigen::Dynamic, 1> column = solver.eigenvectors().col(head_dim - 1 - j);  // ascending eigenvalues
    Eigen::Index largest = 0;
    column.cwiseAbs().maxCoeff(&largest);
    if (column(largest) < 0) column = -column;
    for (int c = 0; c < head_dim; ++c) basis[static_cast<std::size_t>(c) * kept + j] = static_cast<float>(column(c));
  }
  return basis;
}

/// The groups a record keeps: of the kept / g groups of y ([kept]), the r / g of largest energy
/// (ties: the lower group), in increasing order, into `chosen`.
inline void packed_choose_groups(const float* y, int kept, const packed_strategy& s, std::vector<int>& order,
                                 std::vector<float>& energy, std::vector<int>& chosen) {
  const int groups = kept / s.group, keep = s.retained / s.group;
  energy.assign(static_cast<std::size_t>(groups), 0.0f);
  for (int j = 0; j < groups; ++j)
    for (int i = 0; i < s.group; ++i) {
      const float value = y[j * s.group + i];
      energy[static_cast<std::size_t>(j)] += value * value;
    }
  order.resize(static_cast<std::size_t>(groups));
  std::iota(order.begin(), order.end(), 0);
  const auto greater = [&](int a, int b) {
    const float ea = energy[static_cast<std::size_t>(a)], eb = energy[static_cast<std::size_t>(b)];
    // NaN ranks first (a record keeps what it cannot judge), then energy, then the lower group.
    if (std::isnan(ea) != std::isnan(eb)) return std::isnan(ea);
    return ea > eb || (!(ea < eb) && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), greater);
  chosen.assign(order.begin(), order.begin() + keep);
  std::sort(chosen.begin(), chosen.end());
}

/// Relative squared error of `candidate` over rotated rows y ([n][kept]) of rows whose squared
/// norms sum to `total` (the truncated energy counts as lost).
inline double packed_loss(const std::vector<float>& y, std::int64_t n, int kept, double total, const packed_strategy& candidate) {
  if (!(total > 0)) return 0.0;
  std::vector<int> order, chosen;
  std::vector<float> energy;
  double stored = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    const float* row = y.data() + static_cast<std::size_t>(t) * kept;
    packed_choose_groups(row, kept, candidate, order, energy, chosen);
    for (const int j : chosen) stored += energy[static_cast<std::size_t>(j)];
  }
  return std::max(0.0, (total - stored) / total);
}

/// The strategies `strategy::search` tries, in the order it tries them: rate first (87.5%, 75%,
/// 62.5% compression: 1/8, 2/8, 3/8 of head_dim retained, none above the slot's r), then g = 4,
/// 2, 1 (a g that does not divide kept and r is skipped).
inline std::vector<packed_strategy> packed_candidates(const packed_geometry& g) {
  std::vector<packed_strategy> candidates;
  for (const int eighths : {1, 2, 3}) {
    const int r = g.head_dim * eighths / 8;
    if (r > g.retained) continue;
    for (const int group : {4, 2, 1})
      if (g.kept % group == 0 && r % group == 0) candidates.push_back({r, group});
  }
  return candidates;
}

/// The strategy of one K or V matrix of a segment: `strategy::fixed`'s, or the first candidate
/// whose loss is at most `threshold`, else the slot's (r, g = 1).
template <class Float>
packed_strategy packed_search(const format::packed_bitmap& f, const packed_geometry& g, const Float* rows,
                              std::int64_t n, const std::vector<float>& basis) {
  if (f.mode == format::strategy::fixed) return {g.retained, f.group};
  const packed_strategy fallback{g.retained, 1};
  if (n == 0) return fallback;
  using row_major = Eigen::Matrix<Float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const row_major> x(rows, n, g.head_dim);
  const Eigen::Map<const row_major> b(basis.data(), g.head_dim, g.kept);
  std::vector<float> y(static_cast<std::size_t>(n) * g.kept);
  Eigen::Map<row_major>(y.data(), n, g.kept).noalias() = x * b;
  const double total = x.template cast<double>().squaredNorm();
  if (!std::isfinite(total)) return fallback;
  for (const packed_strategy& candidate : packed_candidates(g))
    if (packed_loss(y, n, g.kept, total, candidate) <= f.loss_threshold) return candidate;
  return fallback;
}

/// The mean-key block size of a segment's K rows: the largest of 16, 8, 4 whose intra-block
/// variance (mean over the blocks' tokens of ||k_t - mean of its block||^2), relative to the mean
/// ||k_t||^2, is at most `threshold` (4 when none; 16 for fewer than 4 rows or a zero segment).
inline int packed_block_tokens(const float* rows, std::int64_t n, int head_dim, float threshold) {
  double norm = 0;
  for (std::int64_t i = 0; i < n * head_dim; ++i) norm += static_cast<double>(rows[i]) * rows[i];
  if (n < 4 || !(norm > 0) || !std::isfinite(norm)) return 16;
  norm /= static_cast<double>(n);
  for (const int b : {16, 8, 4}) {
    double variance = 0;
    std::int64_t counted = 0;
    std::vector<double> mean(static_cast<std::size_t>(head_dim));
    for (std::int64_t first = 0; first + b <= n; first += b) {
      std::fill(mean.begin(), mean.end(), 0.0);
      for (int t = 0; t < b; ++t)
        for (int c = 0; c < head_dim; ++c) mean[static_cast<std::size_t>(c)] += rows[(first + t) * head_dim + c];
      for (double& m : mean) m /= b;
      for (int t = 0; t < b; ++t)
        for (int c = 0; c < head_dim; ++c) {
          const double e = rows[(first + t) * head_dim + c] - mean[static_cast<std::size_t>(c)];
          variance += e * e;
        }
      counted += b;
    }
    if (counted > 0 && variance / static_cast<double>(counted) / norm <= threshold) return b;
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
  /// to): bases, strategies (searched or fixed) and mean-key block size. Cost: 2 covariances
  /// (n x head_dim^2), 2 eigendecompositions, and with `strategy::search` up to 9 candidate
  /// passes over the n rotated rows.
  template <class Float>  // float: a template only to defer Eigen's instantiation (detail::packed_basis)
  static segment plan_segment(const format_type& f, const page_shape& shape, const Float* k, const Float* v, std::int64_t n) {
    const detail::packed_geometry g = detail::packed_geometry::of(f, shape);
    segment s;
    s.kept = g.kept;
    for (int which = 0; which < 2; ++which) {
      const Float* rows = which == 0 ? k : v;
      s.basis[which] = detail::packed_basis(rows, n, shape.head_dim, g.kept);
      s.strategy[which] = detail::packed_search(f, g, rows, n, s.basis[which]);
    }
    s.block_tokens = detail::packed_block_tokens(k, n, shape.head_dim, f.block_variance_threshold);
    return s;
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
/// the CUDA scoring kernel (one warp per span: lane l sums its head_dim / 32 contiguous channels
/// in turn, read with one vector load per bound row, then a butterfly over the 32 lanes) round
/// identically: both backends select the same spans.



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

/// Quest's upper bound of q . k over keys k with lo[c] <= k[c] <= hi[c]:
///   sum_c max(q[c] * hi[c], q[c] * lo[c]) = sum_c q[c] * (q[c] >= 0 ? hi[c] : lo[c]),
/// computed as the right-hand side (one product per channel: rounding is monotone, so for finite
/// values the product of the bound chosen by q's sign is exactly the larger rounded product),
/// in the canonical order: lane l sums its channels l * w .. (l + 1) * w - 1 in turn, w = head_dim
/// / 32 (fp32, no fused multiply-add), then lanes combine by a butterfly (offsets 16, 8, 4, 2, 1).
/// `load(c)` returns the pair (lo[c], hi[c]) as floats. Cost: head_dim multiplies and adds.
template <class Load>
inline float span_score(const float* q, int head_dim, Load&& load) {
  float lane[span_score_lanes];
  const int width = head_dim / span_score_lanes;
  for (int l = 0; l < span_score_lanes; ++l) {
    float s = 0.0f;
    for (int c = l * width; c < (l + 1) * width; ++c) {
      const auto bounds = load(c);
      // fl32(q x), exactly (the double product is exact), and out of reach of a contraction
      // into a fused multiply-add, which would change the order the device follows.
      const float product = static_cast<float>(static_cast<double>(q[c]) * (q[c] >= 0.0f ? bounds.second : bounds.first));
      s = s + product;
    }
    lane[l] = s;
  }
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

namespace detail {

/// One sequence's token scores, by logical position: [position][num_kv_heads] fp32, zero until a
/// step reads the token. Evicted positions keep their last value and are never read again. Cost:
/// 4 bytes per token and KV head (counted by the selector's `extra_bytes`).
struct token_score_buffer {
  std::vector<float> values;
  int heads = 0;
  std::int64_t scored_tokens = 0;  ///< tokens the sequence held at its last step with scores

  std::int64_t tokens() const noexcept {
    return heads > 0 ? static_cast<std::int64_t>(values.size()) / heads : 0;
  }
  float at(std::int64_t position, int head) const noexcept {
    return values[static_cast<std::size_t>(position) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(head)];
  }
  /// Room for `tokens` positions of `num_heads` heads (growing geometrically: appends cost
  /// amortized O(1)); may throw (allocation), changes no score.
  void reserve(std::int64_t tokens, int num_heads) {
    const std::size_t needed = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (needed > values.capacity()) values.reserve(std::max(needed, 2 * values.capacity()));
  }
  /// Grows to `tokens` positions (new ones 0) within the room `reserve` made: cannot throw.
  void grow_to(std::int64_t tokens, int num_heads) noexcept {
    heads = num_heads;
    const std::size_t size = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (size > values.size()) values.resize(size, 0.0f);  // capacity reserved: no allocation
  }
  /// The score of `position` for the eviction decision of one slot layout shared by every KV
  /// head: the sum over the heads (their mean, up to a constant factor that no ranking sees).
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
/// every attend step, and the compaction cadence of `select::streaming`. Each selector adds its
/// description and its `evictions`.



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
/// whose state is `select::scored_state`. Cost per write: the buffer grows by 4 bytes per token
/// and KV head (amortized O(1)); per step, the attend path writes the scores of the tokens it reads.
template <class S, score_use Use>
struct scored_eviction_hooks {
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr score_use token_scores = Use;
  static int bounds_block_tokens(const S&, int) noexcept { return 0; }

  using sequence_state = select::scored_state;
  struct update {
    std::int64_t added;  ///< tokens the write adds to the sequence
    int heads;
  };
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class T>
  static update stage(const S&, const selector_shape& shape, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t /*first row*/, std::int64_t n) noexcept {
    return {n, shape.num_kv_heads};
  }
  static void reserve(sequence_state& state, const update& u) {
    state.scores.reserve(state.scores.tokens() + u.added, u.heads);
  }
  static void commit(sequence_state& state, update& u) noexcept {
    state.scores.grow_to(state.scores.tokens() + u.added, u.heads);
  }
  template <bool OnDevice, class Engine, class T>
  static void write(Engine&, std::int32_t, const update&, const tensor_view<const T, 3>&, std::int64_t, std::int64_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void fork(Engine&, std::int32_t, std::int32_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void release(Engine&, std::int32_t) noexcept {}
  /// The score buffer: 4 bytes per token and KV head.
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state& state) noexcept {
    return static_cast<std::int64_t>(state.scores.values.size() * sizeof(float));
  }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  static group_combine score_combine(const S& s) noexcept { return s.combine; }
  static token_score_buffer& scores(sequence_state& state) noexcept { return state.scores; }
  static const token_score_buffer& scores(const sequence_state& state) noexcept { return state.scores; }

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
/// as TOVA's layer-wise policy averages its heads) are evicted; every `compact_every` tokens
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
  /// The positions to evict now: the lowest-scored live sealed tokens that a step has read, as
  /// many as the stored tokens exceed the budget (fewer when there are not that many).
  static std::vector<std::int64_t> evictions(const select::tova& s, sequence_state& state, std::int64_t length,
                                             std::int64_t open_from, const eviction_view& live) {
    const std::int64_t keep = s.budget.resolve(length);
    if (live.stored <= keep) return {};
    return detail::lowest_scored(state.scores, live.evictable(std::min(open_from, state.scores.scored_tokens)),
                                 live.stored - keep);
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
/// pool page holds every head of its tokens, so only a token every head drops frees memory:
/// docs/architecture.md, "Per-KV-head eviction"); tokens leave in batches after a write, not one
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
  /// The positions to evict now: of the live sealed tokens before the recent window that a step
  /// has read, the lowest-scored, as many as the stored tokens exceed the budget (fewer when there
  /// are not that many candidates).
  static std::vector<std::int64_t> evictions(const select::h2o& s, sequence_state& state, std::int64_t length,
                                             std::int64_t open_from, const eviction_view& live) {
    const std::int64_t keep = s.budget.resolve(length);
    if (live.stored <= keep) return {};
    const std::int64_t recent_from = length - recent_tokens(s, keep);
    const std::int64_t before = std::min({open_from, recent_from, state.scores.scored_tokens});
    return detail::lowest_scored(state.scores, live.evictable(before), live.stored - keep);
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
/// head; the group's query heads are combined by `combine` (sum by default) where the paper has
/// one query head per KV head; the budget counts the sinks and the tail.
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
      const std::int64_t stored = cache.stored_tokens(seq);
      const std::vector<std::int64_t> positions = cache.positions(seq);
      const std::int64_t window_start = length - s.window;
      const std::vector<double> score = detail::snapkv_pool(cache.window_votes(seq, queries, softmax_scale, s.combine),
                                                            window_start, c.num_kv_heads, s.pool_kernel);
      // Candidates: live sealed tokens after the sinks and before the window and the open tail.
      const std::int64_t open_from = length - stored % c.page_size;
      const std::int64_t before = std::min(window_start, open_from);
      const std::int64_t first = kvmosaic::sink_rows(cache.format());
      std::int64_t live = 0;
      std::vector<std::int64_t> candidates;
      for (const std::int64_t p : positions) {
        if (p < 0) continue;
        ++live;
        if (p >= first && p < before) candidates.push_back(p);
      }
      std::sort(candidates.begin(), candidates.end());
      const std::int64_t keep = s.budget.resolve(length);
      if (live <= keep) return 0;
      const std::vector<std::int64_t> dead = detail::lowest_ranked(
          candidates, live - keep, [&score](std::int64_t p) { return score[static_cast<std::size_t>(p)]; });
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
/// `select::mean_keys`'s mean key row, per KV head, in the storage dtype.
struct bounds_geometry {
  bounds_geometry(const engine_shape& shape, int block, block_summary kind = block_summary::bounds)
      : block_tokens(block),
        blocks_per_page(block > 0 ? shape.page_size / block : 0),
        summary(kind),
        rows_per_block(summary_rows(kind)),
        row_bytes(static_cast<std::size_t>(shape.head_dim) * size_of(shape.storage)),
        head_bytes(static_cast<std::size_t>(blocks_per_page) * rows_per_block * row_bytes),
        page_bytes(static_cast<std::size_t>(shape.num_kv_heads) * head_bytes) {}
  int block_tokens;        ///< 0: no summaries kept
  int blocks_per_page;
  block_summary summary;
  int rows_per_block;      ///< 2 (lo row, hi row) or 1 (mean row)
  std::size_t row_bytes;   ///< one row of head_dim values
  std::size_t head_bytes;  ///< the summaries of one page of one KV head: [blocks][rows_per_block rows]
  std::size_t page_bytes;  ///< the summaries of one page (every KV head): what a page costs on top
  std::size_t offset(page_id page, int head, int block) const noexcept {
    return static_cast<std::size_t>(page) * page_bytes + head * head_bytes +
           static_cast<std::size_t>(block) * rows_per_block * row_bytes;
  }
};

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
  for (int c = 0; c < head_dim; ++c) {
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum = sum + rows[static_cast<std::size_t>(t) * head_dim + c];
    mean[static_cast<std::size_t>(c)] = sum / static_cast<float>(n);
  }
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

/// The segments (one per KV head) of a sequence's segment whose first page is page `index` (a
/// multiple of `segment_pages`), about to be sealed from the full tail slot `tail` (host bytes):
/// each fitted (`format_traits::plan_segment`) to the rows an engine has of the segment, the
/// page's rows (the sinks left out of a first segment) and rows [next, next + segment_tokens -
/// page_size) of the call's `k`, `v` as far as they go (a prefill gives the whole segment; an
/// append, its first page). One function for both backends, so both fit the same bases to the
/// same rows. Cost: the format's plan_segment per KV head.
template <class Format, class T>
std::vector<typename segment_type<Format>::type> plan_segments(const Format& format, const engine_shape& engine,
                                                               const arena_geometry& geometry, const std::byte* tail,
                                                               std::int64_t index, const tensor_view<const T, 3>& k,
                                                               const tensor_view<const T, 3>& v, std::int64_t next) {
  using traits = format_traits<Format>;
  const page_shape shape = engine.page();
  const int per = traits::segment_pages(format, shape);
  const int p = engine.page_size, d = engine.head_dim, heads = engine.num_kv_heads;
  const std::int64_t ahead = std::min<std::int64_t>(k.extent(0) - next, static_cast<std::int64_t>(per - 1) * p);
  const int skip = index == 0 ? static_cast<int>(geometry.sink_rows) : 0;
  const std::int64_t n = p - skip + ahead;
  std::vector<float> k_rows(static_cast<std::size_t>(n) * d), v_rows(k_rows.size()), page(static_cast<std::size_t>(p) * d);
  std::vector<typename segment_type<Format>::type> planned;
  planned.reserve(static_cast<std::size_t>(heads));
  for (int h = 0; h < heads; ++h) {
    for (const bool is_v : {false, true}) {
      std::vector<float>& rows = is_v ? v_rows : k_rows;
      load_dense_rows(shape.storage, tail + geometry.tail_offset(is_v, h) + geometry.tail_row_offset(),
                      static_cast<std::size_t>(p) * d, page.data());
      std::copy(page.begin() + static_cast<std::ptrdiff_t>(skip) * d, page.end(), rows.begin());
      const tensor_view<const T, 3>& src = is_v ? v : k;
      for (std::int64_t t = 0; t < ahead; ++t)
        for (int c = 0; c < d; ++c) rows[static_cast<std::size_t>((p - skip + t) * d + c)] = to_float(src(next + t, h, c));
    }
    planned.push_back(traits::plan_segment(format, shape, k_rows.data(), v_rows.data(), n));
  }
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
  /// The scores land in the sequences' buffers during `run` (`detail::sequence_ref::scores`).
  static constexpr bool scores_by_position = true;
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
                         detail::block_summary_of<Selector>::value),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        bounds_(static_cast<std::size_t>(shape.max_pages) * bounds_geometry_.page_bytes) {}

  const detail::arena_geometry& geometry() const noexcept { return geometry_; }
  const detail::bounds_geometry& bounds_geometry() const noexcept { return bounds_geometry_; }
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
              detail::store_block_summary(bounds_geometry_.summary, shape_.storage,
                                          rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * d,
                                          bounds_geometry_.block_tokens, d, bounds_.data() + bounds_geometry_.offset(page, h, block));
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
  /// bits for any thread count. Compiled with OpenMP (`_OPENMP`: the consumer builds with
  /// -fopenmp), the pairs are spread over OpenMP's threads (`OMP_NUM_THREADS`); otherwise, and
  /// for a single pair, they run on the calling thread. Cost: per pair, one score and one
  /// accumulate per page read plus the tail and sinks; working memory per thread, no allocation
  /// per page or token.
  template <class Q, class O>
  void run(tensor_view<const Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse) {
    const std::int64_t heads = shape_.num_kv_heads;
    const std::int64_t items = static_cast<std::int64_t>(planned_batch_.size()) * heads;
    if (planned_selects_) last_selection_.assign(static_cast<std::size_t>(items), {});
    prepare_visible_rows();
#if defined(_OPENMP)
    if (items > 1) {
      std::exception_ptr error;       // the failure of the lowest pair, as the serial loop would throw
      std::int64_t error_item = items;
#pragma omp parallel
      {
        std::unique_ptr<attend_scratch> s;
        std::vector<std::uint64_t> keep;
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t i = 0; i < items; ++i) {
          try {
            if (!s) s = std::make_unique<attend_scratch>(shape_.group_size, shape_.head_dim, scratch_rows());
            attend_head(q, out, lse, static_cast<std::size_t>(i / heads), static_cast<int>(i % heads), *s, keep);
          } catch (...) {
#pragma omp critical(kvmosaic_host_attend_error)
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
    attend_scratch s(shape_.group_size, shape_.head_dim, scratch_rows());
    std::vector<std::uint64_t> keep;
    for (std::int64_t i = 0; i < items; ++i)
      attend_head(q, out, lse, static_cast<std::size_t>(i / heads), static_cast<int>(i % heads), s, keep);
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
    // Page blocks keep the selector's summary (a mean row is scored as lo = hi = mean); chunks
    // keep bounds.
    const int rows = r.block_tokens > 0 ? bounds_geometry_.rows_per_block : 2;
    for (std::size_t i = 0; i < begin.size(); ++i) {
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
        detail::store_block_summary(bounds_geometry_.summary, shape_.storage,
                                    rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * shape_.head_dim,
                                    bounds_geometry_.block_tokens, shape_.head_dim,
                                 bounds_.data() + bounds_geometry_.offset(page, h, block));
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

  // A policy in the wrong position fails its sentence above; the rest of the class then compiles
  // against a default of that kind, so that sentence is the only error a user reads.
  using Format = std::conditional_t<is_format_v<FormatArg>, FormatArg, format::dense>;
  using Selector = std::conditional_t<is_selector_v<SelectorArg>, SelectorArg, select::all>;
  using Compactor = std::conditional_t<is_compactor_v<CompactorArg>, CompactorArg, compact::none>;
  static constexpr bool segments_on_device = has_segments_v<Format> && is_backend_v<BackendArg> &&
                                             !std::is_same_v<BackendArg, backend::host>;
  static_assert(!segments_on_device || !compactor_traits<Compactor>::frees_memory,
                "kvmosaic::cache: a format with segments (format::packed_bitmap) on backend::cuda does not compact: "
                "use compact::none there, or backend::host (docs/packed_bitmap.md)");
  using Backend = std::conditional_t<is_backend_v<BackendArg> && (!segments_on_device || !compactor_traits<Compactor>::frees_memory),
                                     BackendArg, backend::host>;

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
                "format::bitmap_tiles or format::quant (quant2, quant4), or use backend::host (every format)");

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

  /// Appends the tokens of `k` and `v` ([tokens][num_kv_heads][head_dim], float, half or bfloat16;
  /// values are rounded to the storage dtype, finite values beyond its range saturated to its
  /// largest finite value, infinities and NaN kept) to one sequence: a prefill, or a piece of one
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
    after_write(seq, rows);
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
    for (std::int64_t b = 0; b < seqs.size(); ++b) after_write(seqs(b), 1);
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
      const sequence_state& s = live(seqs(b), where);
      detail::require(s.stored >= 1, where, "seqs (an empty sequence)", seqs(b),
                      "sequences holding at least one token");
      const std::uint64_t* live_rows = nullptr;
      if constexpr (evicts_tokens) live_rows = s.slots.dead > 0 ? s.slots.live.data() : nullptr;
      batch.push_back(detail::sequence_ref{&s.pages, s.stored, slot_of(seqs(b)), live_rows});
      if constexpr (records_scores) {  // the step writes each read token's score, by logical position
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
  /// A selector that reads token scores (select::tova, select::h2o) on backend::cuda: the step's
  /// scores are copied to the host and filed by position before this returns (it waits for the
  /// step; capture the engine's `run` instead to put the kernels in a graph).
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
      if constexpr (!engine_type::scores_by_position) absorb_device_scores();
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
  }

  /// After a write of `written` tokens to `seq` (committed): a keep-less selector's evictions, then
  /// its compaction cadence. Runs after the write's commit: a failure here (an allocation) leaves
  /// the written tokens stored and the evictions to the next write.
  void after_write(sequence_id seq, std::int64_t written) {
    if constexpr (selector_traits<Selector>::evicts) {
      sequence_state& s = state_of(seq);
      const eviction_view view{s.stored - s.slots.dead, s.slots.position.data(),
                               static_cast<std::int64_t>(s.slots.position.size()), sink_rows(format_)};
      const std::vector<std::int64_t> dead =
          selector_traits<Selector>::evictions(selector_, s.selector_state, s.seen, s.seen - tail_rows(s), view);
      if (!dead.empty()) evict_positions(seq, span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())), true);
      if (selector_traits<Selector>::compaction_due(selector_, s.selector_state, written)) compact(seq);
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
  };

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

  /// A step's token scores computed on the device (backend::cuda), per row of each sequence's
  /// read order, into the selector's buffers by logical position: written (score_use::last_step)
  /// or added (cumulative). Rows of evicted tokens, and page rows attended from their exact copies
  /// (sinks, recent window), carry no score. Waits for the step: the eviction that follows reads
  /// the scores on the host. Cost: one copy of 4 bytes per row and KV head, O(rows x KV heads) here.
  void absorb_device_scores() {
    engine_.download_token_scores();
    const auto rows = engine_.token_scores();
    const int heads = config_.num_kv_heads;
    const bool cumulative = detail::token_scores_of<Selector>::value == score_use::cumulative;
    for (std::size_t b = 0; b < planned_.size(); ++b) {
      sequence_state& s = state_of(planned_[b]);
      detail::token_score_buffer& buffer = selector_traits<Selector>::scores(s.selector_state);
      const std::vector<std::int64_t> positions = read_order_positions(s);
      for (std::size_t r = 0; r < positions.size(); ++r) {
        if (positions[r] < 0) continue;
        for (int h = 0; h < heads; ++h) {
          const float value = rows.data[(b * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)) *
                                            static_cast<std::size_t>(rows.row_stride) + r];
          float& score = buffer.values[static_cast<std::size_t>(positions[r]) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)];
          score = cumulative ? score + value : value;
        }
      }
    }
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
    same_type(where, k, v);
    detail::with_io_type(k.type, where, "k.type", [&](auto tag) {
      using T = typename decltype(tag)::type;
      cache_.read(seq, k.as<T>(), v.as<T>());
    });
  }

  std::vector<double> window_votes(sequence_id seq, tensor_ref<3> queries, float softmax_scale = 0.0f,
                                   group_combine combine = group_combine::sum) override {
    return with_queries("layer_cache::window_votes", queries, [&](const auto& q) {
      return cache_.window_votes(seq, q, softmax_scale, combine);
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
  std::int64_t stored_tokens(sequence_id seq) const override { return cache_.stored_tokens(seq); }
  memory_stats memory() const override { return cache_.memory(); }

 private:
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

// ---- begin <kvmosaic/cuda/error.cuh> ----
/// \file
/// CUDA runtime errors as kvmosaic exceptions: `KVMOSAIC_CUDA_CHECK(cudaMalloc(...))` throws a
/// `kvmosaic::cuda_error` naming the call, the error and where it happened.

#include <cuda_runtime.h>

#include <atomic>


namespace kvmosaic {

/// A CUDA runtime call failed. `code()` is the cudaError_t.
class cuda_error : public error {
 public:
  cuda_error(cudaError_t code, const char* call, const char* file, int line)
      : error("cuda", std::string("kvmosaic: CUDA error ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                          ") in " + call + " at " + file + ":" + std::to_string(line)),
        code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {

/// Fault injection for tests of the all-or-nothing contract: when armed with `n` >= 0, the
/// (n+1)-th `KVMOSAIC_CUDA_CHECK` from then on does not make its call and fails as if it had
/// returned cudaErrorMemoryAllocation; the checks after it run normally. Disarmed (-1) by
/// default; cost when disarmed: one relaxed atomic load per checked call. Not for production.
struct cuda_fault_injection {
  static std::atomic<long>& countdown() noexcept {
    static std::atomic<long> value{-1};
    return value;
  }
  static void arm(long n) noexcept { countdown().store(n, std::memory_order_relaxed); }
  static void disarm() noexcept { countdown().store(-1, std::memory_order_relaxed); }
  /// Whether the armed fault has not fired yet.
  static bool armed() noexcept { return countdown().load(std::memory_order_relaxed) >= 0; }
  /// Counts one checked call; true for the one that fails.
  static bool fire() noexcept {
    if (countdown().load(std::memory_order_relaxed) < 0) return false;
    return countdown().fetch_sub(1, std::memory_order_relaxed) == 0;
  }
};

inline void cuda_check(cudaError_t code, const char* call, const char* file, int line) {
  if (code != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next check reports its own call
    throw cuda_error(code, call, file, line);
  }
}
}  // namespace detail

}  // namespace kvmosaic

/// Throws kvmosaic::cuda_error when a CUDA runtime call does not return cudaSuccess.
#define KVMOSAIC_CUDA_CHECK(call)                                                                          \
  ::kvmosaic::detail::cuda_check(                                                                          \
      ::kvmosaic::detail::cuda_fault_injection::fire() ? cudaErrorMemoryAllocation : (call), #call, __FILE__, \
      __LINE__)
// ---- end <kvmosaic/cuda/error.cuh> ----

// ---- begin <kvmosaic/cuda/device_buffer.cuh> ----
/// \file
/// Owning buffers: device memory (`device_buffer`) and page-locked host memory (`pinned_buffer`),
/// both movable, not copyable, and freed on destruction. Allocation goes through plain
/// cudaMalloc/cudaMallocHost (no managed memory), as the engines' page arenas need.




namespace kvmosaic::cuda {

namespace detail {
template <class Free>
class raw_buffer {
 public:
  raw_buffer() = default;
  raw_buffer(void* data, std::size_t bytes) noexcept : data_(data), bytes_(bytes) {}
  raw_buffer(raw_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  raw_buffer& operator=(raw_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  raw_buffer(const raw_buffer&) = delete;
  raw_buffer& operator=(const raw_buffer&) = delete;
  ~raw_buffer() { reset(); }

  void* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) Free{}(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};
struct free_device {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
struct free_pinned {
  void operator()(void* p) const noexcept { cudaFreeHost(p); }
};
}  // namespace detail

/// Device memory from cudaMalloc.
class device_buffer : public detail::raw_buffer<detail::free_device> {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : raw_buffer(allocate(bytes), bytes) {}

  /// Grows (never shrinks) to at least `bytes`; the contents are not kept.
  void reserve(std::size_t bytes) {
    if (bytes > size()) *this = device_buffer(bytes);
  }

 private:
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
};

/// Page-locked host memory from cudaMallocHost: the staging of per-step metadata. Kernels may
/// read it over the bus through `device_address()` (with unified addressing, which every 64-bit
/// platform CUDA supports, page-locked memory is mapped into the device's address space).
class pinned_buffer : public detail::raw_buffer<detail::free_pinned> {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t bytes) : raw_buffer(allocate(bytes), bytes) {
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaHostGetDevicePointer(&device_address_, data(), 0));
  }
  pinned_buffer(pinned_buffer&& other) noexcept
      : raw_buffer(std::move(other)), device_address_(std::exchange(other.device_address_, nullptr)) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    raw_buffer::operator=(std::move(other));
    device_address_ = std::exchange(other.device_address_, nullptr);
    return *this;
  }

  void reserve(std::size_t bytes) {
    if (bytes > size()) *this = pinned_buffer(bytes);
  }

  /// The address at which kernels read this memory (over PCIe or NVLink-C2C, uncached).
  const void* device_address() const noexcept { return device_address_; }

 private:
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void* device_address_ = nullptr;
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/device_buffer.cuh> ----

// ---- begin <kvmosaic/cuda/tuning.cuh> ----
/// \file
/// Launch shapes of the kernels, in one place (CCCL's "tuning is data"): a constexpr function of
/// the problem shape returns threads per CTA and the unroll depth, instead of literals spread over
/// kernels. Changing a tuning here changes every launch that uses it.

namespace kvmosaic::cuda {

/// Shape of the decode-attention kernel for one head_dim and GQA group size.
struct decode_tuning {
  int threads;  ///< threads per CTA; a CTA reads one split of one (sequence, KV head)
  int unroll;   ///< tokens per thread per loop step (portable kernel: its K and V loads in flight)
  int stage_tokens;          ///< sm_90 kernel: K and V rows per shared-memory stage
  int stages;                ///< sm_90 kernel: stages in flight per CTA
  int max_pages_per_split;   ///< sm_90 kernels: page ids a CTA keeps in shared memory
  int tma_stages;            ///< sm_90 tensor-core kernel: 64-token TMA stages in flight per CTA
};

constexpr decode_tuning decode_tuning_for(int head_dim, int group_size) {
  // Registers per thread grow with the group (q and o held per query head): fewer tokens per
  // step for large groups. A stage is 16 KB of K plus 16 KB of V whatever head_dim; two stages per
  // CTA and three CTAs per SM keep about 190 KB of loads in flight per SM. The tensor-core kernel
  // keeps two 64-token stages in flight per CTA, q in shared memory, and up to 2048 page ids per
  // split (78 KB of shared memory at head_dim 128: two CTAs per SM; 142 KB at 256: one). The
  // measurements behind each number: benchmark/README.md, "Decisions the code cites".
  // Formats that stream compressed pages size their stages at run time (their device parts).
  return decode_tuning{128, group_size > 4 ? 2 : (head_dim >= 256 ? 2 : 4), 8192 / head_dim, 2, 2048, 2};
}

/// Threads of the split-merge kernel: one per output channel.
constexpr int merge_threads(int head_dim) { return head_dim; }

/// Threads of the row-scatter (prefill/append) kernel.
constexpr int extend_threads = 256;

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/tuning.cuh> ----

// ---- begin <kvmosaic/cuda/collective/page_attend.cuh> ----
/// \file
/// The per-format attend collective: folds one page (or the dense tail) of one KV head into the
/// running online-softmax state of a CTA's threads, computing q.k and p.v on the stored form.
///
/// The decode kernel (kernel/decode.cuh) is generic; each format specializes `page_attend` on its
/// tag. The thread mapping all collectives share: a CTA of `Threads` threads is `rows` token rows of
/// `lanes_per_row` lanes, each lane owning 8 consecutive channels (16 bytes) of head_dim; a thread
/// keeps q, m, l and o for those channels and every query head of the group (`thread_state`).


// ---- begin <kvmosaic/cuda/detail/bulk_copy.cuh> ----
/// \file
/// Hopper (sm_90) bulk copies from global to shared memory completing on an mbarrier: one thread
/// moves a whole contiguous run of a page (kilobytes) with one instruction, and the CTA waits on
/// the barrier's phase. Compiled for every architecture; executed only on sm_90+ (the kernels that
/// use it are launched only there, and trap elsewhere).


namespace kvmosaic::cuda::detail {

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

/// A 16-byte load from shared memory.
__device__ __forceinline__ uint4 load_shared(const void* address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(shared_address(address)));
  return v;
}

/// An asynchronous copy of `Bytes` (4, 8 or 16, both addresses aligned to it) from global to
/// shared memory (sm_80+ `cp.async`: the issuing thread does not wait for it, so a thread's
/// copies are all in flight together); `async_copy_commit` groups the thread's copies and
/// `async_copy_wait` waits for its groups. Before sm_80, a load and a store.
template <int Bytes>
__device__ __forceinline__ void async_copy(void* shared, const void* global) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(shared)), "l"(global) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(shared_address(shared)), "l"(global), "n"(Bytes) : "memory");
#else
  if constexpr (Bytes == 16) *static_cast<uint4*>(shared) = __ldg(static_cast<const uint4*>(global));
  else if constexpr (Bytes == 8) *static_cast<uint2*>(shared) = __ldg(static_cast<const uint2*>(global));
  else *static_cast<unsigned*>(shared) = __ldg(static_cast<const unsigned*>(global));
#endif
}
/// Closes the thread's copies issued since the last commit into one group.
__device__ __forceinline__ void async_copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/// Waits until at most `Pending` of the thread's committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void async_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#  define KVMOSAIC_HAS_BULK_COPY 1
#else
#  define KVMOSAIC_HAS_BULK_COPY 0
#endif

/// Initializes a barrier expecting `arrivals` arrivals per phase, and makes it visible to the
/// bulk-copy engine (call __syncthreads() afterwards).
__device__ __forceinline__ void barrier_init(std::uint64_t* barrier, std::uint32_t arrivals) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  (void)barrier;
  (void)arrivals;
  __trap();
#endif
}

/// Arrives on the barrier and announces `bytes` of bulk copies that complete this phase.
__device__ __forceinline__ void barrier_arrive_expect(std::uint64_t* barrier, std::uint32_t bytes) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#else
  (void)barrier;
  (void)bytes;
  __trap();
#endif
}

/// Arrives on the barrier (release: this thread's prior accesses happen before the phase completes).
__device__ __forceinline__ void barrier_arrive(std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
#else
  (void)barrier;
  __trap();
#endif
}

/// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory;
/// completion is counted on `barrier`.
__device__ __forceinline__ void bulk_copy_to_shared(void* destination, const void* source, std::uint32_t bytes,
                                                    std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(destination)),
      "l"(source), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
#else
  (void)destination;
  (void)source;
  (void)bytes;
  (void)barrier;
  __trap();
#endif
}

/// Waits until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
#else
  (void)barrier;
  (void)parity;
  __trap();
#endif
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/bulk_copy.cuh> ----

// ---- begin <kvmosaic/cuda/detail/vector_io.cuh> ----
/// \file
/// Bit-level helpers of the kernels: 16-byte loads that bypass L1 (KV is streamed once), and the
/// widening of 8 packed 16-bit values to float. One place for both, so every format's collective
/// loads and converts the same way.

#include <cuda_bf16.h>
#include <cuda_fp16.h>



namespace kvmosaic::cuda::detail {

/// 8 elements of 16 bits: the unit of every vector load (16 bytes).
constexpr int vector_elements = 8;

/// Streaming 16-byte load through the read-only path, not allocated in L1.
__device__ __forceinline__ uint4 load_streaming(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

/// Widens 8 packed 16-bit values of type T to float.
template <class T>
__device__ __forceinline__ void widen(const uint4& raw, float (&out)[vector_elements]);

template <>
__device__ __forceinline__ void widen<bfloat16>(const uint4& raw, float (&out)[vector_elements]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);          // bf16 -> f32 is a shift
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void widen<half>(const uint4& raw, float (&out)[vector_elements]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h2;
    *reinterpret_cast<std::uint32_t*>(&h2) = words[i];
    const float2 f = __half22float2(h2);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/vector_io.cuh> ----

namespace kvmosaic::cuda {

/// What each thread carries through a split: its 8-channel slice of the (pre-scaled) queries of
/// the group, and per query head the running max `m`, sum `l` and unnormalized output slice `o`.
template <int Group>
struct thread_state {
  float q[Group][detail::vector_elements];
  float m[Group];
  float l[Group];
  float o[Group][detail::vector_elements];
};

/// Where a collective reads a page from: global memory (streamed, the portable path) or shared
/// memory (staged there by bulk copies, the sm_90 path).
struct from_global {
  __device__ __forceinline__ static uint4 load(const std::byte* address) { return detail::load_streaming(address); }
};
struct from_shared {
  __device__ __forceinline__ static uint4 load(const std::byte* address) { return detail::load_shared(address); }
};

/// Primary template: a format without a CUDA attend collective.
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll>
struct page_attend {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this format has no CUDA attend collective yet: specialize "
                "kvmosaic::cuda::page_attend<Format, ...> (see cuda/collective/page_attend.cuh)");
};

/// Dense pages: rows of head_dim 16-bit values. Each step a thread loads `Unroll` 16-byte slices of
/// K and of V (all in flight before first use), reduces its partial dot products across the lanes
/// of its row with shuffles, and updates its state once per step (one rescale per `Unroll` tokens).
/// Cost per token and query head: head_dim FMAs for q.k and for p.v, log2(lanes_per_row) shuffles
/// shared by the row, one exp. Bytes: exactly the page rows read, once.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
struct page_attend<format::dense, T, HeadDim, Group, Threads, Unroll> {
  static constexpr int vec = detail::vector_elements;
  static constexpr int lanes_per_row = HeadDim / vec;
  static constexpr int rows = Threads / lanes_per_row;
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));
  static_assert(lanes_per_row <= 32 && 32 % lanes_per_row == 0, "a token row must fit in one warp");
  static_assert(Threads % 32 == 0 && rows >= 1, "Threads must be whole warps covering at least one row");

  /// Folds tokens [0, n) of the K rows at `k` and the V rows at `v` (in memory space `Space`) into
  /// `s`: those whose bit is set in `rows_read` (bit t % 32 of word t / 32), or all of them when it
  /// is null; the others are neither loaded nor counted. Every thread of the CTA calls it with the
  /// same n (the shuffles need the whole warp). With `logits` (a step that records token
  /// scores), the scaled logit of token t and head j goes to logits[t * Group + j] for every t < n
  /// (-inf for a token not read).
  template <class Space = from_global>
  __device__ __forceinline__ static void fold(const std::byte* __restrict__ k, const std::byte* __restrict__ v,
                                              int n, thread_state<Group>& s, const std::uint32_t* rows_read = nullptr,
                                              float* logits = nullptr) {
    const int lane = static_cast<int>(threadIdx.x) % lanes_per_row;
    const int row = static_cast<int>(threadIdx.x) / lanes_per_row;
    const std::byte* k_lane = k + lane * 16;
    const std::byte* v_lane = v + lane * 16;
    for (int t0 = 0; t0 < n; t0 += rows * Unroll) {
      uint4 k_raw[Unroll], v_raw[Unroll];
      bool read[Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const int t = t0 + row + rows * u;
        read[u] = t < n && (rows_read == nullptr || ((rows_read[t >> 5] >> (t & 31)) & 1u) != 0);
        if (read[u]) {
          k_raw[u] = Space::load(k_lane + static_cast<std::size_t>(t) * row_bytes);
          v_raw[u] = Space::load(v_lane + static_cast<std::size_t>(t) * row_bytes);
        } else {
          k_raw[u] = make_uint4(0, 0, 0, 0);
          v_raw[u] = make_uint4(0, 0, 0, 0);
        }
      }
      float logit[Group][Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        float key[vec];
        detail::widen<T>(k_raw[u], key);
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < vec; ++i) dot = fmaf(s.q[g][i], key[i], dot);
          logit[g][u] = dot;
        }
      }
#pragma unroll
      for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g)
#pragma unroll
          for (int u = 0; u < Unroll; ++u) logit[g][u] += __shfl_xor_sync(0xffffffffu, logit[g][u], offset);
      }
      if (rows_read != nullptr) {  // a row not read counts as a logit of -inf: p = 0
#pragma unroll
        for (int u = 0; u < Unroll; ++u)
#pragma unroll
          for (int g = 0; g < Group; ++g) logit[g][u] = read[u] ? logit[g][u] : -HUGE_VALF;
      }
      if (logits != nullptr && lane == 0) {
#pragma unroll
        for (int u = 0; u < Unroll; ++u) {
          const int t = t0 + row + rows * u;
          if (t < n)
#pragma unroll
            for (int g = 0; g < Group; ++g) logits[static_cast<std::size_t>(t) * Group + g] = logit[g][u];
        }
      }
      update(logit, v_raw, t0, row, n, s);
    }
  }

  /// As `fold`, with the logits already computed (by tensor cores): `logits[g * stride + t]` for
  /// the n tokens of the V rows at `v`.
  template <class Space = from_shared>
  __device__ __forceinline__ static void fold_scored(const float* logits, int stride, const std::byte* __restrict__ v,
                                                     int n, thread_state<Group>& s) {
    const int lane = static_cast<int>(threadIdx.x) % lanes_per_row;
    const int row = static_cast<int>(threadIdx.x) / lanes_per_row;
    const std::byte* v_lane = v + lane * 16;
    for (int t0 = 0; t0 < n; t0 += rows * Unroll) {
      uint4 v_raw[Unroll];
      float logit[Group][Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const int t = t0 + row + rows * u;
        const bool valid = t < n;
        v_raw[u] = valid ? Space::load(v_lane + static_cast<std::size_t>(t) * row_bytes) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int g = 0; g < Group; ++g) logit[g][u] = valid ? logits[g * stride + t] : -HUGE_VALF;
      }
      update(logit, v_raw, t0, row, n, s);
    }
  }

 private:
  /// The online-softmax step shared by both folds: one rescale per `Unroll` tokens, then p.v.
  __device__ __forceinline__ static void update(const float (&logit)[Group][Unroll], const uint4 (&v_raw)[Unroll], int t0,
                                                int row, int n, thread_state<Group>& s) {
    float value[Unroll][vec];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) detail::widen<T>(v_raw[u], value[u]);
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      float step_max = -HUGE_VALF;
#pragma unroll
      for (int u = 0; u < Unroll; ++u)
        if (t0 + row + rows * u < n) step_max = fmaxf(step_max, logit[g][u]);
      const float m_new = fmaxf(s.m[g], step_max);
      if (m_new == -HUGE_VALF) continue;  // this row has seen no token yet
      const float rescale = __expf(s.m[g] - m_new);
      s.l[g] *= rescale;
#pragma unroll
      for (int i = 0; i < vec; ++i) s.o[g][i] *= rescale;
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const float p = t0 + row + rows * u < n ? __expf(logit[g][u] - m_new) : 0.0f;
        s.l[g] += p;
#pragma unroll
        for (int i = 0; i < vec; ++i) s.o[g][i] = fmaf(p, value[u][i], s.o[g][i]);
      }
      s.m[g] = m_new;
    }
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/collective/page_attend.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/decode.cuh> ----
/// \file
/// What every format's split kernels share: the step's parameters (`decode_params`, and
/// `split_params` with a format's own fields), the split helpers (`detail_decode`: claiming a
/// work entry, a split's pages and row masks, writing the partial state), and
/// `merge_splits_kernel` (one CTA per (sequence, query head): the flash-decoding merge of the
/// splits' partial states). The split kernels themselves live with their format
/// (cuda/format/<name>/decode.cuh): one CTA per split of one (sequence, KV head), every query
/// head of the GQA group sharing each K/V load.

#include <cuda.h>


// ---- begin <kvmosaic/core/split_plan.hpp> ----
/// \file
/// The split-KV plan of one decode step (flash-decoding): which contiguous range of pages of which
/// sequence each CTA reads, and where its partial state `(m, l, o)` goes for the merge.
///
/// Computed on the host from the batch's lengths alone, once per step, and reused by every kernel
/// of the step (FlashInfer's scheduler does the same): a single 128K sequence is cut into many
/// splits that fill the GPU, while a large batch of short sequences gets one split each. The
/// dense tail is read by the last split of its sequence.



namespace kvmosaic {

/// One unit of work: pages [page_begin, page_end) of sequence `batch_index`, plus its tail when
/// `with_tail` is set. 16 bytes, copied to the device as is.
struct split_work {
  std::int32_t batch_index;
  std::int32_t page_begin;
  std::int32_t page_end;
  std::int32_t with_tail;
};

/// The plan of one step.
struct split_plan {
  std::vector<split_work> work;              ///< one entry per split, grouped by sequence
  std::vector<std::int32_t> partial_offset;  ///< batch + 1 entries: splits of b are [offset[b], offset[b+1])
  std::int32_t pages_per_split = 1;          ///< the longest split, in pages

  std::int32_t num_splits() const noexcept { return static_cast<std::int32_t>(work.size()); }
};

/// Plans a step for sequences with `full_pages[b]` encoded pages and `tail_rows[b]` tail tokens.
/// `target_splits` is how many splits fill the device in one wave (per KV head). For 1 to 4 waves,
/// the split size is the smallest number of pages for which the batch needs at most that many
/// waves of splits (binary search, as in FlashInfer's scheduler); the plan takes the one with the
/// least (waves x longest split), the time of a step when every split streams at the same rate.
/// Splits never exceed `max_pages_per_split` (kernels keep a split's page ids on chip), even if
/// that takes more than one wave. With `page_multiple` > 1, split sizes and boundaries are
/// multiples of it (but a sequence's last split): for kernels that deal a split's pages to that
/// many workers, none of which should idle at the end (quant2's 4 warps). With `segment_pages`
/// > 0 (formats with segments, whose kernels work in one segment's basis at a time), no split
/// crosses a multiple of it and the dense tail is a split of its own (pages [n, n)). Cost:
/// O(batch log pages) host work.
inline split_plan make_split_plan(const std::vector<std::int32_t>& full_pages, const std::vector<std::int32_t>& tail_rows,
                                  std::int32_t target_splits, std::int32_t max_pages_per_split = 1 << 30,
                                  std::int32_t page_multiple = 1, std::int32_t segment_pages = 0) {
  detail::require(full_pages.size() == tail_rows.size(), "make_split_plan", "tail_rows.size()", tail_rows.size(),
                  "full_pages.size()");
  detail::require(target_splits >= 1, "make_split_plan", "target_splits", target_splits, ">= 1");
  detail::require(max_pages_per_split >= 1, "make_split_plan", "max_pages_per_split", max_pages_per_split, ">= 1");
  detail::require(page_multiple >= 1 && page_multiple <= max_pages_per_split, "make_split_plan", "page_multiple",
                  page_multiple, "1 to max_pages_per_split");
  std::int32_t longest = 1;
  for (std::size_t b = 0; b < full_pages.size(); ++b) {
    detail::require(full_pages[b] >= 0 && tail_rows[b] >= 0 && full_pages[b] + tail_rows[b] > 0, "make_split_plan",
                    "sequence length", full_pages[b], "at least one token per sequence");
    longest = std::max(longest, full_pages[b]);
  }
  const auto rounded = [&](std::int32_t pages_per_split) {
    const std::int32_t up = (pages_per_split + page_multiple - 1) / page_multiple * page_multiple;
    return up <= max_pages_per_split ? up : max_pages_per_split / page_multiple * page_multiple;
  };
  detail::require(segment_pages >= 0, "make_split_plan", "segment_pages", segment_pages, ">= 0 (0: no segments)");
  // The pieces a sequence's pages are split within: its segments, or all of them.
  const auto for_each_piece = [&](std::int32_t pages, auto&& f) {
    if (segment_pages == 0 || pages == 0) return f(0, pages);
    for (std::int32_t first = 0; first < pages; first += segment_pages) f(first, std::min(pages, first + segment_pages));
  };
  const auto splits_for = [&](std::int32_t pages_per_split) {
    std::int64_t splits = 0;
    for (std::size_t b = 0; b < full_pages.size(); ++b) {
      for_each_piece(full_pages[b], [&](std::int32_t begin, std::int32_t end) {
        splits += std::max<std::int32_t>(1, (end - begin + pages_per_split - 1) / pages_per_split);
      });
      if (segment_pages > 0 && full_pages[b] > 0 && tail_rows[b] > 0) ++splits;
    }
    return splits;
  };
  // The smallest split size whose split count fits in `waves` waves of target_splits.
  const auto smallest_fitting = [&](std::int64_t waves) {
    std::int32_t lo = 1, hi = std::min(longest, max_pages_per_split);
    while (lo < hi) {
      const std::int32_t mid = lo + (hi - lo) / 2;
      if (splits_for(mid) <= waves * target_splits) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  };
  // A step lasts about (waves) x (longest split): one wave of few long splits can lose to two
  // waves of many short ones when the batch leaves SMs idle (32 sequences on 49 slots per head).
  std::int32_t lo = rounded(smallest_fitting(1));
  std::int64_t best_cost = ((splits_for(lo) + target_splits - 1) / target_splits) * static_cast<std::int64_t>(lo);
  for (std::int64_t waves = 2; waves <= 4; ++waves) {
    const std::int32_t size = rounded(smallest_fitting(waves));
    const std::int64_t cost = ((splits_for(size) + target_splits - 1) / target_splits) * static_cast<std::int64_t>(size);
    if (cost < best_cost) {
      best_cost = cost;
      lo = size;
    }
  }
  split_plan plan;
  plan.pages_per_split = lo;
  plan.partial_offset.reserve(full_pages.size() + 1);
  for (std::size_t b = 0; b < full_pages.size(); ++b) {
    plan.partial_offset.push_back(plan.num_splits());
    const bool tail_alone = segment_pages > 0 && full_pages[b] > 0;
    for_each_piece(full_pages[b], [&](std::int32_t piece_begin, std::int32_t piece_end) {
      // Even splits: the piece's pages, in units of page_multiple, spread over its split count,
      // sizes differing by at most one unit.
      const std::int32_t pages = piece_end - piece_begin;
      const std::int32_t count = std::max<std::int32_t>(1, (pages + lo - 1) / lo);
      const std::int64_t units = (pages + page_multiple - 1) / page_multiple;
      const auto boundary = [&](std::int32_t i) {
        return piece_begin + static_cast<std::int32_t>(std::min<std::int64_t>(pages, units * i / count * page_multiple));
      };
      const bool last_piece = piece_end == full_pages[b];
      for (std::int32_t i = 0; i < count; ++i) {
        const std::int32_t begin = boundary(i);
        const std::int32_t end = i + 1 == count ? piece_end : boundary(i + 1);
        const bool with_tail = !tail_alone && last_piece && i + 1 == count && tail_rows[b] > 0;
        plan.work.push_back(split_work{static_cast<std::int32_t>(b), begin, end, with_tail ? 1 : 0});
      }
    });
    if (tail_alone && tail_rows[b] > 0) plan.work.push_back(split_work{static_cast<std::int32_t>(b), full_pages[b], full_pages[b], 1});
  }
  plan.partial_offset.push_back(plan.num_splits());
  return plan;
}

}  // namespace kvmosaic
// ---- end <kvmosaic/core/split_plan.hpp> ----

// ---- begin <kvmosaic/cuda/collective/score_mma.cuh> ----
/// \file
/// Warp-level logits on tensor cores: q . k for the GQA group's query heads (the M rows of an
/// m16n8k16 tile, padded to 16) against K rows staged in shared memory (the N columns, 8 tokens
/// per tile). Replaces the per-lane dot products and shuffle reductions of the SIMT path, which
/// bound the dense kernel by instruction issue rather than by memory.
///
/// Precision: q (already multiplied by the softmax scale) is split into q_hi + q_lo, both in the
/// storage type, and both halves are multiplied (two MMAs), so q keeps about 16 (bf16) or 22
/// (f16) significant bits; K is exact in its storage type; products accumulate in fp32.
///
/// Shared-memory banks: a warp's 16-byte loads cover two K rows per phase; rows are a multiple of
/// 128 bytes apart, so odd rows read the other 64-byte half of the 128-byte line (they walk the
/// head dimension in swapped pairs of 32-channel steps) and no phase has a conflict. The
/// contraction order does not matter, so each lane's MMA k-slots map to physical channels
/// [32 s + 8 q, 32 s + 8 q + 8) (identically in the A and B operands) to make each load 16 bytes.


// ---- begin <kvmosaic/cuda/detail/mma.cuh> ----
/// \file
/// The tensor-core atoms the decode kernels use: `mma.sync.m16n8k16` with 16-bit operands and fp32
/// accumulators (sm_80+), the packing of float pairs into its 16-bit operand registers, and the
/// integer `m16n8k32` with int8 operands and int32 accumulators (quant2's codes).
/// Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16"), for lane = 4 g + q:
///   A (16x16, row): a[0] = (row g,   k 2q..2q+1)  a[1] = (row g+8, k 2q..2q+1)
///                   a[2] = (row g,   k 2q+8..+9)  a[3] = (row g+8, k 2q+8..+9)
///   B (16x8, col):  b[0] = (k 2q..2q+1, col g)    b[1] = (k 2q+8..+9, col g)
///   C (16x8):       c[0..1] = (row g, cols 2q, 2q+1)   c[2..3] = (row g+8, cols 2q, 2q+1)



namespace kvmosaic::cuda::detail {

/// The body of an atom compiled for an architecture without its instruction (the host pass, or
/// a portable build that never calls it): uses the operands and traps.
template <class... Operands>
__device__ __forceinline__ void unsupported_architecture(const Operands&...) {
  __trap();
}

/// `x` as a T operand (nearest even), without the saturation of a stored value (`pack_pair`'s
/// reasoning applies): one hardware conversion. Saturating here costs the folds that stage
/// operands registers they spill (benchmark/README.md, "Decisions the code cites").
template <class T>
__device__ __forceinline__ T to_operand(float x) {
  static_assert(std::is_same<T, half>::value || std::is_same<T, bfloat16>::value,
                "kvmosaic: to_operand converts to half or bfloat16 operands");
  if constexpr (std::is_same<T, half>::value)
    return T::from_bits(__half_as_ushort(__float2half_rn(x)));
  else
    return T::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}

/// Two floats as T operands (`to_operand`) in one 32-bit operand register, `low` first. Two
/// scalar conversions, not the paired one (`__floats2half2_rn`): the paired form made the sm_90
/// bitmap_tiles fold spill more (benchmark/README.md, "Decisions the code cites").
template <class T>
__device__ __forceinline__ std::uint32_t pack_pair(float low, float high) {
  return static_cast<std::uint32_t>(to_operand<T>(low).bits) | (static_cast<std::uint32_t>(to_operand<T>(high).bits) << 16);
}

/// `x` rounded to T (nearest even) and back, without saturation (`to_operand`): the hi part of
/// an operand split into hi + lo 16-bit halves.
template <class T>
__device__ __forceinline__ float round_operand(float x) {
  if constexpr (std::is_same<T, half>::value)
    return __half2float(__float2half_rn(x));
  else
    return __bfloat162float(__float2bfloat16_rn(x));
}

/// The 8x8 16-bit matrix held in fragment layout (lane 4 g + q: row g, columns 2 q, 2 q + 1),
/// transposed, in the same layout: one `movmatrix` (sm_75+). Turns a C fragment packed to 16 bits
/// into a B fragment of the next product.
__device__ __forceinline__ std::uint32_t transpose_8x8(std::uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
#else
  unsupported_architecture(x);
  return x;
#endif
}

/// c += a * b for one m16n8k16 tile with T (half or bfloat16) operands.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<bfloat16>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                    std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

template <>
__device__ __forceinline__ void mma_16816<half>(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                                std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

/// c += a * b for one m16n8k32 tile of int8 operands (values 0..255 fit as unsigned: u8 x u8,
/// s32 accumulators). Fragments (PTX ISA, "mma.m16n8k32"), lane = 4 g + q, 4 bytes a register:
///   A (16x32, row): a[0] = (row g, k 4q..4q+3)  a[1] = (row g+8, k 4q..)  a[2] = (row g, k 16+4q..)
///                   a[3] = (row g+8, k 16+4q..)
///   B (32x8, col):  b0 = (k 4q..4q+3, col g)    b1 = (k 16+4q.., col g)
///   C (16x8):       c[0..1] = (row g, cols 2q, 2q+1)   c[2..3] = (row g+8, cols 2q, 2q+1)
/// sm_80+ runs it as one instruction; sm_75 as four m8n8k16 products with the same fragments.
__device__ __forceinline__ void mma_u8_16832(int (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  // m8n8k16: A (8x16) a = (row g, k 4q..4q+3), B b = (k 4q.., col g), C = (row g, cols 2q, 2q+1).
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[0]), "+r"(c[1]) : "r"(a[0]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[0]), "+r"(c[1]) : "r"(a[2]), "r"(b1));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[2]), "+r"(c[3]) : "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+r"(c[2]), "+r"(c[3]) : "r"(a[3]), "r"(b1));
#else
  unsupported_architecture(c, a, b0, b1);
#endif
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/mma.cuh> ----

namespace kvmosaic::cuda {

template <class T, int HeadDim, int Group, int TokensPerWarp>
struct mma_scorer {
  static_assert(Group >= 1 && Group <= 8, "the group's query heads fill the first 8 rows of the tile");
  static_assert(TokensPerWarp % 8 == 0, "a warp scores whole 8-token tiles");
  static_assert(HeadDim % 64 == 0, "head_dim must be a multiple of 64 (pairs of 32-channel steps)");
  static constexpr int steps = HeadDim / 32;  ///< 32 channels (two k16 MMAs) per step
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));

  std::uint32_t q_hi[steps][2][2];  ///< [step][k16 half][A register 0 or 2]
  std::uint32_t q_lo[steps][2][2];

  /// Loads the group's queries for this KV head (`q`: [Group][HeadDim] floats), scaled.
  __device__ __forceinline__ void load_queries(const float* q, float scale) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, quad = lane % 4;
#pragma unroll
    for (int s = 0; s < steps; ++s) {
      float x[8];
      if (g < Group) {
        const float4 a = *reinterpret_cast<const float4*>(q + g * HeadDim + 32 * s + 8 * quad);
        const float4 b = *reinterpret_cast<const float4*>(q + g * HeadDim + 32 * s + 8 * quad + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = v[i] * scale;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = 0.0f;
      }
      float hi[8], lo[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hi[i] = detail::round_operand<T>(x[i]);
        lo[i] = x[i] - hi[i];
      }
#pragma unroll
      for (int half_step = 0; half_step < 2; ++half_step) {
        q_hi[s][half_step][0] = detail::pack_pair<T>(hi[4 * half_step], hi[4 * half_step + 1]);
        q_hi[s][half_step][1] = detail::pack_pair<T>(hi[4 * half_step + 2], hi[4 * half_step + 3]);
        q_lo[s][half_step][0] = detail::pack_pair<T>(lo[4 * half_step], lo[4 * half_step + 1]);
        q_lo[s][half_step][1] = detail::pack_pair<T>(lo[4 * half_step + 2], lo[4 * half_step + 3]);
      }
    }
  }

  /// logits[g * stride + t] = q_g . k_t for the warp's tokens t in [first, first + TokensPerWarp)
  /// of the K rows at `k` (shared memory). Rows past the valid ones may hold anything: their
  /// columns are independent and the caller never reads them.
  __device__ __forceinline__ void score(const std::byte* k, int first, float* logits, int stride) const {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, quad = lane % 4, odd = g & 1;
#pragma unroll
    for (int tile = 0; tile < TokensPerWarp / 8; ++tile) {
      const std::byte* key = k + static_cast<std::size_t>(first + 8 * tile + g) * row_bytes + 16 * quad;
      uint4 loaded[steps];
#pragma unroll
      for (int s = 0; s < steps; ++s) loaded[s] = detail::load_shared(key + 64 * (s ^ odd));
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < steps; ++s) {
        const uint4 b = odd ? loaded[s ^ 1] : loaded[s];  // step s's channels, wherever they were read
        const std::uint32_t a_hi0[4] = {q_hi[s][0][0], 0u, q_hi[s][0][1], 0u};
        const std::uint32_t a_lo0[4] = {q_lo[s][0][0], 0u, q_lo[s][0][1], 0u};
        const std::uint32_t a_hi1[4] = {q_hi[s][1][0], 0u, q_hi[s][1][1], 0u};
        const std::uint32_t a_lo1[4] = {q_lo[s][1][0], 0u, q_lo[s][1][1], 0u};
        detail::mma_16816<T>(c, a_hi0, b.x, b.y);
        detail::mma_16816<T>(c, a_lo0, b.x, b.y);
        detail::mma_16816<T>(c, a_hi1, b.z, b.w);
        detail::mma_16816<T>(c, a_lo1, b.z, b.w);
      }
      if (g < Group) {
        logits[g * stride + first + 8 * tile + 2 * quad] = c[0];
        logits[g * stride + first + 8 * tile + 2 * quad + 1] = c[1];
      }
    }
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/collective/score_mma.cuh> ----

// ---- begin <kvmosaic/cuda/collective/warp_attend_mma.cuh> ----
/// \file
/// Warp-level dense attention on tensor cores, FlashAttention-2 style, for one GQA group: the
/// group's query heads are the N columns of m16n8k16 tiles (padded to 8), tokens and channels the
/// M rows; K and V rows come from 128-byte-swizzled shared-memory tiles (written by TMA or
/// expanded from a compressed page), q.k and p.v are both MMAs, and the logits never leave
/// registers (the C fragment of q.k, transposed with movmatrix, is the B fragment of p.v).
///
/// Two operand paths (`operand_path`): `fold` reads K and V with ldmatrix from swizzled shared
/// tiles; `fold_chunks` takes them from a row source, each lane loading whole 16-byte chunks of
/// K and V rows straight into its fragments. The channel order inside the MMAs is the reduction's
/// (q.k) or the output's (p.v) to choose, so it is permuted until a lane's fragment registers are
/// whole chunks; the queries are staged, and the output stored, in the matching order.
///
/// Precision: q (scaled) and p are each split into hi + lo halves in the storage type and both
/// halves are multiplied, so they keep about 16 (bf16) or 22 (f16) bits; K and V are exact in
/// their storage type; accumulation is fp32. Each warp keeps its own online-softmax state for 16
/// tokens per stage; the CTA merges the warps' states at the end of a split.


// ---- begin <kvmosaic/cuda/collective/row_sources.cuh> ----
/// \file
/// Dense row sources of `warp_attend_mma::fold_chunks`: K or V rows that a lane reads one 16-byte
/// chunk (8 channels) at a time straight into its MMA fragments. A row source has
///   void pairs(int row, int chunk, uint4 (&x)[2])           channels 8 chunk .. 8 chunk + 15 of
///                                                           a row (chunk even), 16-bit pairs,
///                                                           lower channel in the low half
///   void values(int row, int chunk, std::uint32_t (&v)[8])  channels 8 chunk .. 8 chunk + 7,
///                                                           one value per register
/// and reads rows past its data as zeros. A source whose `pairs` costs about one `values` (one
/// locate for both chunks) says so with `static constexpr bool gathers_value_pairs = true`, and
/// `fold_chunks` then reads its V rows by `pairs` too. A format adds its own sources next to its kernels
/// (bitmap_tiles: `bitmap_page_rows`, cuda/format/bitmap_tiles/expand.cuh).


// ---- begin <kvmosaic/cuda/detail/tile_layout.cuh> ----
/// \file
/// Addressing of dense K or V tiles in shared memory, as the attention collectives read them:
/// the 128-byte-swizzled layout of the tensor-core collective and plain rows for the SIMT one.
/// Pure index arithmetic; the kernels that fill tiles (a format's expansion, a TMA box) and
/// the row sources that read them (collective/row_sources.cuh) share it.


namespace kvmosaic::cuda {

/// Dense tile addressing: the 128-byte-swizzled layout of the tensor-core collective (64-channel
/// blocks of `Tokens` rows of 128 bytes; 16-byte chunk k of row r at chunk k ^ (r mod 8)).
/// `column(c).at(t)` hoists what is constant along a K tile in the paper's layout (a channel),
/// leaving 2-4 integer operations per element.
template <int Tokens>
struct swizzled_tile {
  struct column_address {
    std::uint32_t base, chunk_key;
    /// Byte offset of (token, this channel): t * 128 + ((t mod 8) ^ chunk) * 16 + base.
    __device__ __forceinline__ std::uint32_t at(std::uint32_t token) const {
      return base + (token << 7) + (((token << 4) & 0x70u) ^ chunk_key);
    }
  };
  __device__ __forceinline__ static column_address column(int channel) {
    return {static_cast<std::uint32_t>((channel / 64) * Tokens * 128 + (channel % 8) * 2),
            static_cast<std::uint32_t>(((channel % 64) / 8) << 4)};
  }
  /// Byte offset of the 16-byte chunk holding channels 8 k .. 8 k + 7 of a token.
  __device__ __forceinline__ static std::uint32_t chunk(int token, int k) {
    return static_cast<std::uint32_t>((k / 8) * Tokens * 128 + token * 128 + (((k % 8) ^ (token & 7)) << 4));
  }
};

/// Dense tile addressing: plain rows of `HeadDim` 16-bit values (the SIMT collective's layout).
template <int HeadDim>
struct row_major_tile {
  struct column_address {
    std::uint32_t base;
    __device__ __forceinline__ std::uint32_t at(std::uint32_t token) const { return base + token * (HeadDim * 2); }
  };
  __device__ __forceinline__ static column_address column(int channel) {
    return {static_cast<std::uint32_t>(channel * 2)};
  }
  __device__ __forceinline__ static std::uint32_t chunk(int token, int k) {
    return static_cast<std::uint32_t>((token * HeadDim + k * 8) * 2);
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/detail/tile_layout.cuh> ----

namespace kvmosaic::cuda {

/// Whether row source `Rows` asks to be read two chunks at a time for V (`gathers_value_pairs`;
/// false where it does not say).
template <class Rows, class = void>
struct gathers_value_pairs : std::false_type {};
template <class Rows>
struct gathers_value_pairs<Rows, std::void_t<decltype(Rows::gathers_value_pairs)>>
    : std::integral_constant<bool, Rows::gathers_value_pairs> {};

/// Splits 4 registers of 16-bit pairs into 8 zero-extended values.
__device__ __forceinline__ void unpack_pairs(const uint4& x, std::uint32_t (&v)[8]) {
  const std::uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = words[i] & 0xffffu;
    v[2 * i + 1] = words[i] >> 16;
  }
}

/// The 8 dense values of a chunk: v[j] = the next value at `cursor` where bit j of `mask` is set,
/// else 0 (16-bit values, zero-extended). Per value a predicated 16-bit load and cursor step,
/// whatever the sparsity: every lane runs the same instructions and the 8 loads are independent.
template <class Cursor>
__device__ __forceinline__ void load_chunk_values(std::uint32_t mask, Cursor cursor, std::uint32_t (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = (mask >> j) & 1u ? cursor.next() : 0u;
}

/// 8 values (zero-extended 16-bit) as 4 registers of pairs, the lower channel in the low half.
__device__ __forceinline__ uint4 pack_pairs(const std::uint32_t (&v)[8]) {
  return make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410), __byte_perm(v[4], v[5], 0x5410),
                    __byte_perm(v[6], v[7], 0x5410));
}

/// `rows` dense rows of `HeadDim` 16-bit values at `base` in global memory (the dense tail):
/// one 16-byte load per chunk, zeros past the last row.
template <int HeadDim>
struct global_dense_rows {
  const std::byte* base;
  int rows;

  __device__ __forceinline__ uint4 chunk_at(int row, int chunk) const {
    return row < rows ? *reinterpret_cast<const uint4*>(base + (static_cast<std::size_t>(row) * HeadDim + chunk * 8) * 2)
                      : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void pairs(int row, int chunk, uint4 (&x)[2]) const {
    x[0] = chunk_at(row, chunk);
    x[1] = chunk_at(row, chunk + 1);
  }
  __device__ __forceinline__ void values(int row, int chunk, std::uint32_t (&v)[8]) const {
    unpack_pairs(chunk_at(row, chunk), v);
  }
};

/// A dense tile in shared memory in the 128-byte-swizzled layout `swizzled_tile<Tokens>` (K
/// scattered from the paper's layout): one conflict-free 16-byte shared load per chunk.
template <int Tokens>
struct swizzled_tile_rows {
  std::uint32_t base;  ///< shared address of the tile

  __device__ __forceinline__ uint4 chunk_at(int row, int chunk) const {
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(base + swizzled_tile<Tokens>::chunk(row, chunk)));
    return x;
  }
  __device__ __forceinline__ void pairs(int row, int chunk, uint4 (&x)[2]) const {
    x[0] = chunk_at(row, chunk);
    x[1] = chunk_at(row, chunk + 1);
  }
  __device__ __forceinline__ void values(int row, int chunk, std::uint32_t (&v)[8]) const {
    unpack_pairs(chunk_at(row, chunk), v);
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/collective/row_sources.cuh> ----

// ---- begin <kvmosaic/cuda/detail/tma.cuh> ----
/// \file
/// Hopper tensor-memory-accelerator (TMA) pieces for the dense decode kernel: 2D tiled copies of
/// rows into shared memory with the 128-byte swizzle, the matching swizzled addressing, and
/// `ldmatrix` (plain and transposed) on such tiles. The swizzle puts 16-byte chunk c of row r at
/// chunk c ^ (r mod 8), so the eight rows an `ldmatrix` reads land in eight different banks.
/// Executed only on sm_90+; compiled everywhere.




namespace kvmosaic::cuda::detail {

/// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled tile whose
/// base is 1024-byte aligned.
__device__ __forceinline__ std::uint32_t swizzled_offset(int row, int chunk) {
  return static_cast<std::uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

/// Copies the box at element coordinates (x, y) of `map` into shared memory at `destination`
/// (1024-byte aligned), completing on `barrier`.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* map, int x, int y,
                                            std::uint64_t* barrier) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          shared_address(destination)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(shared_address(barrier)), "r"(x), "r"(y)
      : "memory");
#else
  (void)destination;
  (void)map;
  (void)x;
  (void)y;
  (void)barrier;
  __trap();
#endif
}

/// Starts fetching the tensor map `map` (a `__grid_constant__` kernel parameter) into the TMA
/// unit's descriptor cache, so the first copy through it does not wait for that fetch.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if KVMOSAIC_HAS_BULK_COPY
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
#else
  (void)map;
#endif
}

/// Four 8x8 16-bit matrices; lane i gives the address of row (i % 8) of matrix (i / 8).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
#else
  (void)r;
  (void)row_address;
  __trap();
#endif
}

/// As ldmatrix_x4, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_address)));
#else
  (void)r;
  (void)row_address;
  __trap();
#endif
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/tma.cuh> ----

namespace kvmosaic::cuda {

/// How K and V reach a `warp_attend_mma`'s fragments; it fixes the channel order of its MMAs.
enum class operand_path {
  /// ldmatrix from 128-byte-swizzled shared tiles (`fold`): channels in natural order.
  shared_tiles,
  /// Lanes load 16-byte row chunks themselves (`fold_chunks`). q.k: lane 4 g + q takes channels
  /// 64 b + 16 q .. 64 b + 16 q + 15 of 64-channel block b for rows g and g + 8, so chunk 8 b +
  /// 2 q + h (h = 0, 1) holds k-steps 4 b + 2 h and 4 b + 2 h + 1. p.v: lane group g takes the
  /// output channels [g D / 8, (g + 1) D / 8), chunk g D / 64 + h (tiles 4 h .. 4 h + 3), of
  /// tokens 2 q, 2 q + 1, 2 q + 8, 2 q + 9.
  row_chunks,
};

/// One warp's share of a split: its running (m, l, o) for the group's heads. Both products are
/// computed transposed, so the tokens and channels are the M rows of the tiles and the heads the N
/// columns (8): S^T = K Q^T (16 tokens x 8 columns per warp) and O^T += V^T P^T (16 channels x 8
/// columns). No row of an MMA is padding, and the C fragment of one product becomes the B
/// fragment of the next by one `movmatrix` transpose per 8x8 block. q and p are each split into
/// hi + lo halves in T: for groups of 4 heads or fewer the halves share the 8 columns (one MMA
/// per 16 channels), for 5-8 heads each half has its own MMA. Lane 4 g + q holds two heads (2 q,
/// 2 q + 1; packed, 2 (q mod 2) and 2 (q mod 2) + 1 of its hi or lo half): their m, a partial l
/// over its tokens g and g + 8 of each fold, and o for rows g and g + 8 of every 16-channel output
/// tile c (channels 16 c + g and 16 c + g + 8 on `shared_tiles`; `output_channel`). The group's
/// queries live in shared memory (`stage_queries`, one copy for the CTA) and are read as B
/// fragments with ldmatrix.
/// Per 16 tokens and head_dim D: D / 8 MMAs (packed; D / 4 otherwise), D / 32 (D / 16) ldmatrix of
/// q, one online-softmax step (6 shuffles; packed, 4 more), o rescaled only when some head's
/// running max moved, and the K and V operands: D / 16 ldmatrix of each (`fold`), or per lane D / 8
/// K chunks and D / 16 V chunks from the row sources (`fold_chunks`).
template <class T, int HeadDim, int Group, int StageTokens, operand_path Path = operand_path::shared_tiles>
struct warp_attend_mma {
  static_assert(Group >= 1 && Group <= 8, "the group's query heads fill the 8 columns of the tile");
  static_assert(HeadDim % 64 == 0, "K and V tiles are 64-channel (128-byte) swizzled blocks");
  static constexpr int tokens_per_warp = 16;
  static constexpr int k_steps = HeadDim / 16;
  static constexpr int channel_tiles = HeadDim / 16;  ///< 16-channel M tiles of O^T
  static constexpr int block_bytes = StageTokens * 128;  ///< one 64-channel block of a stage
  /// Row pitch of the query tiles: 16 bytes of padding puts the 8 rows ldmatrix reads together
  /// in 8 different bank groups.
  static constexpr int query_pitch = HeadDim * 2 + 16;
  /// Shared memory of the query tiles: q_hi and q_lo, 8 rows each.
  static constexpr int query_bytes = 2 * 8 * query_pitch;
  /// Groups of 4 heads or fewer put q_hi and q_lo (and p_hi and p_lo) side by side in the 8 N
  /// columns, so each product is one MMA per 16 channels instead of two; the hi and lo halves of
  /// a head (columns h and 4 + h, lanes q and q ^ 2) are summed by a shuffle after q.k (the
  /// logits) and at the end of the split (o).
  static constexpr bool packed = Group <= 4;

  float o[channel_tiles][4];  ///< (channel 16 c + g, heads 2 q, 2 q + 1), (channel 16 c + g + 8, same)
  float m[2];                 ///< heads 2 q, 2 q + 1
  float l[2];                 ///< partial: this lane's tokens only (`total_l` sums the 8 lanes of a head)

  __device__ __forceinline__ static int lane() { return static_cast<int>(threadIdx.x) % 32; }

  /// Every thread of the CTA: writes the group's queries (`q`: [Group][HeadDim] floats), scaled
  /// by `scale` and split into hi + lo halves in T, to the query tiles at `tiles`
  /// (`query_bytes`): packed (Group <= 4), row h holds q_hi and row 4 + h q_lo of head h; else
  /// rows 0-7 hold q_hi and rows 8-15 q_lo. Rows of heads past the group are zero. Channels are
  /// in the path's reduction order (`reduction_position`). A barrier must follow before a fold.
  __device__ __forceinline__ static void stage_queries(const float* q, float scale, std::byte* tiles, int threads) {
    for (int index = static_cast<int>(threadIdx.x); index < 8 * HeadDim; index += threads) {
      const int row = index / HeadDim, channel = index % HeadDim;
      const int head = packed ? row % 4 : row;
      const float x = head < Group ? q[head * HeadDim + channel] * scale : 0.0f;
      const T hi = detail::to_operand<T>(x);
      const T lo = detail::to_operand<T>(x - to_float(hi));
      const int at = reduction_position(channel) * 2;
      if constexpr (packed) {
        *reinterpret_cast<T*>(tiles + row * query_pitch + at) = row < 4 ? hi : lo;
      } else {
        *reinterpret_cast<T*>(tiles + row * query_pitch + at) = hi;
        *reinterpret_cast<T*>(tiles + (8 + row) * query_pitch + at) = lo;
      }
    }
  }

  /// Empty state.
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int c = 0; c < channel_tiles; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
    m[0] = m[1] = -HUGE_VALF;
    l[0] = l[1] = 0.0f;
  }

  /// The 16-row mask of a warp's rows [first, first + 16) when a stage holds `n` tokens.
  __device__ __forceinline__ static std::uint32_t rows_before(int first, int n) {
    const int rows = n - first;
    return rows >= 16 ? 0xffffu : rows <= 0 ? 0u : (1u << rows) - 1u;
  }

  /// Folds the warp's 16 tokens [first, first + 16) of a stage (K and V tiles in shared memory)
  /// into the state: those whose bit in `rows` is set (bit r: token first + r; `rows_before` for
  /// the first n tokens of a stage, and-ed with a selection's row mask). With `logits` (a step
  /// that records token scores), the scaled logit of token first + r and head j goes to
  /// logits[r * Group + j] for every r whose bit is set in `covered` (-inf where `rows` masks
  /// it): one store per row and head, none without. Whole-warp: every lane calls it.
  __device__ __forceinline__ void fold(const std::byte* k_tile, const std::byte* v_tile, const std::byte* query_tiles,
                                       int first, std::uint32_t rows, float* logits = nullptr,
                                       std::uint32_t covered = 0) {
    static_assert(Path == operand_path::shared_tiles, "fold reads swizzled tiles: use fold_chunks for row_chunks");
    const int i = lane();
    // S^T = K Q^T: A = K rows (ldmatrix: matrices (tokens 0-7 | 8-15) x (channels 0-7 | 8-15)),
    // B = q rows as columns (ldmatrix: rows = heads, two 8-channel matrices per k16 step).
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int k_token = first + (i % 8) + 8 * ((i / 8) % 2);
#pragma unroll
    for (int k = 0; k < k_steps; k += 2) {
      std::uint32_t a[2][4];
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int chunk = 2 * (k + step) + i / 16;
        detail::ldmatrix_x4(a[step], k_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(k_token, chunk % 8));
      }
      multiply_queries(s, a[0], a[1], query_tiles, k / 2);
    }
    const p_fragments p = online_softmax(s, rows, logits, covered);
    const int v_token = first + (i % 8) + 8 * (i / 16);
#pragma unroll
    for (int c = 0; c < channel_tiles; ++c) {
      std::uint32_t a[4];
      const int chunk = 2 * c + (i / 8) % 2;  // ldmatrix.trans: (channels 0-7 | 8-15) x (tokens 0-7 | 8-15)
      detail::ldmatrix_x4_trans(a, v_tile + (chunk / 8) * block_bytes + detail::swizzled_offset(v_token, chunk % 8));
      accumulate(o[c], a, p);
    }
  }

  /// `fold` with K and V taken from row sources instead of tiles (row_sources.cuh):
  /// `k_rows.pairs(token, chunk, x)` gives channels 8 chunk .. 8 chunk + 15 of K row `token` as
  /// 16-bit pairs, and `v_rows.values(token, chunk, v)` channels 8 chunk .. 8 chunk + 7 of V as 8
  /// registers (one value each, zero-extended). Rows past the data must read as zeros. A V source
  /// that locates two chunks for the price of one (`gathers_value_pairs`) is read with `pairs`
  /// instead, two chunks per call, where head_dim >= 128.
  /// Per lane and 16 tokens: D / 8 K chunks (tokens g and g + 8) and D / 16 V chunks (tokens
  /// 2 q, 2 q + 1, 2 q + 8, 2 q + 9); no shared tile and no CTA barrier.
  template <class KRows, class VRows>
  __device__ __forceinline__ void fold_chunks(const KRows& k_rows, const VRows& v_rows, const std::byte* query_tiles,
                                              int first, std::uint32_t rows, float* logits = nullptr,
                                              std::uint32_t covered = 0) {
    static_assert(Path == operand_path::row_chunks, "fold_chunks needs the row_chunks channel order");
    const int i = lane(), g = i / 4, q = i % 4;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int block = 0; block < HeadDim / 64; ++block) {  // k-steps 4 block .. 4 block + 3: two chunks per row
      uint4 upper[2], lower[2];
      k_rows.pairs(first + g, 8 * block + 2 * q, upper);
      k_rows.pairs(first + g + 8, 8 * block + 2 * q, lower);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::uint32_t a0[4] = {upper[half].x, lower[half].x, upper[half].y, lower[half].y};
        const std::uint32_t a1[4] = {upper[half].z, lower[half].z, upper[half].w, lower[half].w};
        multiply_queries(s, a0, a1, query_tiles, 2 * block + half);
      }
    }
    const p_fragments p = online_softmax(s, rows, logits, covered);
    constexpr int chunks_per_group = HeadDim / 64;  // output channels of a lane group, in chunks
    if constexpr (gathers_value_pairs<VRows>::value && chunks_per_group % 2 == 0) {
      // Two chunks per call (`pairs`): one locate for 16 channels of a row, 8 output tiles at once.
#pragma unroll
      for (int part = 0; part < chunks_per_group; part += 2) {  // channel tiles 4 part .. 4 part + 7
        const int chunk = g * chunks_per_group + part;
        std::uint32_t a[8][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // tokens (2 q, 2 q + 1), then (2 q + 8, 2 q + 9)
          uint4 even[2], odd[2];
          v_rows.pairs(first + 2 * q + 8 * half, chunk, even);
          v_rows.pairs(first + 2 * q + 8 * half + 1, chunk, odd);
#pragma unroll
          for (int tile = 0; tile < 8; ++tile) {  // word tile % 4 of the pair: channels 2 (tile % 4), + 1
            const uint4& ev = even[tile / 4];
            const uint4& od = odd[tile / 4];
            const std::uint32_t ew = tile % 4 == 0 ? ev.x : tile % 4 == 1 ? ev.y : tile % 4 == 2 ? ev.z : ev.w;
            const std::uint32_t ow = tile % 4 == 0 ? od.x : tile % 4 == 1 ? od.y : tile % 4 == 2 ? od.z : od.w;
            a[tile][2 * half] = __byte_perm(ew, ow, 0x5410);
            a[tile][2 * half + 1] = __byte_perm(ew, ow, 0x7632);
          }
        }
#pragma unroll
        for (int tile = 0; tile < 8; ++tile) accumulate(o[4 * part + tile], a[tile], p);
      }
    } else {
#pragma unroll
      for (int part = 0; part < chunks_per_group; ++part) {  // channel tiles 4 part .. 4 part + 3
        const int chunk = g * chunks_per_group + part;
        std::uint32_t a[4][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // tokens (2 q, 2 q + 1), then (2 q + 8, 2 q + 9)
          std::uint32_t even[8], odd[8];
          v_rows.values(first + 2 * q + 8 * half, chunk, even);
          v_rows.values(first + 2 * q + 8 * half + 1, chunk, odd);
#pragma unroll
          for (int tile = 0; tile < 4; ++tile) {  // row g: channel 2 tile of the chunk; row g + 8: the next
            a[tile][2 * half] = __byte_perm(even[2 * tile], odd[2 * tile], 0x5410);
            a[tile][2 * half + 1] = __byte_perm(even[2 * tile + 1], odd[2 * tile + 1], 0x5410);
          }
        }
#pragma unroll
        for (int tile = 0; tile < 4; ++tile) accumulate(o[4 * part + tile], a[tile], p);
      }
    }
  }
  /// What `fold` writes for a warp whose rows are all masked (and so skips the fold): -inf at
  /// logits[r * Group + j] for every row r in `covered`. Whole-warp.
  __device__ __forceinline__ static void write_masked_logits(float* logits, std::uint32_t covered) {
    for (int index = lane(); index < 16 * Group; index += 32)
      if ((covered >> (index / Group)) & 1u) logits[index] = -HUGE_VALF;
  }

  /// The warp's state to `temp` (`o[warp][head][channel]`, `m[warp][head]`, `l[warp][head]`, heads
  /// below Group): whole-warp, once at the end of a split.
  template <class Temp>
  __device__ __forceinline__ void store(Temp& temp, int warp) const {
    const int i = lane(), g = i / 4, q = i % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = l[h];
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
      const int head = packed ? 2 * (q % 2) + h : 2 * q + h;
      const bool writes = head < Group && (!packed || q < 2);
#pragma unroll
      for (int c = 0; c < channel_tiles; ++c) {
        float low = o[c][h], high = o[c][2 + h];
        if constexpr (packed) {  // o_hi + o_lo of the head
          low += __shfl_xor_sync(0xffffffffu, low, 2);
          high += __shfl_xor_sync(0xffffffffu, high, 2);
        }
        if (writes) {
          temp.o[warp][head][output_channel(c, g)] = low;
          temp.o[warp][head][output_channel(c, g + 8)] = high;
        }
      }
      if (writes && g == 0) {
        temp.m[warp][head] = m[h];
        temp.l[warp][head] = total;
      }
    }
  }

 private:
  /// Where channel `channel` of q sits in the reduction order of q.k: position 16 s + kk is
  /// k-step s, row kk of the B fragment. Natural for `shared_tiles`; for `row_chunks`, channel
  /// 64 b + 16 q + 8 h + j (j < 8) is step 4 b + 2 h + j / 4, row 2 q + j % 2 (+ 8 for j % 4 >= 2).
  __device__ __forceinline__ static int reduction_position(int channel) {
    if constexpr (Path == operand_path::shared_tiles) {
      return channel;
    } else {
      const int block = channel / 64, q = (channel % 64) / 16, h = (channel % 16) / 8, j = channel % 8;
      return 16 * (4 * block + 2 * h + j / 4) + 2 * q + j % 2 + 8 * ((j / 2) % 2);
    }
  }

  /// The channel of row `row` (0-15) of output tile c (O^T's M rows).
  __device__ __forceinline__ static int output_channel(int c, int row) {
    if constexpr (Path == operand_path::shared_tiles)
      return 16 * c + row;
    else
      return (row % 8) * (HeadDim / 8) + 2 * c + row / 8;
  }

  /// P^T as the B fragments of p.v: packed, `hi` holds both halves (lanes q < 2 the hi columns,
  /// q >= 2 the lo ones) and `lo` is unused; else each half has its own pair.
  struct p_fragments {
    std::uint32_t hi[2], lo[2];
  };

  /// s += the k-steps 2 pair and 2 pair + 1 of K Q^T, given their A fragments: q's B fragments
  /// (hi, and lo unless packed) come from the query tiles with one ldmatrix.x4 each.
  __device__ __forceinline__ static void multiply_queries(float (&s)[4], const std::uint32_t (&a0)[4],
                                                          const std::uint32_t (&a1)[4], const std::byte* query_tiles,
                                                          int pair) {
    const int i = lane(), q_chunk = 4 * pair + i / 8;
    std::uint32_t q_hi[4], q_lo[4];  // b0, b1 of both steps (packed: hi and lo columns)
    detail::ldmatrix_x4(q_hi, query_tiles + (i % 8) * query_pitch + q_chunk * 16);
    detail::mma_16816<T>(s, a0, q_hi[0], q_hi[1]);
    detail::mma_16816<T>(s, a1, q_hi[2], q_hi[3]);
    if constexpr (!packed) {
      detail::ldmatrix_x4(q_lo, query_tiles + (8 + i % 8) * query_pitch + q_chunk * 16);
      detail::mma_16816<T>(s, a0, q_lo[0], q_lo[1]);
      detail::mma_16816<T>(s, a1, q_lo[2], q_lo[3]);
    }
  }

  /// The online-softmax step of a fold: completes the logits `s` (S^T's C fragment; packed, adds
  /// the hi and lo columns), masks the rows not in `rows`, moves m and l, rescales o where a
  /// running max moved, and returns P^T as B fragments (movmatrix of the packed C fragment).
  __device__ __forceinline__ p_fragments online_softmax(float (&s)[4], std::uint32_t rows, float* logits,
                                                        std::uint32_t covered) {
    const int i = lane(), g = i / 4;
    if constexpr (packed)  // q_hi.k + q_lo.k: columns h and 4 + h sit in lanes q and q ^ 2
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] += __shfl_xor_sync(0xffffffffu, s[e], 2);
    // Per head over the 16 tokens: this lane has tokens g (s[0..1]) and g + 8 (s[2..3]) of heads
    // 2 q, 2 q + 1; the 8 lanes of a quad position share the heads.
    if (((rows >> g) & 1u) == 0) s[0] = s[1] = -HUGE_VALF;
    if (((rows >> (g + 8)) & 1u) == 0) s[2] = s[3] = -HUGE_VALF;
    if (logits != nullptr) write_logits(s, logits, covered);
    float rescale[2], p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(s[h], s[2 + h]);
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      const float m_new = fmaxf(m[h], tile_max);
      const bool any = m_new != -HUGE_VALF;  // false only while no token was valid for this warp
      rescale[h] = any ? __expf(m[h] - m_new) : 1.0f;
      p[h] = s[h] == -HUGE_VALF ? 0.0f : __expf(s[h] - m_new);
      p[2 + h] = s[2 + h] == -HUGE_VALF ? 0.0f : __expf(s[2 + h] - m_new);
      l[h] = l[h] * rescale[h] + (p[h] + p[2 + h]);
      if (any) m[h] = m_new;
    }
    // Rescaling is needed only where a running max moved: after the first folds, rarely.
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int c = 0; c < channel_tiles; ++c) {
        o[c][0] *= rescale[0];
        o[c][1] *= rescale[1];
        o[c][2] *= rescale[0];
        o[c][3] *= rescale[1];
      }
    }
    // The C fragment (token rows, head columns) packed to T, each 8x8 block transposed in
    // registers (b0: tokens 0-7, b1: tokens 8-15, column = head g). p = hi + lo.
    float hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) hi[e] = detail::round_operand<T>(p[e]);
    p_fragments f;
    if constexpr (packed) {
      const bool lo_lane = (i % 4) >= 2;
      float half[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) half[e] = lo_lane ? p[e] - hi[e] : hi[e];
      f.hi[0] = detail::transpose_8x8(detail::pack_pair<T>(half[0], half[1]));
      f.hi[1] = detail::transpose_8x8(detail::pack_pair<T>(half[2], half[3]));
      f.lo[0] = f.lo[1] = 0u;
    } else {
      f.hi[0] = detail::transpose_8x8(detail::pack_pair<T>(hi[0], hi[1]));
      f.hi[1] = detail::transpose_8x8(detail::pack_pair<T>(hi[2], hi[3]));
      f.lo[0] = detail::transpose_8x8(detail::pack_pair<T>(p[0] - hi[0], p[1] - hi[1]));
      f.lo[1] = detail::transpose_8x8(detail::pack_pair<T>(p[2] - hi[2], p[3] - hi[3]));
    }
    return f;
  }

  /// Stores the logits `s` of this lane (tokens g and g + 8, heads 2 q and 2 q + 1; packed, the
  /// lanes q < 2 hold heads 2 q and 2 q + 1 of the sum) for the rows in `covered`.
  __device__ __forceinline__ static void write_logits(const float (&s)[4], float* logits, std::uint32_t covered) {
    const int i = lane(), g = i / 4, q = i % 4;
    if (packed && q >= 2) return;  // the hi + lo sum is in lanes q and q ^ 2 alike
    const int head = 2 * q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = g + 8 * half;
      if (((covered >> row) & 1u) == 0) continue;
      float* at = logits + row * Group + head;
      if constexpr (Group % 2 == 0) {
        if (head < Group) *reinterpret_cast<float2*>(at) = make_float2(s[2 * half], s[2 * half + 1]);
      } else {
        if (head < Group) at[0] = s[2 * half];
        if (head + 1 < Group) at[1] = s[2 * half + 1];
      }
    }
  }

  /// o_tile += (one 16-channel tile of V^T, as an A fragment) P^T.
  __device__ __forceinline__ static void accumulate(float (&o_tile)[4], const std::uint32_t (&a)[4],
                                                    const p_fragments& p) {
    detail::mma_16816<T>(o_tile, a, p.hi[0], p.hi[1]);
    if constexpr (!packed) detail::mma_16816<T>(o_tile, a, p.lo[0], p.lo[1]);
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/collective/warp_attend_mma.cuh> ----

// ---- begin <kvmosaic/cuda/detail/dependent_launch.cuh> ----
/// \file
/// Programmatic dependent launch (sm_90 and later): a kernel launched with `overlap_prior` set
/// may be scheduled while the kernel before it in the stream still runs. Its CTAs start, set up
/// what does not depend on the earlier kernel, and block in `wait_for_prior_grid()` until that
/// kernel has completed and its writes are visible. Why: a decode step is three kernels (the
/// metadata pull, the split kernel, the merge), and each boundary otherwise costs a full launch
/// (the grid drains, then the next one is scheduled from scratch): a few microseconds, which at
/// batch 1 and short contexts is a tenth of the step. Captured launches keep the overlap in a
/// CUDA graph (a programmatic edge).
///
/// The contract a kernel launched this way must keep: nothing it reads that an earlier kernel in
/// the stream writes, and nothing it writes that an earlier kernel reads, before
/// `wait_for_prior_grid()`. A kernel calls `allow_dependent_grids()` as early as it likes: the
/// dependent kernel still waits for this one to complete before it touches memory. Both are no-ops
/// when compiled for an architecture before sm_90, and `wait_for_prior_grid()` returns at once in
/// a kernel launched without the attribute.




namespace kvmosaic::cuda::detail {

/// Blocks until every grid this one was launched to overlap has completed and its memory
/// operations are visible (PTX `griddepcontrol.wait`). Every thread that reads or writes memory
/// shared with the earlier kernel must have passed it (or a barrier after it).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the next kernel of the stream, if launched with `overlap_prior`, be scheduled once every
/// CTA of this grid has called this or exited (PTX `griddepcontrol.launch_dependents`).
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Launches `kernel<<<grid, block, shared_bytes, stream>>>(args...)`; with `overlap_prior`, as a
/// programmatic dependent of the stream's previous kernel (the caller passes true only on sm_90
/// and later devices, and only for kernels that keep the contract above). Cost: that of a launch.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   bool overlap_prior, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = overlap_prior ? &attribute : nullptr;
  config.numAttrs = overlap_prior ? 1 : 0;
  KVMOSAIC_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/dependent_launch.cuh> ----

namespace kvmosaic::cuda::kernel {

/// Where a step's data lives and how it is laid out (see host/backend.hpp for the layouts).
struct decode_params {
  const std::byte* pages;             ///< page arena: slot = [K: heads x k_page_bytes][V: heads x v_page_bytes]
  const std::byte* tails;             ///< tail arena: slot = [K: heads x tail_head_bytes][V: same]
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  std::int64_t tail_slot_bytes;
  std::int64_t tail_head_bytes;
  int num_kv_heads;
  int page_size;
  int group_size;                     ///< query heads per KV head (for kernels where it is a run-time value)
  int sink_rows;                      ///< S: exact sink rows a tail head keeps (masked in a sequence's
                                      ///< first page by the step's row masks)
  int exact_rows;                     ///< S + W: the exact rows (window ring, sinks) before a tail
                                      ///< head's tail rows (host/backend.hpp's layout)

  /// device: [0] splits this step, [1] row stride of `block_tables`, [2] its KV-head stride (0:
  /// one table per sequence; a selection's tables are per (sequence, KV head)), [3] row stride of
  /// `sequence_tables`
  const std::int32_t* step_header;
  const std::int32_t* block_tables;   ///< the pages each split reads: [batch][header[1]], head h at h * header[2]
  const std::int32_t* sequence_tables;///< every sealed page of each sequence, in order: [batch][header[3]]
  const std::int32_t* sealed_pages;   ///< [batch] pages each sequence has (all, selected or not)
  const std::int32_t* tail_slots;     ///< [batch]
  const std::int32_t* tail_rows;      ///< [batch]
  const split_work* work;             ///< [grid's CTAs in x]; this step's splits first (graph replay)
  /// Token-granular selections (sub-page `select::quest` blocks, `select::sentence_chunks`): per
  /// entry of `block_tables`, `mask_words` 32-bit words whose bit r of word w says page row
  /// 32 w + r is read. Null: every row of every listed page.
  const std::uint32_t* token_masks;
  int mask_words;
  /// Null, or [batch][num_kv_heads]: the entries a selection wrote in each table, at most the
  /// plan's `planned_pages[b]`; the splits of a sequence then share them in proportion.
  const std::int32_t* table_lengths;
  const std::int32_t* planned_pages;  ///< [batch] the entries the split plan covers
  const std::int32_t* partial_offset; ///< [batch + 1]

  const float* q;                     ///< [batch][num_q_heads][head_dim]
  float softmax_scale;
  float* partial_o;                   ///< [work capacity][num_q_heads][head_dim], normalized per split
  float* partial_lse;                 ///< [work capacity][num_q_heads], natural log
  void* out;                          ///< [batch][num_q_heads][head_dim] at `out_strides`, in the
                                      ///< merge kernel's output type
  std::int64_t out_strides[3];        ///< elements per batch entry, query head, channel
  float* lse;                         ///< null, or [batch][num_q_heads] at `lse_strides`: each head's
                                      ///< log-sum-exp of its scaled logits (natural log)
  std::int64_t lse_strides[2];
  /// Null, or [batch][num_kv_heads][logit_slots][group_size] fp32: a step that records token
  /// scores has each split write the scaled logit of every row it folds (-inf for a row it masks),
  /// at the row's place in its sequence's read order: block-table entry x page_size + page row,
  /// then, from sealed pages x page_size on, the run of exact and tail rows. Written for every row
  /// of [0, that run's end) the step covers; `kernel::token_scores_kernel` normalizes them.
  float* token_logits;
  std::int64_t logit_slots;
};

/// The parameters of a format's split kernel: the shared `decode_params` and the format's own
/// (`device_format<Format>::params`, cuda/format/device_format.cuh).
template <class FormatParams>
struct split_params : decode_params {
  FormatParams format;
};

/// Shared memory of the CTA-level reduction across token rows.
template <int Group, int HeadDim, int Rows>
struct decode_temp_storage {
  float o[Rows][Group][HeadDim];
  float m[Rows][Group];
  float l[Rows][Group];
};

namespace detail_decode {

/// Every split kernel's first step. Waits for the kernel before it in the stream (the metadata
/// pull, or the selection), which it may overlap (programmatic dependent launch on sm_90); lets
/// the merge kernel be scheduled (it waits for this grid to complete); loads this CTA's work
/// entry `w`; and says whether the CTA has a split: the grid is sized for the largest plan (graph
/// replay), a step may use fewer. The split count and the entry are loaded together (one round
/// trip, not two: the work array is sized for the grid, so the load is in bounds either way).
__device__ __forceinline__ bool start_split(const decode_params& p, int work_index, split_work& w) {
  detail::wait_for_prior_grid();
  detail::allow_dependent_grids();
  const int planned = p.step_header[0];
  w = p.work[work_index];
  return work_index < planned;
}

/// The page table a split of sequence `batch` reads for KV head `head`: the sequence's block
/// table, or the pages a selection chose for that head.
__device__ __forceinline__ const std::int32_t* page_table(const decode_params& p, int batch, int head) {
  return p.block_tables + static_cast<std::size_t>(batch) * p.step_header[1] +
         static_cast<std::size_t>(head) * p.step_header[2];
}

/// The entries [begin, end) of its page table that a split reads: the plan's, or, when a
/// selection wrote fewer entries than planned, the same share of those it wrote.
struct split_pages {
  int begin;
  int end;
};
__device__ __forceinline__ split_pages pages_of_split(const decode_params& p, const split_work& w, int head) {
  if (p.table_lengths == nullptr) return {w.page_begin, w.page_end};
  const std::int64_t planned = p.planned_pages[w.batch_index];
  const std::int64_t written = p.table_lengths[static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head];
  if (planned == 0) return {0, 0};
  return {static_cast<int>(w.page_begin * written / planned), static_cast<int>(w.page_end * written / planned)};
}

/// The dense rows the split with the tail reads for sequence `batch`: the exact rows its tail
/// slot holds (min(S + W, sealed tokens)) and its tail rows, one run of `rows` rows starting at
/// row `first` of a tail head.
struct dense_run {
  int first;
  int rows;
};
__device__ __forceinline__ dense_run dense_rows_of(const decode_params& p, int batch) {
  const std::int64_t sealed = static_cast<std::int64_t>(p.sealed_pages[batch]) * p.page_size;
  const int exact = static_cast<int>(sealed < p.exact_rows ? sealed : p.exact_rows);
  return dense_run{p.exact_rows - exact, exact + p.tail_rows[batch]};
}

/// The row mask of entry `entry` of the page table of (`batch`, `head`) (null: every row read).
__device__ __forceinline__ const std::uint32_t* page_rows_read(const decode_params& p, int batch, int head, int entry) {
  if (p.token_masks == nullptr) return nullptr;
  return p.token_masks + (static_cast<std::size_t>(batch) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2] +
                          static_cast<std::size_t>(entry)) * p.mask_words;
}

/// The 16 bits of a row mask for rows [first, first + 16) (first a multiple of 16); all set for
/// a null mask.
__device__ __forceinline__ std::uint32_t sixteen_rows_read(const std::uint32_t* rows_read, int first) {
  return rows_read == nullptr ? 0xffffu : (rows_read[first >> 5] >> (first & 31)) & 0xffffu;
}

/// Where the split's first row (page entry `range.begin`, row 0) writes its logits, or null
/// when the step records no token scores (`decode_params::token_logits`). A split's rows are
/// consecutive in the read order, its tail run after its pages.
__device__ __forceinline__ float* split_logits(const decode_params& p, const split_work& w, int head,
                                               const split_pages& range, int group) {
  if (p.token_logits == nullptr) return nullptr;
  return p.token_logits +
         ((static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * p.logit_slots +
          static_cast<std::size_t>(range.begin) * p.page_size) * group;
}

/// Loads this thread's slice of the group's queries, pre-multiplied by the softmax scale, and
/// starts its state empty.
template <int HeadDim, int Group, int LanesPerRow>
__device__ __forceinline__ void start_state(const decode_params& p, const split_work& w, int head,
                                            thread_state<Group>& s) {
  constexpr int vec = detail::vector_elements;
  const int lane = static_cast<int>(threadIdx.x) % LanesPerRow;
  const int num_q_heads = p.num_kv_heads * Group;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group + g) * HeadDim + lane * vec;
    const float4 a = *reinterpret_cast<const float4*>(q);
    const float4 b = *reinterpret_cast<const float4*>(q + 4);
    const float qs[vec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < vec; ++i) {
      s.q[g][i] = qs[i] * p.softmax_scale;
      s.o[g][i] = 0.0f;
    }
    s.m[g] = -HUGE_VALF;
    s.l[g] = 0.0f;
  }
}

/// Merges the `Rows` states the CTA left in shared memory `temp` (token rows of the SIMT kernels,
/// or warps of the tensor-core kernels) and writes this split's normalized partial output and
/// log-sum-exp, for the first `group` (at most Group, the default) query heads. Starts with a
/// barrier: the caller has just written `temp`.
template <int HeadDim, int Group, int Threads, int Rows>
__device__ __forceinline__ void merge_and_write_partial(const decode_params& p, int work_index, int head,
                                                        const decode_temp_storage<Group, HeadDim, Rows>& temp,
                                                        int group = Group) {
  __syncthreads();
  const int num_q_heads = p.num_kv_heads * group;
  const std::size_t partial_base = static_cast<std::size_t>(work_index) * num_q_heads + head * group;
  for (int index = static_cast<int>(threadIdx.x); index < group * HeadDim; index += Threads) {
    const int g = index / HeadDim, c = index % HeadDim;
    softmax_state<float> total;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      softmax_state<float> part;
      part.m = temp.m[r][g];
      part.l = temp.l[r][g];
      const merge_weights<float> mw = total.merge(part);
      o = o * mw.self + temp.o[r][g][c] * mw.other;
    }
    // A split that a selection left without a token is the empty state: it merges as nothing.
    p.partial_o[(partial_base + g) * HeadDim + c] = total.l > 0.0f ? o / total.l : 0.0f;
    if (c == 0) p.partial_lse[partial_base + g] = total.log_sum_exp();
  }
}

/// The SIMT kernels' epilogue: each token row's state to `temp`, then the merge.
template <int HeadDim, int Group, int Threads, int LanesPerRow>
__device__ __forceinline__ void write_partial(const decode_params& p, int work_index, int head,
                                              const thread_state<Group>& s,
                                              decode_temp_storage<Group, HeadDim, Threads / LanesPerRow>& temp) {
  constexpr int vec = detail::vector_elements;
  const int lane = static_cast<int>(threadIdx.x) % LanesPerRow;
  const int row = static_cast<int>(threadIdx.x) / LanesPerRow;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
#pragma unroll
    for (int i = 0; i < vec; ++i) temp.o[row][g][lane * vec + i] = s.o[g][i];
    if (lane == 0) {
      temp.m[row][g] = s.m[g];
      temp.l[row][g] = s.l[g];
    }
  }
  merge_and_write_partial<HeadDim, Group, Threads, Threads / LanesPerRow>(p, work_index, head, temp);
}

/// The sm_90 kernels' prologue: the split's page ids to shared memory (all threads) and one
/// mbarrier per stage (thread 0). A barrier must follow before either is used.
__device__ __forceinline__ void stage_split_pages(const decode_params& p, const split_work& w, const split_pages& range,
                                                  int head, int threads, int stages, std::int32_t* ids,
                                                  std::uint64_t* full) {
  const int num_pages = range.end - range.begin;
  const std::int32_t* table = page_table(p, w.batch_index, head) + range.begin;
  for (int i = static_cast<int>(threadIdx.x); i < num_pages; i += threads) ids[i] = table[i];
  if (threadIdx.x == 0)
    for (int b = 0; b < stages; ++b) detail::barrier_init(&full[b], 1);
}

/// The tensor-core kernels' epilogue: each warp's `warp_attend_mma` state to `temp`
/// (`Attend::store`), then the CTA merge. `temp` may alias the stage buffers: the caller has
/// passed a barrier after its last read of them.
template <class Attend, int HeadDim, int Group, int Warps>
__device__ __forceinline__ void write_warp_partial(const decode_params& p, int work_index, int head,
                                                   const Attend& state,
                                                   decode_temp_storage<Group, HeadDim, Warps>& temp) {
  state.store(temp, static_cast<int>(threadIdx.x) / 32);
  merge_and_write_partial<HeadDim, Group, Warps * 32, Warps>(p, work_index, head, temp);
}

}  // namespace detail_decode

/// out[b][j] = merge over the splits of b of their normalized partials (lse_s, o_s): weights
/// exp(lse_s - max lse) / sum. One CTA per (sequence, query head), a thread per channel. The
/// max comes from one load per thread (splits beyond HeadDim: more), then, per chunk of HeadDim
/// splits, the weights go to shared memory and every thread's loads of those splits' partials are
/// independent, so they stay in flight together: about 2 + splits / 16 round trips to L2, where a
/// loop of dependent loads per split costs one each (benchmark/README.md, "Decisions the code
/// cites": "merge").
/// `Out`: float, half or bfloat16 (rounded to nearest). With `p.lse`, thread 0 also writes the
/// head's log-sum-exp, max lse + log(sum of weights): what a cascade merge with attention
/// computed elsewhere needs.
template <int HeadDim, class Out>
__global__ void __launch_bounds__(HeadDim) merge_splits_kernel(const decode_params p, int num_q_heads) {
  static_assert(HeadDim % 32 == 0, "merge_splits_kernel: whole warps");
  constexpr int warps = HeadDim / 32;
  __shared__ float weights[HeadDim];
  __shared__ float warp_max[warps];
  detail::wait_for_prior_grid();  // the split kernel's partials (it may still run: dependent launch)
  const int b = static_cast<int>(blockIdx.x) / num_q_heads;
  const int j = static_cast<int>(blockIdx.x) % num_q_heads;
  const int c = static_cast<int>(threadIdx.x);
  const int begin = p.partial_offset[b], splits = p.partial_offset[b + 1] - begin;
  const float* lse = p.partial_lse + static_cast<std::size_t>(begin) * num_q_heads + j;
  const float* partial = p.partial_o + (static_cast<std::size_t>(begin) * num_q_heads + j) * HeadDim + c;
  const std::size_t split_stride = static_cast<std::size_t>(num_q_heads) * HeadDim;
  float max_lse = -HUGE_VALF;
  for (int s = c; s < splits; s += HeadDim) max_lse = fmaxf(max_lse, lse[static_cast<std::size_t>(s) * num_q_heads]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  if (c % 32 == 0) warp_max[c / 32] = max_lse;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < warps; ++w) max_lse = fmaxf(max_lse, warp_max[w]);
  float weight_sum = 0.0f, o = 0.0f;
  for (int chunk = 0; chunk < splits; chunk += HeadDim) {
    const int count = min(HeadDim, splits - chunk);
    // A split without a token (lse = -inf) weighs 0; so does every split if none has one.
    if (c < count) {
      const float split_lse = lse[static_cast<std::size_t>(chunk + c) * num_q_heads];
      weights[c] = split_lse == -HUGE_VALF ? 0.0f : __expf(split_lse - max_lse);
    }
    __syncthreads();
#pragma unroll 16
    for (int s = 0; s < count; ++s) {
      weight_sum += weights[s];
      o = fmaf(weights[s], partial[static_cast<std::size_t>(chunk + s) * split_stride], o);
    }
    __syncthreads();  // the weights are read before the next chunk overwrites them
  }
  // A NaN partial (NaN input) makes the output NaN, as on the host; no token at all gives 0.
  const float value = weight_sum != 0.0f ? o / weight_sum : 0.0f;
  static_cast<Out*>(p.out)[b * p.out_strides[0] + j * p.out_strides[1] + c * p.out_strides[2]] = Out(value);
  if (p.lse != nullptr && c == 0)
    p.lse[b * p.lse_strides[0] + j * p.lse_strides[1]] = weight_sum != 0.0f ? max_lse + logf(weight_sum) : -HUGE_VALF;
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/decode.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/extend.cuh> ----
/// \file
/// Kernels that write new tokens into dense storage (format::dense pages and every format's tail):
/// a prefill chunk of one sequence or one decode token of each sequence in a batch. Rows are
/// rounded to the storage dtype (round to nearest even, as on the host) and go either to the tail
/// or, when they complete a page, straight into that page; a page that a partly filled tail
/// completes first receives the tail's rows (`move_tail_rows_kernel`, launched before the scatter
/// so the scatter may reuse the tail).



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
  std::int64_t tail_head_bytes;   ///< a tail head: the exact rows, then page_size tail rows
  std::int64_t tail_row_offset;   ///< bytes before tail row 0 in a tail head (the exact rows)
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
    const bool to_page = page_index < full_pages;
    std::byte* base = to_page ? p.pages + static_cast<std::int64_t>(p.new_pages[item.first_new_page + page_index]) * p.page_slot_bytes
                              : p.tails + static_cast<std::int64_t>(item.slot) * p.tail_slot_bytes;
    const InT* src = (is_v ? v : k) +
                     ((item.src_row + r) * p.num_kv_heads + head) * static_cast<std::int64_t>(p.head_dim) +
                     vector * detail::vector_elements;
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
// ---- end <kvmosaic/cuda/kernel/extend.cuh> ----

// ---- begin <kvmosaic/cuda/shapes.cuh> ----
/// \file
/// Which kernel shapes a CUDA cache compiles. A shape is (storage dtype, head_dim, GQA group
/// size): the template arguments of every decode kernel. `backend::cuda` compiles every supported
/// shape (2 dtypes x 3 head dims x 8 group sizes); `backend::cuda_for<kernel_shape<...>, ...>`
/// compiles only the listed ones, so an engine that knows its model builds one shape:
///
/// ```cpp
/// using backend = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
/// kvmosaic::cache<kvmosaic::format::quant2, kvmosaic::select::all, kvmosaic::compact::none, backend> kv(config);
/// ```
///
/// A cache whose run-time `cache_config` is not one of its backend's shapes is rejected at
/// construction with an error listing them. `detail::dispatch_shape` is the one place where a
/// run-time shape becomes template arguments.



namespace kvmosaic {

/// One kernel shape: the storage dtype (f16 or bf16), head_dim and GQA group size.
template <dtype Storage, int HeadDim, int GroupSize>
struct kernel_shape {
  static_assert(Storage == dtype::f16 || Storage == dtype::bf16, "kvmosaic::kernel_shape: Storage must be dtype::f16 or dtype::bf16");
  static_assert(limits::is_supported_head_dim(HeadDim), "kvmosaic::kernel_shape: HeadDim must be 64, 128 or 256");
  static_assert(limits::is_supported_group_size(GroupSize), "kvmosaic::kernel_shape: GroupSize must be 1 to 8");
  static constexpr dtype storage = Storage;
  static constexpr int head_dim = HeadDim;
  static constexpr int group_size = GroupSize;
  /// The element type of the storage dtype.
  using element = std::conditional_t<Storage == dtype::f16, half, bfloat16>;
};

namespace backend {
/// Pages in device memory; prefill, append and attention run as CUDA kernels, compiled for the
/// listed `kernel_shape`s only, or for every supported shape when the list is empty.
template <class... Shapes>
struct cuda_for {
  using policy_category = backend_tag;
  static constexpr const char* name = "cuda";
};
/// The CUDA backend with kernels for every supported shape.
using cuda = cuda_for<>;
}  // namespace backend

namespace cuda::detail {

template <class T>
struct is_kernel_shape : std::false_type {};
template <dtype S, int D, int G>
struct is_kernel_shape<kernel_shape<S, D, G>> : std::true_type {};

/// A list of kernel shapes (empty: every supported shape).
template <class... Shapes>
struct shape_list {
  static_assert((is_kernel_shape<Shapes>::value && ...),
                "kvmosaic::backend::cuda_for: every argument must be a kvmosaic::kernel_shape<dtype, head_dim, group_size>");
  static constexpr bool all = sizeof...(Shapes) == 0;

  /// Whether (storage, head_dim, group_size) is a listed shape; group_size 0: any group.
  static bool contains(dtype storage, int head_dim, int group_size) noexcept {
    if constexpr (all) {
      return (storage == dtype::f16 || storage == dtype::bf16) && limits::is_supported_head_dim(head_dim) &&
             (group_size == 0 || limits::is_supported_group_size(group_size));
    } else {
      return ((storage == Shapes::storage && head_dim == Shapes::head_dim &&
               (group_size == 0 || group_size == Shapes::group_size)) ||
              ...);
    }
  }
  /// "bf16/128/4, f16/64/1" or "every supported shape", for messages.
  static std::string describe() {
    if constexpr (all) {
      return "every supported shape";
    } else {
      std::string s;
      ((s += (s.empty() ? "" : ", ") + std::string(to_string(Shapes::storage)) + "/" + std::to_string(Shapes::head_dim) + "/" +
             std::to_string(Shapes::group_size)),
       ...);
      return s;
    }
  }
};

template <class Backend>
struct shapes_of;
template <class... Shapes>
struct shapes_of<backend::cuda_for<Shapes...>> {
  using type = shape_list<Shapes...>;
};
/// The kernel shapes of a CUDA backend (`backend::cuda_for<...>`), as an engine lists them.
template <class Backend>
using shapes_of_t = typename shapes_of<Backend>::type;

/// Calls f(element{}) for the element type of the run-time `type` (float, half or bfloat16):
/// where the engine turns an input or output array's dtype into template arguments, so that its
/// kernel-launching members are not templates (an explicit instantiation covers them).
template <class F>
void dispatch_io_type(dtype type, F&& f) {
  switch (type) {
    case dtype::f32: return f(float{});
    case dtype::f16: return f(half{});
    case dtype::bf16: return f(bfloat16{});
  }
  kvmosaic::detail::require(false, "cuda::dispatch_io_type", "dtype", static_cast<int>(type), "f32, f16 or bf16");
}

/// Calls f(element{}, head_dim constant, group constant) for the listed shape that matches the
/// run-time one; `group_size` 0 matches any group (kernels that do not depend on it: the first
/// listed group is passed, 1 for the full list). Throws `invalid_argument` when none matches.
template <class... Shapes, class F>
void dispatch_shape(shape_list<Shapes...>, dtype storage, int head_dim, int group_size, F&& f) {
  const auto fail = [&] {
    kvmosaic::detail::require(false, "cuda::dispatch_shape", "storage/head_dim/group_size",
                              std::string(to_string(storage)) + "/" + std::to_string(head_dim) + "/" + std::to_string(group_size),
                              shape_list<Shapes...>::describe().c_str());
  };
  if constexpr (sizeof...(Shapes) == 0) {
    const auto by_group = [&](auto element, auto dim) {
      switch (group_size) {
        case 0:
        case 1: return f(element, dim, std::integral_constant<int, 1>{});
        case 2: return f(element, dim, std::integral_constant<int, 2>{});
        case 3: return f(element, dim, std::integral_constant<int, 3>{});
        case 4: return f(element, dim, std::integral_constant<int, 4>{});
        case 5: return f(element, dim, std::integral_constant<int, 5>{});
        case 6: return f(element, dim, std::integral_constant<int, 6>{});
        case 7: return f(element, dim, std::integral_constant<int, 7>{});
        case 8: return f(element, dim, std::integral_constant<int, 8>{});
      }
      fail();
    };
    const auto by_dim = [&](auto element) {
      switch (head_dim) {
        case 64: return by_group(element, std::integral_constant<int, 64>{});
        case 128: return by_group(element, std::integral_constant<int, 128>{});
        case 256: return by_group(element, std::integral_constant<int, 256>{});
      }
      fail();
    };
    if (storage == dtype::f16) return by_dim(half{});
    if (storage == dtype::bf16) return by_dim(bfloat16{});
    fail();
  } else {
    bool done = false;
    const auto try_shape = [&](auto shape) {
      using S = decltype(shape);
      if (done || storage != S::storage || head_dim != S::head_dim || (group_size != 0 && group_size != S::group_size)) return;
      done = true;
      f(typename S::element{}, std::integral_constant<int, S::head_dim>{}, std::integral_constant<int, S::group_size>{});
    };
    (try_shape(Shapes{}), ...);
    if (!done) fail();
  }
}

}  // namespace cuda::detail

namespace cuda {
/// Whether `Backend` (a `backend::cuda_for<...>`) compiles kernels for the shape (storage dtype,
/// head_dim, GQA group size; 0: any group): a cache on that backend accepts a `cache_config` of
/// that shape only then, and rejects others with an error naming the shapes. Lets a caller that
/// takes shapes at run time fall back before it builds a cache. O(number of listed shapes), no
/// CUDA call.
template <class Backend>
bool compiles_shape(dtype storage, int head_dim, int group_size) noexcept {
  return detail::shapes_of_t<Backend>::contains(storage, head_dim, group_size);
}
/// The shapes `Backend` compiles, for messages: "bf16/128/4, f16/64/1" or "every supported shape".
template <class Backend>
std::string compiled_shapes() {
  return detail::shapes_of_t<Backend>::describe();
}
}  // namespace cuda
}  // namespace kvmosaic
// ---- end <kvmosaic/cuda/shapes.cuh> ----

// ---- begin <kvmosaic/cuda/backend.cuh> ----
/// \file
/// The CUDA backend: page and tail arenas in device memory, and the driver of every cache
/// operation. `kvmosaic::cache<Format, Selector, Compactor, kvmosaic::backend::cuda_for<...>>`
/// uses it; the format's kernels come from its device part (cuda/format/device_format.cuh).
///
/// Pointers the cache passes to this backend (prefill/append rows, q, out, lse) are device
/// pointers; operations are asynchronous on the engine's stream (`set_stream`), and the caller
/// synchronizes before reading results. A decode step is two pieces: `plan` (host: the split plan
/// and block tables, written to page-locked staging) and `run` (one copy to the device, the
/// optional query gather, the split kernel and the merge, with a launch shape that depends only
/// on the batch size), so `run` can be captured in a CUDA graph and replayed after each new
/// `plan`.

#include <cudaTypedefs.h>


// ---- begin <kvmosaic/cuda/detail/pull_from_host.cuh> ----
/// \file
/// `pull_from_host`: the per-step host-to-device copy of staged metadata, done by a kernel that
/// reads the page-locked staging over the bus instead of by a memcpy. Why: in a CUDA graph, a
/// host-to-device memcpy node of a few KB costs the copy engine's round trip, several times a
/// small kernel's launch plus one bus round trip, and at batch 1 that is most of a step's fixed
/// cost (benchmark/README.md, "Decisions the code cites": "metadata pull").




namespace kvmosaic::cuda::detail {

/// Threads per CTA of the copy; each moves 16 bytes per step.
inline constexpr int pull_threads = 256;

/// to[i] = from[i] for i < words; `from` is mapped host memory, read uncached (`__ldcv`) so that
/// a replayed graph sees what the host staged for this step. Launched as an ordinary kernel (it
/// overwrites metadata the previous step's kernels read); the kernel after it may overlap it.
template <int Threads>
__global__ void __launch_bounds__(Threads) pull_from_host_kernel(const uint4* __restrict__ from, uint4* __restrict__ to,
                                                                 std::size_t words) {
  allow_dependent_grids();  // the split kernel may start its set-up; it waits for this grid's copy
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * Threads + threadIdx.x; i < words; i += stride)
    to[i] = __ldcv(from + i);
}

/// Enqueues on `stream` the copy of the first `bytes` (a multiple of 16) of `staging` into
/// `device` (16-byte aligned). Capturable in a CUDA graph; the caller keeps the staging unchanged
/// until the copy has run, as for cudaMemcpyAsync. Cost: one small kernel, reads of 16 bytes
/// per thread with all of them in flight (64 KB: 16 CTAs).
inline void pull_from_host(const pinned_buffer& staging, void* device, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  const std::size_t words = bytes / 16;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((words + pull_threads - 1) / pull_threads, 1024));
  pull_from_host_kernel<pull_threads><<<blocks, pull_threads, 0, stream>>>(
      static_cast<const uint4*>(staging.device_address()), static_cast<uint4*>(device), words);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvmosaic::cuda::detail
// ---- end <kvmosaic/cuda/detail/pull_from_host.cuh> ----

// ---- begin <kvmosaic/cuda/format/device_format.cuh> ----
/// \file
/// A format's device part: `device_format<Format>`, specialized on the format tag in the format's
/// own folder (`cuda/format/<name>/device.cuh`), found by the CUDA engine the way CUTLASS finds a
/// collective. The engine (`cuda/backend.cuh`) drives splits, staging, plan/run and the merge for
/// every format and never names one; a specialization provides:
///
/// ```cpp
/// template <> struct device_format<format::X> {
///   static constexpr bool encodes_pages;          // false: rows are copied into pages as they are
///   static constexpr bool masks_sink_rows;        // the split kernel skips the sink rows of a
///                                                 // sequence's first page itself (p.sink_rows), so
///                                                 // sinks alone need no per-page row masks
///   static constexpr std::int32_t split_page_multiple;  // split sizes are multiples of it
///   static constexpr bool writes_token_logits;    // optional, default false: its split kernels
///                                                 // write each row's logits when a step records
///                                                 // token scores (kernel::decode_params::token_logits)
///   static constexpr bool writes_exact_logits;    // optional, default false: and those logits are
///                                                 // q . k of the decoded keys up to fp32 rounding
///                                                 // (not an approximation such as HACK's 8-bit q')
///   struct params;                                // the format's fields of the split kernels' params
///   struct state;                                 // per-engine decisions (kernel path, stages), with
///                                                 // `int stages` (0 when the format has none)
///   static void validate(const format::X&, const engine_shape&);         // what the kernels cannot do
///   template <class Shapes>
///   static void configure(state&, const format::X&, device_context&);  // at construction; may
///                                                 // turn bulk_copy off (then the portable path)
///   template <class Shapes, bool Logits, class F>                        // the split kernel of a step:
///   static void with_decode_kernel(const state&, const format::X&, const device_context&, bool row_masks,
///                                  F&& f);                               // f(kernel, threads, shared bytes);
///                                                 // Logits: of an engine whose steps may record token
///                                                 // scores (formats that write logits only)
///   static params params_for(const state&, const format::X&, const device_context&);
///   static int max_pages_per_split(const state&, const decode_tuning&);  // page ids a split keeps
///   static bool splits_p_on_tensor_cores(const state&, const device_context&);
///   template <class Shapes>                                              // encoded formats only:
///   static void encode_pages(const state&, const format::X&, const encode_context&);
///   template <class Shapes>                                              // encoded formats only: the
///   static void unpack_pages(const state&, const format::X&, const unpack_context&);  // inverse
///   // formats with segments (format_traits::has_segments) only: a segment of one KV head in the
///   // engine's segment arena (device_context::segments), as the kernels read it
///   static std::size_t segment_entry_bytes(const format::X&, const page_shape&);
///   static void store_segment(const format::X&, const page_shape&, const segment&, std::byte* out);
/// };
/// ```
///
/// Split kernels take `kernel::split_params<params>` (the shared `decode_params` plus the
/// format's own); the engine fills the shared part and launches what `with_decode_kernel` hands
/// it. docs/architecture.md ("Adding a format") lists the files a new format writes.




namespace kvmosaic::cuda {

/// What a format's device part may read of its engine: shapes, arenas and the device.
struct device_context {
  const kvmosaic::detail::engine_shape* shape;
  const kvmosaic::detail::arena_geometry* geometry;
  std::byte* pages;            ///< page arena (device)
  std::byte* tails;            ///< tail arena (device)
  int device;                  ///< CUDA device ordinal
  bool bulk_copy;              ///< sm_90 bulk-copy pipelines in use (false: the portable sm_75+ path)
  cudaStream_t stream;
  /// Formats with segments: the segment arena, [max_sequences][segments_per_sequence]
  /// [num_kv_heads] entries of `segment_entry_bytes` (null for other formats).
  const std::byte* segments;
  int segments_per_sequence;
  /// The engine's selector may read a subset of the pages (any but `select::all`): a split then
  /// holds few, scattered pages, and a format may keep more of them in flight.
  bool selects_pages;
};

/// What an encode pass is given: `n` completed pages whose dense rows are in scratch slots
/// 0 .. n (tail-slot layout), to be written to `page_ids` (device array).
struct encode_context {
  const device_context* engine;
  const std::byte* rows;              ///< scratch slots of dense rows (device)
  const std::int32_t* page_ids;       ///< [n] destination pages (device)
  const std::int32_t* weight_rows;    ///< [n] key-weight row per page or -1 (formats with key weights)
  const float* key_weights;           ///< [max_sequences][num_kv_heads][head_dim] (device), or null
  const std::int32_t* sink_slots;     ///< [n] tail slot keeping a first page's sink rows, or -1
  std::int32_t n;
  const std::int32_t* segment_entries;  ///< [n] formats with segments: the page's segment in the
                                        ///< arena (slot x segments_per_sequence + segment); else null
};

/// What an unpack pass is given: `n` pages `page_ids` (device array) whose dense rows, in the
/// storage dtype, are to be written to scratch slots 0 .. n of `rows` (tail-slot layout: the first
/// page_size rows of each head's K, then of its V). The rows are what the host's
/// `format_traits::decode_k/v` give, rounded to the storage dtype; a compaction moves them and
/// encodes the pages it writes again.
struct unpack_context {
  const device_context* engine;
  std::byte* rows;                    ///< scratch slots (device)
  const std::int32_t* page_ids;       ///< [n] pages to unpack (device)
  std::int32_t n;
};

namespace detail {

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

/// Registers per thread of `kernel` (a handle as a device format's `with_decode_kernel` passes it),
/// what a kernel's occupancy is sized by (`stages_for`). Cost: one attribute query.
template <class Kernel>
int registers_of(Kernel kernel) {
  cudaFuncAttributes attributes{};
  KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.numRegs;
}

/// Static shared memory of `kernel` in bytes: what its dynamic shared memory must leave room for
/// under a CTA's limit. Cost: one attribute query.
template <class Kernel>
int static_shared_of(Kernel kernel) {
  cudaFuncAttributes attributes{};
  KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return static_cast<int>(attributes.sharedSizeBytes);
}

/// Stages of a kernel that streams compressed page pairs through shared memory (4 warps per
/// CTA): occupancy first, as many CTAs per SM as its `registers` per thread allow (at most
/// `most_ctas`) with at least `wanted_stages` stages each (or, where not even one CTA has room
/// for them, at least one), then as many stages as fit next to them (at most `max_stages`);
/// `shared_bytes(stages)` is the CTA's dynamic shared memory. 0 when not even one stage fits.
/// Cost: four device attribute queries.
template <class SharedBytes>
int stages_for(int device, int registers, int most_ctas, int max_stages, SharedBytes&& shared_bytes, int wanted_stages = 1) {
  int per_sm = 0, per_block = 0, reserved = 0, sm_registers = 0;
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&sm_registers, cudaDevAttrMaxRegistersPerMultiprocessor, device));
  // Registers are allocated per warp in units of 256; the kernels run 4 warps.
  const int per_cta_registers = 4 * ((registers * 32 + 255) / 256 * 256);
  const int most = std::min(most_ctas, sm_registers / std::max(per_cta_registers, 1));
  // The stages at the most CTAs per SM that have room for `least` each (0: none has).
  const auto at_most_ctas_with = [&](int least) {
    for (int ctas = most; ctas >= 1; --ctas) {
      const int budget = std::min(per_sm / ctas - reserved, per_block);
      int stages = 0;
      while (stages < max_stages && shared_bytes(stages + 1) <= budget) ++stages;
      if (stages >= least) return stages;
    }
    return 0;
  };
  const int chosen = at_most_ctas_with(std::min(std::max(wanted_stages, 1), max_stages));
  return chosen > 0 ? chosen : at_most_ctas_with(1);
}

}  // namespace detail

/// The device part of `Format`. Only specializations exist.
template <class Format>
struct device_format {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this format has no CUDA device part: include its cuda/format/<name>/device.cuh "
                "(kvmosaic.cuh includes every built-in one), or specialize kvmosaic::cuda::device_format<Format> "
                "(docs/architecture.md, 'Adding a format')");
};

/// Whether `Format`'s split kernels write each row's logits for a step that records token
/// scores (`device_format<Format>::writes_token_logits`; false where it does not say).
template <class Format, class = void>
struct writes_token_logits : std::false_type {};
template <class Format>
struct writes_token_logits<Format, std::void_t<decltype(device_format<Format>::writes_token_logits)>>
    : std::bool_constant<device_format<Format>::writes_token_logits> {};

/// Whether `Format`'s logits (`writes_token_logits`) are q . k of its decoded keys up to fp32
/// rounding (`device_format<Format>::writes_exact_logits`; false where it does not say): what
/// `cache::window_votes` needs to compute on the device what the host computes from `read`.
template <class Format, class = void>
struct writes_exact_logits : std::false_type {};
template <class Format>
struct writes_exact_logits<Format, std::void_t<decltype(device_format<Format>::writes_exact_logits)>>
    : std::bool_constant<writes_token_logits<Format>::value && device_format<Format>::writes_exact_logits> {};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/device_format.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/compact.cuh> ----
/// \file
/// The row copies of a compaction pass (`cuda::engine::move_slots`), for every format: dense 16-bit
/// rows gathered from source slots (a format's unpacked pages, or format::dense's pages as they
/// are) into destination slots, by a map staged with the pass. A pass gathers every page it
/// writes into scratch slots before anything is written back, so every source is read before any
/// destination changes (the order-preserving contract of `compact::repack`).



namespace kvmosaic::cuda::kernel {

/// Destination slot i, row r takes source row `sources_of[i * page_size + r]` (= source slot x
/// page_size + row; null: row r of source slot i). Slots on both sides are laid out [K heads]
/// [V heads] x head bytes, rows of head_dim 16-bit values; destination slot i is `slot_ids[i]`
/// of `rows` (null: i).
struct copy_rows_params {
  const std::byte* sources;
  std::int64_t source_slot_bytes;
  std::int64_t source_head_bytes;
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::int32_t* sources_of;
  const std::int32_t* slot_ids;
  std::int32_t n;
  int num_kv_heads;
  int head_dim;
  int page_size;
};

constexpr int copy_rows_threads = 256;

/// Grid-stride over destination slots x rows x (K, V) x heads x 16-byte vectors; one 16-byte load
/// and store each. Cost: the bytes of the destination slots, read once and written once. (A
/// template, so that every translation unit may define it.)
template <class Vector = uint4>
__global__ void __launch_bounds__(copy_rows_threads) copy_rows_kernel(const copy_rows_params p) {
  static_assert(sizeof(Vector) == detail::vector_elements * 2, "a vector of 16-bit values");
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t per_row = static_cast<std::int64_t>(2) * p.num_kv_heads * vectors_per_row;
  const std::int64_t total = static_cast<std::int64_t>(p.n) * p.page_size * per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int vector = static_cast<int>(i % vectors_per_row);
    const std::int64_t rest = i / vectors_per_row;
    const int head_index = static_cast<int>(rest % (2 * p.num_kv_heads));  // [K heads][V heads]
    const std::int64_t row = rest / (2 * p.num_kv_heads);                  // slot * page_size + r
    const std::int64_t source = p.sources_of != nullptr ? p.sources_of[row] : row;
    const std::int64_t slot = row / p.page_size, r = row % p.page_size;
    const std::int64_t destination_slot = p.slot_ids != nullptr ? p.slot_ids[slot] : slot;
    const std::int64_t row_bytes = static_cast<std::int64_t>(p.head_dim) * 2, vector_bytes = detail::vector_elements * 2;
    const auto* from = reinterpret_cast<const Vector*>(p.sources + source / p.page_size * p.source_slot_bytes +
                                                      head_index * p.source_head_bytes + source % p.page_size * row_bytes +
                                                      vector * vector_bytes);
    auto* to = reinterpret_cast<Vector*>(p.rows + destination_slot * p.rows_slot_bytes + head_index * p.rows_head_bytes +
                                        r * row_bytes + vector * vector_bytes);
    *to = *from;
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/compact.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/queries.cuh> ----
/// \file
/// A step's queries as the split kernels read them: contiguous float [batch][num_q_heads]
/// [head_dim]. Queries already in that form are read in place; others (f16, bf16, or strided)
/// are converted by `gather_queries_kernel` first: one extra launch of batch x num_q_heads x
/// head_dim element copies, part of the step (and of a captured graph).



namespace kvmosaic::cuda::kernel {

/// Where a step's queries are: `q` with element strides per batch entry, query head, channel.
template <class Q>
struct query_source {
  const Q* q;
  std::int64_t strides[3];
  int batch;
  int heads;
  int head_dim;
};

/// out[(b * heads + h) * head_dim + c] = float(q(b, h, c)). Grid-stride over every element.
template <class Q>
__global__ void gather_queries_kernel(const query_source<Q> source, float* out) {
  const std::int64_t total = static_cast<std::int64_t>(source.batch) * source.heads * source.head_dim;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % source.head_dim, row = i / source.head_dim;
    const std::int64_t h = row % source.heads, b = row / source.heads;
    out[i] = to_float(source.q[b * source.strides[0] + h * source.strides[1] + c * source.strides[2]]);
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/queries.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/token_scores.cuh> ----
/// \file
/// `token_scores_kernel`: the per-token attention scores of a decode step (select/token_scores.hpp)
/// from the logits its split kernels wrote (`decode_params::token_logits`), normalized by each
/// query head's log-sum-exp over all the step's splits (written by the merge): what `select::tova` and `select::h2o`
/// rank by, computed without eager attention and without a second pass over K.




namespace kvmosaic::cuda::kernel {

/// Threads of a `token_scores_kernel` CTA.
inline constexpr int token_score_threads = 256;

/// scores[b][h][r] = combine over the group's query heads j of exp(s_j - lse_j), for every row r
/// of the read order of sequence b that the step covered (`decode_params::token_logits`: its
/// pages' rows, then its exact and tail rows), lse_j being the head's log-sum-exp that the merge
/// wrote (`decode_params::lse`). A row the step masked (logit -inf) scores 0, and so does every
/// row of a head that read no token. `combine_max`: the group's largest probability, else their
/// sum. Grid: (CTAs per (sequence, KV head), num_kv_heads, batch), each striding over the rows.
/// Cost per row and KV head: 4 x Group bytes read, 4 written, Group exps.
template <int Group>
__global__ void __launch_bounds__(token_score_threads) token_scores_kernel(const decode_params p, float* scores,
                                                                           bool combine_max) {
  detail::wait_for_prior_grid();  // the split kernel's logits, the merge's log-sum-exps
  const int head = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  float lse[Group];
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    const float x = p.lse[b * p.lse_strides[0] + (head * Group + g) * p.lse_strides[1]];
    lse[g] = x == -HUGE_VALF ? HUGE_VALF : x;  // no token read: every p is 0
  }
  const std::int64_t sealed = static_cast<std::int64_t>(p.sealed_pages[b]) * p.page_size;
  const std::int64_t exact = sealed < p.exact_rows ? sealed : p.exact_rows;
  const std::int64_t rows = sealed + exact + p.tail_rows[b];
  const std::size_t base = (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots;
  const float* logits = p.token_logits + base * Group;
  float* out = scores + base;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * token_score_threads + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * token_score_threads) {
    float s[Group];
    if constexpr (Group % 4 == 0) {
#pragma unroll
      for (int g = 0; g < Group; g += 4) {
        const float4 x = *reinterpret_cast<const float4*>(logits + r * Group + g);
        s[g] = x.x, s[g + 1] = x.y, s[g + 2] = x.z, s[g + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int g = 0; g < Group; ++g) s[g] = logits[r * Group + g];
    }
    float combined = 0.0f;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float probability = s[g] == -HUGE_VALF ? 0.0f : expf(s[g] - lse[g]);
      combined = combine_max ? fmaxf(combined, probability) : combined + probability;
    }
    out[r] = combined;
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/token_scores.cuh> ----

// ---- begin <kvmosaic/cuda/kernel/window_votes.cuh> ----
/// \file
/// The votes of an observation window (`cache::window_votes`, `select::snapkv`'s snapshot) on the
/// device, from the logits the decode kernels wrote for a batch of window queries over one
/// sequence (`decode_params::token_logits`): each query's causal log-sum-exp, then each earlier
/// token's probabilities combined over the group and summed over the queries. Source: SnapKV (Li
/// et al., NeurIPS 2024), the observation-window family of the eviction notes. No W x N matrix
/// beyond one batch's logits, and no second pass over K.



namespace kvmosaic::cuda::kernel {

/// Threads of a window-vote CTA (both kernels).
inline constexpr int window_vote_threads = 256;

/// One batch of window queries, each a copy of the same sequence in a decode step that wrote its
/// rows' logits: batch entry b is window query `first_query + b`, at position `window_start +
/// first_query + b`.
struct window_vote_params {
  const float* logits;            ///< [batch][num_kv_heads][logit_slots][Group] fp32, scaled logits, -inf masked
  std::int64_t logit_slots;       ///< rows per (batch entry, KV head) of `logits`
  const std::int64_t* positions;  ///< [rows]: the logical position of each row of the read order, -1 for none
  std::int64_t rows;              ///< rows of the sequence's read order
  std::int64_t window_start;      ///< position of window query 0
  int first_query;                ///< the window query of batch entry 0
  int queries;                    ///< batch entries
  int num_kv_heads;
  float* lse;                     ///< [queries][num_kv_heads][Group]: each query head's causal log-sum-exp
  float* votes;                   ///< [num_kv_heads][rows]: accumulated over the window's batches
  bool combine_max;               ///< the group's largest probability, else their sum
};

/// lse[b][h][g] = log sum of exp(logit) over the rows whose position is at most query b's own
/// (causal), for query head g of KV head h's group; +inf where no row is (every probability 0).
/// Grid: (queries, num_kv_heads), one CTA reducing all rows. Cost per row: 4 x Group bytes read.
template <int Group>
__global__ void __launch_bounds__(window_vote_threads) window_lse_kernel(const window_vote_params p) {
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const std::int64_t last = p.window_start + p.first_query + b;
  const float* logits = p.logits + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots * Group;
  float m[Group], l[Group];
#pragma unroll
  for (int g = 0; g < Group; ++g) m[g] = -HUGE_VALF, l[g] = 0.0f;
  for (std::int64_t r = threadIdx.x; r < p.rows; r += window_vote_threads) {
    const std::int64_t position = p.positions[r];
    if (position < 0 || position > last) continue;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float s = logits[r * Group + g];
      if (s == -HUGE_VALF) continue;
      if (s > m[g]) l[g] = l[g] * expf(m[g] - s) + 1.0f, m[g] = s;
      else l[g] += expf(s - m[g]);
    }
  }
  __shared__ float shared_m[window_vote_threads / 32][Group], shared_l[window_vote_threads / 32][Group];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_m = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float other_l = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float top = fmaxf(m[g], other_m);
      if (top != -HUGE_VALF) l[g] = l[g] * expf(m[g] - top) + other_l * expf(other_m - top);
      m[g] = top;
    }
    if (lane == 0) shared_m[warp][g] = m[g], shared_l[warp][g] = l[g];
  }
  __syncthreads();
  if (threadIdx.x < Group) {
    const int g = static_cast<int>(threadIdx.x);
    float top = -HUGE_VALF, sum = 0.0f;
    for (int w = 0; w < window_vote_threads / 32; ++w) top = fmaxf(top, shared_m[w][g]);
    if (top != -HUGE_VALF)
      for (int w = 0; w < window_vote_threads / 32; ++w) sum += shared_l[w][g] * expf(shared_m[w][g] - top);
    p.lse[(static_cast<std::size_t>(b) * p.num_kv_heads + head) * Group + g] = sum > 0.0f ? top + logf(sum) : HUGE_VALF;
  }
}

/// votes[h][r] += sum over the batch's queries b of combine over g of exp(logit - lse[b][h][g]),
/// for every row r whose token lies before the window (position in [0, window_start): every
/// window query sees it). Grid: (ceil(rows / threads), num_kv_heads), a thread per row. Cost per
/// row: 4 x Group x queries bytes read, 4 read and written.
template <int Group>
__global__ void __launch_bounds__(window_vote_threads) window_votes_kernel(const window_vote_params p) {
  const int head = static_cast<int>(blockIdx.y);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * window_vote_threads + threadIdx.x;
  if (r >= p.rows) return;
  const std::int64_t position = p.positions[r];
  if (position < 0 || position >= p.window_start) return;
  float vote = 0.0f;
  for (int b = 0; b < p.queries; ++b) {
    const std::size_t base = (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.logit_slots + static_cast<std::size_t>(r);
    const float* lse = p.lse + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * Group;
    float combined = 0.0f;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      const float s = p.logits[base * Group + g];
      const float probability = s == -HUGE_VALF ? 0.0f : expf(s - lse[g]);
      combined = p.combine_max ? fmaxf(combined, probability) : combined + probability;
    }
    vote += combined;
  }
  p.votes[static_cast<std::size_t>(head) * p.rows + r] += vote;
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/window_votes.cuh> ----

// ---- begin <kvmosaic/cuda/select/all.cuh> ----
/// \file
/// `select::all` on the CUDA backend: no selection stage. Every step's splits read every sealed
/// page through the sequences' own block tables; nothing is kept, staged or launched, and no
/// selection kernel is compiled.


// ---- begin <kvmosaic/cuda/select/selection_stage.cuh> ----
/// \file
/// A selector's device part: `selection_stage<Selector, Shapes>`, specialized on the selector tag
/// in `cuda/select/<name>.cuh`, found by the CUDA engine as it finds a format's device part
/// (`device_format`). The engine (`cuda/backend.cuh`) never names a selector: it hands each stage
/// the pages a write seals, asks it per step which pages each sequence's splits cover, gives it a
/// region of the step's staged metadata, and launches it between the metadata copy and the split
/// kernel. A specialization provides:
///
/// ```cpp
/// template <class Shapes> class selection_stage<select::X, Shapes> {
///  public:
///   static constexpr bool selects;          // false: every step reads every page (no kernels)
///   selection_stage(const engine_shape&, const select::X&);   // device storage, sized once
///   std::size_t page_bytes() const;         // device bytes the stage keeps per page (memory_stats)
///   void seal(const sealed_pages&, cudaStream_t);             // pages a write completed
///   void commit() noexcept;                 // makes the stage's writes since the last commit final
///   void rollback() noexcept;               // forgets them (the engine's rollback)
///   void plan(const detail::selection_request*, const std::vector<step_sequence>&,
///             std::vector<std::int32_t>& read_pages);         // host, per step (see below)
///   std::size_t staged_bytes() const;       // bytes of the planned step's inputs to stage
///   void stage(std::byte* host) const;      // writes them (the engine copies them with the step's)
///   void reserve(std::int32_t batch, std::int32_t table_stride, bool live_masks);  // outputs for
///                                           // such steps (live_masks: some may have evicted tokens)
///   bool planned() const;                   // the planned step selects
///   bool row_masks() const;                 // ... and writes row masks (blocks smaller than a page,
///                                           // or evicted tokens)
///   void use_live_masks(const std::uint32_t*) noexcept;  // the step's live rows per (sequence,
///                                           // block-table entry), or null: ANDed into its masks
///   void bind(kernel::decode_params&) const;                  // the contract (below)
///   void launch(const kernel::decode_params&, const std::byte* staged, const float* q, cudaStream_t);
/// };
/// ```
///
/// The contract every format's split kernel reads (`kernel::decode_params`): for a selected step,
/// per (sequence, KV head) a page table (`block_tables`, rows `step_header[1]` apart, heads
/// `step_header[2]` apart) and, when `row_masks()`, per listed page a row mask (`token_masks`,
/// `mask_words` words) and the entries written (`table_lengths`). A step with evicted tokens
/// gets the live rows of every (sequence, block-table entry) first (`use_live_masks`); a stage
/// that selects writes row masks then, each ANDed with its page's live rows. `plan` fills `read_pages[b]`,
/// the pages sequence b's splits cover (`planned_pages`): every sealed page, or fewer when the
/// selection is known to read fewer whole pages. docs/architecture.md ("Adding a selector") lists
/// the files a new selector writes.




namespace kvmosaic::cuda {

/// Pages a write completed, whose dense rows a stage may read (before a format encodes them):
/// page `page_ids[i]`'s rows are in slot `row_slots[i]` of `rows` (every KV head's K rows at
/// `head * rows_head_bytes`, token-major, head_dim values each).
struct sealed_pages {
  const std::byte* rows;              ///< device
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::int32_t* row_slots;      ///< [n] (device)
  const std::int32_t* page_ids;       ///< [n] (device)
  std::int32_t n;
};

/// One sequence of a step as a stage sees it.
struct step_sequence {
  std::int32_t slot;          ///< tail slot
  std::int32_t sealed_pages;  ///< pages in its block table
};

/// The device part of `Selector` for an engine compiling `Shapes`. Only specializations exist.
template <class Selector, class Shapes>
class selection_stage {
  static_assert(sizeof(Selector) == 0,
                "kvmosaic: this selector has no CUDA selection stage: include its cuda/select/<name>.cuh "
                "(kvmosaic.cuh includes every built-in one), or specialize kvmosaic::cuda::selection_stage<Selector, "
                "Shapes> (docs/architecture.md, 'Adding a selector')");
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/selection_stage.cuh> ----

namespace kvmosaic::cuda {

/// Reads everything. Cost: none.
template <class Shapes>
class selection_stage<select::all, Shapes> {
 public:
  static constexpr bool selects = false;

  selection_stage(const kvmosaic::detail::engine_shape&, const select::all&) noexcept {}
  std::size_t page_bytes() const noexcept { return 0; }
  void seal(const sealed_pages&, cudaStream_t) noexcept {}
  void commit() noexcept {}
  void rollback() noexcept {}
  void plan(const kvmosaic::detail::selection_request* request, const std::vector<step_sequence>& batch,
            std::vector<std::int32_t>& read_pages) const {
    kvmosaic::detail::require(request == nullptr, "cuda::engine::plan", "selection request", "given",
                              "none: select::all reads every page");
    for (std::size_t b = 0; b < batch.size(); ++b) read_pages[b] = batch[b].sealed_pages;
  }
  std::size_t staged_bytes() const noexcept { return 0; }
  void stage(std::byte*) const noexcept {}
  void reserve(std::int32_t, std::int32_t, bool = false) noexcept {}
  void use_live_masks(const std::uint32_t*) noexcept {}  // the engine's live masks serve every page
  bool planned() const noexcept { return false; }
  bool row_masks() const noexcept { return false; }
  void bind(kernel::decode_params&) const noexcept {}
  void launch(const kernel::decode_params&, const std::byte*, const float*, cudaStream_t) noexcept {}
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/all.cuh> ----

namespace kvmosaic {
namespace cuda {

namespace detail {

/// Grid x for a grid-stride loop over `count` items.
inline unsigned grid_for(std::int64_t count, int threads) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((count + threads - 1) / threads, 1, 65535));
}

}  // namespace detail

/// The CUDA engine of one cache type: the driver of every format (`device_format<Format>`,
/// cuda/format/device_format.cuh, provides the format's kernels and decisions) for the kernel
/// shapes `Shapes` (`detail::shape_list`; empty: every supported shape), and of every selector
/// (`selection_stage<Selector, Shapes>`, cuda/select/selection_stage.cuh: its device storage and
/// its kernels, compiled only for a selector that reads less).
///
/// Pages of a format without an encoder are written in place by the row kernels. Other formats'
/// pages are encoded on the device: the row kernels write the completed pages' dense rows to a
/// scratch arena (at most `encode_chunk_pages` pages at a time), and the format's encode pass
/// compresses them into their pages.
template <class Format, class Selector = select::all, class Shapes = detail::shape_list<>>
class engine {
  using device = device_format<Format>;
  using traits = format_traits<Format>;
  static constexpr bool encodes_pages = device::encodes_pages;
  /// What the pages of one segment and KV head share (formats with segments; else empty).
  using segment_t = typename kvmosaic::detail::segment_type<Format>::type;

 public:
  /// The selector's device part.
  using selection_type = selection_stage<Selector, Shapes>;
  /// A step can compute token scores (`plan`'s score_settings) where the format's split kernels
  /// write their rows' logits (`writes_token_logits`: format::dense, bitmap_tiles, quant), and
  /// the engine's selector reads them (token scores: select::tova, select::h2o; window votes:
  /// select::snapkv). Only such an engine takes the kernels that write them; the others keep
  /// kernels without the stores.
  static constexpr bool records_token_scores =
      writes_token_logits<Format>::value && (kvmosaic::detail::token_scores_of<Selector>::value != score_use::none ||
                                             kvmosaic::detail::reads_window_votes<Selector>::value);
  /// They come back per row of the read order (`token_scores`), not by logical position.
  static constexpr bool scores_by_position = false;
  /// `window_votes` runs on the device where the engine records token scores and its format's
  /// logits are exact (`writes_exact_logits`: dense, bitmap_tiles); elsewhere the cache scores
  /// the keys it reads back.
  static constexpr bool computes_window_votes = records_token_scores && writes_exact_logits<Format>::value;

 private:
  static constexpr bool selects = selection_type::selects;

  /// Where a step's outputs go: `data` in the merge kernel's output type at `strides`, and the
  /// optional log-sum-exps.
  struct output_view {
    void* data = nullptr;
    dtype type = dtype::f32;
    std::int64_t strides[3] = {0, 0, 0};
    float* lse = nullptr;
    std::int64_t lse_strides[2] = {0, 0};
  };
  /// A step's queries as `run` was given them: any io dtype, any strides.
  struct query_view {
    const void* data;
    dtype type;
    std::int64_t extents[3];
    std::int64_t strides[3];
    bool contiguous;
  };


 public:
  /// The arenas for `shape`, the format's kernel path for this device, and the selector's device
  /// storage (`selection_type`).
  engine(const kvmosaic::detail::engine_shape& shape, const Format& format, const Selector& selector = {})
      : shape_(validated(shape, format)),
        format_(format),
        geometry_(shape, format),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        selection_(shape, selector) {
    KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device_));
    const int device = device_;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device));
    int major = 0;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    use_bulk_copy_ = major >= 9;
    supports_dependent_launch_ = dependent_launch_ = major >= 9;
    // Rows a TMA box reads past a tail's last token must hold finite values (they meet p = 0).
    KVMOSAIC_CUDA_CHECK(cudaMemset(pages_.data(), 0, pages_.size()));
    KVMOSAIC_CUDA_CHECK(cudaMemset(tails_.data(), 0, tails_.size()));
    KVMOSAIC_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    if constexpr (has_segments_v<Format>) {
      const int per = traits::segment_pages(format_, shape_.page());
      segments_per_sequence_ = (shape.max_pages + per - 1) / per;
      segment_arena_ = device_buffer(static_cast<std::size_t>(shape.max_sequences) * segments_per_sequence_ * shape.num_kv_heads *
                                     device::segment_entry_bytes(format_, shape_.page()));
    }
    configure_format();
    prepare_decode_kernel();
  }
  ~engine() {
    if (staged_ != nullptr) cudaEventDestroy(staged_);
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  const kvmosaic::detail::arena_geometry& geometry() const noexcept { return geometry_; }
  /// Bytes of one pool slot: one page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return geometry_.page_slot_bytes(); }
  /// Bytes a page costs besides its slot: what the selector keeps per page (0 for none).
  std::size_t page_bounds_bytes() const noexcept { return selection_.page_bytes(); }
  /// The selector's device part: its storage, and what the last step chose (for tests and
  /// reports); a selector's host hooks drive it through the non-const one.
  const selection_type& selection() const noexcept { return selection_; }
  selection_type& selection() noexcept { return selection_; }
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
    // Rows after a sealed page land on the old tail rows, and a seal rewrites the exact rows.
    if ((tail_rows > 0 && tail_rows + k.extent(0) > shape_.page_size) ||
        (geometry_.exact_rows > 0 && tail_rows + k.extent(0) >= shape_.page_size))
      save_tail(slot);
    // Encoded formats: chunks of at most encode_chunk_pages completed pages (the scratch arena);
    // formats without an encoder write every row in one pass. A chunk always holds at least one row: the tail
    // holds fewer than page_size rows, and a chunk of an encoded format is whole pages.
    const std::int64_t rows = k.extent(0);
    for (std::int64_t first = 0; first < rows;) {
      const std::int64_t room = encodes_pages ? std::int64_t{encode_chunk_pages} * shape_.page_size - tail_rows : rows - first;
      const auto count = static_cast<std::int32_t>(std::min(room, rows - first));
      const kernel::extend_item item{first, count, slot, tail_rows, 0};
      const std::int32_t pages = (tail_rows + count) / shape_.page_size;
      if constexpr (has_segments_v<Format>) plan_segments_in(slot, tail_rows, k, v, first, pages, sealed_pages);
      std::vector<kernel::exact_item> sealed(static_cast<std::size_t>(pages));
      for (std::int32_t i = 0; i < pages; ++i) sealed[static_cast<std::size_t>(i)] = sealed_page(slot, sealed_pages + i, sealed_pages + pages);
      run_extend(std::vector<kernel::extend_item>{item}, new_pages, pages, k.data(), v.data(), dtype_traits<T>::id, count, sealed);
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
    std::vector<kernel::exact_item> sealed;
    for (std::size_t b = 0; b < items.size(); ++b) {
      work.push_back(kernel::extend_item{static_cast<std::int64_t>(b), 1, items[b].slot, items[b].tail_rows,
                                         static_cast<std::int32_t>(new_pages.size())});
      if (items[b].new_page >= 0) {
        if constexpr (has_segments_v<Format>)
          plan_segments_in(items[b].slot, items[b].tail_rows, kvmosaic::detail::row_of(k, static_cast<std::int64_t>(b)),
                           kvmosaic::detail::row_of(v, static_cast<std::int64_t>(b)), 0, 1, items[b].sealed_pages);
        new_pages.push_back(items[b].new_page);
        sealed.push_back(sealed_page(items[b].slot, items[b].sealed_pages, items[b].sealed_pages + 1));
      }
    }
    run_extend(work, new_pages.data(), static_cast<std::int32_t>(new_pages.size()), k.data(), v.data(), dtype_traits<T>::id, 1,
               sealed);
  }

  /// Undoes the writes since the last `commit` that a caller can see: the tail rows an `extend`
  /// overwrote (copied back on the stream), and the selector's updates not yet committed. Rows past
  /// a tail's committed length and fresh pages are never read. After
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
    selection_.rollback();
  }
  /// Makes the writes since the last `commit` final (host bookkeeping only; cannot throw).
  void commit() noexcept {
    saved_slot_ = -1;
    selection_.commit();
  }

  /// Copies the page slots `pages[0 .. n)` (`page_slot_bytes()` each, in that order) into host
  /// memory at `out`, after the work already on the engine's stream: the bytes `cache::read`
  /// decodes on the host. Runs of consecutive page ids go in one copy; returns when the copies
  /// are done (synchronizes the stream, so not inside a graph capture).
  void copy_pages_out(const page_id* pages, std::size_t n, std::byte* out) const {
    const std::size_t bytes = page_slot_bytes();
    for (std::size_t i = 0; i < n;) {
      std::size_t run = 1;
      while (i + run < n && pages[i + run] == pages[i] + static_cast<page_id>(run)) ++run;
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out + i * bytes, pages_.as<const std::byte>() + static_cast<std::size_t>(pages[i]) * bytes,
                                          run * bytes, cudaMemcpyDeviceToHost, stream_));
      i += run;
    }
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// Copies the tail slot of `slot` (`geometry().tail_slot_bytes()`) into host memory at `out`,
  /// after the work already on the stream; synchronizes the stream, as `copy_pages_out`.
  void copy_tail_out(std::int32_t slot, std::byte* out) const {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out, tails_.as<const std::byte>() + static_cast<std::size_t>(slot) * bytes, bytes,
                                        cudaMemcpyDeviceToHost, stream_));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void copy_tail(std::int32_t from, std::int32_t to, int /*rows*/) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tails_.as<std::byte>() + to * bytes, tails_.as<std::byte>() + from * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    if constexpr (has_segments_v<Format>) {  // a fork reads its shared pages in the same segments
      segments_[static_cast<std::size_t>(to)] = segments_[static_cast<std::size_t>(from)];
      const std::size_t slot_bytes = segment_arena_.size() / static_cast<std::size_t>(shape_.max_sequences);
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(segment_arena_.as<std::byte>() + to * slot_bytes, segment_arena_.as<std::byte>() + from * slot_bytes,
                                          slot_bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    if constexpr (has_key_weights_v<Format>) {
      has_key_weights_[static_cast<std::size_t>(to)] = has_key_weights_[static_cast<std::size_t>(from)];
      if (has_key_weights_[static_cast<std::size_t>(from)]) {
        const std::size_t row = shape_.row_elements() * sizeof(float);
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(key_weights_.as<std::byte>() + to * row, key_weights_.as<std::byte>() + from * row,
                                            row, cudaMemcpyDeviceToDevice, stream_));
      }
    }
  }

  /// Formats with segments: the segment of KV head `head` that page `index` of the sequence in
  /// `slot` is stored in (the host copy of what the kernels read), the bytes the segments of a
  /// sequence of `pages` pages keep, and the host decode of a page copied out of the device.
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>  // not in an explicit instantiation
  const segment_t& segment(std::int32_t slot, std::int64_t index, int head) const {
    const std::int64_t s = index / traits::segment_pages(format_, shape_.page());
    return segments_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(s * shape_.num_kv_heads + head)];
  }
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>
  std::size_t segment_bytes(std::int64_t pages) const {
    const std::int64_t per = traits::segment_pages(format_, shape_.page());
    return static_cast<std::size_t>((pages + per - 1) / per) * shape_.num_kv_heads * traits::segment_bytes(format_, shape_.page());
  }
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>
  void decode_page(std::int32_t slot, std::int64_t index, int head, bool is_v, const std::byte* page, int n, float* rows) const {
    const segment_t& seg = segment(slot, index, head);
    if (is_v) traits::decode_v(format_, shape_.page(), seg, page, n, rows);
    else traits::decode_k(format_, shape_.page(), seg, page, n, rows);
  }

  /// A compaction pass over the sealed pages `pages` of the sequence in `slot` (`plan`, from
  /// memory/compaction_plan.hpp), on the device with no page bytes through the host:
  /// `stage_moves` then `launch_moves`. Every page the plan writes gets its rows gathered into
  /// scratch slots (from its sources' unpacked rows, or from format::dense's pages as they are)
  /// before any is written back; the selector's per-page metadata of those pages is rewritten
  /// from the same rows (`selection_stage::seal`); encoded formats encode them again with the
  /// format's re-encoding mode (`detail::reencoding`: its format, and the sequence's K weights
  /// where it uses them), other formats copy them back. `first_page_sinks`: the sequence's first
  /// page keeps sink rows, hidden again as at seal. The same bytes as the host backend's
  /// `move_slots` (the GPU tests compare them).
  /// Cost: per page written, an unpack of each page it reads from, a gather and an encode.
  void move_slots(std::int32_t slot, const block_table& pages, const kvmosaic::detail::compaction_plan& plan,
                  bool first_page_sinks) {
    if (plan.moves.empty()) return;
    stage_moves(slot, pages, plan, first_page_sinks);
    launch_moves();
  }

  /// The host half of `move_slots`: the pass in chunks of at most `encode_chunk_pages` written
  /// pages (one chunk when a later chunk would read a page an earlier one wrote), each chunk's
  /// page ids and row map written to page-locked staging. Waits only for the previous copy out of
  /// the staging. Cost: O(rows of the pages written) on the host.
  void stage_moves(std::int32_t slot, const block_table& pages, const kvmosaic::detail::compaction_plan& plan,
                   bool first_page_sinks);

  /// Pages the last staged compaction pass writes and unpacks (summed over its chunks): what its
  /// device work reads and writes, for reports and benchmarks.
  struct staged_move_pages {
    std::int64_t written = 0, unpacked = 0;
  };
  staged_move_pages staged_moves() const noexcept {
    staged_move_pages pages;
    for (const move_chunk& c : move_chunks_) {
      pages.written += c.pages_written;
      pages.unpacked += c.pages_unpacked;
    }
    return pages;
  }

  /// The device half of `move_slots`, enqueued on the engine's stream: one copy of the staged
  /// metadata, then per chunk the unpack, the gather, the selector's seal and the encode (or the
  /// copy back). Capturable in a CUDA graph; a replay redoes the staged pass.
  void launch_moves();

  /// Output-aware K pruning for the pages of `slot` sealed from now on: weights [num_kv_heads]
  /// [head_dim] in host memory (copied before this returns), or null for plain magnitudes.
  template <class F = Format>  // a template: only formats with K weights instantiate it
  void set_key_weights(std::int32_t slot, const float* weights) {
    static_assert(has_key_weights_v<F>, "this format has no K weights");
    has_key_weights_[static_cast<std::size_t>(slot)] = weights != nullptr;
    if (weights == nullptr) return;
    const std::size_t row = shape_.row_elements() * sizeof(float);
    if (key_weights_.size() == 0) key_weights_ = device_buffer(static_cast<std::size_t>(shape_.max_sequences) * row);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // encodes in flight may read the old row
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(key_weights_.as<std::byte>() + slot * row, weights, row, cudaMemcpyHostToDevice));
  }

  /// The host half of a decode step (`cache::plan`): the split plan, and with a selection request
  /// what the device selects from, written to page-locked staging. Waits only for the previous
  /// step's copy out of that staging.
  /// With `scores.use` other than none (format::dense's and the quantized formats' kernels;
  /// `writes_token_logits`), the
  /// step also computes each read token's score (select/token_scores.hpp) on the device: the
  /// split kernels write their rows' logits, a score kernel after the merge normalizes and
  /// combines them per (sequence, KV head, row of the read order); `download_token_scores` and
  /// `token_scores` bring them to the host. Cost: per token and KV head, 4 x group bytes written
  /// and read back, 4 written; device memory 4 x (group + 1) bytes per row of the batch's capacity.
  void plan(const std::vector<kvmosaic::detail::sequence_ref>& batch, float softmax_scale,
            const kvmosaic::detail::selection_request* request = nullptr, const score_settings& scores = {}) {
    kvmosaic::detail::require(scores.use == score_use::none || records_token_scores, "cuda::engine::plan", "token scores",
                              "requested", "an engine that records them: format::dense, bitmap_tiles or quant under a "
                              "selector that reads token scores or window votes (format::packed_bitmap's kernels write "
                              "no logits yet; backend::host: every format)");
    plan_step(batch, request);
    softmax_scale_ = softmax_scale;
    planned_scores_ = scores;
    if (scores.use != score_use::none) reserve_token_scores();
  }

  /// The token scores of the last step run with scores, as laid out on the device: [batch][KV
  /// head][row_stride] fp32, row r of (b, h) the r-th row of b's read order (block-table entry x
  /// page_size + page row, then its exact and tail rows).
  struct token_score_rows {
    const float* data;
    std::int64_t row_stride;
  };
  /// Device pointer to the last step's token scores (valid after it ran on the stream).
  token_score_rows device_token_scores() const noexcept {
    return {token_scores_.as<const float>(), logit_slots_};
  }
  /// Enqueues the copy of the step's token scores to page-locked host memory (one 2D copy of the
  /// rows each sequence has); `token_scores` waits for it.
  void download_token_scores() {
    kvmosaic::detail::require(planned_scores_.use != score_use::none, "cuda::engine::download_token_scores",
                              "the planned step", "without token scores", "a step planned with score_settings");
    const std::size_t pitch = static_cast<std::size_t>(logit_slots_) * sizeof(float);
    KVMOSAIC_CUDA_CHECK(cudaMemcpy2DAsync(scores_host_.data(), pitch, token_scores_.data(), pitch,
                                          static_cast<std::size_t>(step_rows_) * sizeof(float),
                                          static_cast<std::size_t>(batch_) * shape_.num_kv_heads, cudaMemcpyDeviceToHost,
                                          stream_));
  }
  /// The downloaded token scores (host memory, the layout of `device_token_scores`); waits for
  /// the engine's stream.
  token_score_rows token_scores() const {
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {scores_host_.as<const float>(), logit_slots_};
  }

  /// The device half (`cache::run`), enqueued on the engine's stream and capturable in a CUDA
  /// graph: q (device, [batch][num_q_heads][head_dim], float, half or bfloat16, any strides) is
  /// read in place when it is contiguous float, else gathered to float first (one small kernel);
  /// out gets the outputs in its own type and strides, lse (optional, [batch][num_q_heads] float)
  /// each head's log-sum-exp.
  template <class Q, class O>
  void run(tensor_view<const Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse) {
    require_device_memory("cache::run", "q", q.data());
    require_device_memory("cache::run", "out", out.data());
    if (lse.extent(0) > 0) require_device_memory("cache::run", "lse", lse.data());
    const float* queries =
        q.data() == nullptr
            ? nullptr
            : gathered_queries(query_view{q.data(), dtype_traits<Q>::id, {q.extent(0), q.extent(1), q.extent(2)},
                                          {q.stride(0), q.stride(1), q.stride(2)}, q.is_contiguous()});
    output_view o{out.data(), dtype_traits<O>::id, {out.stride(0), out.stride(1), out.stride(2)}, lse.extent(0) > 0 ? lse.data() : nullptr,
                  {lse.stride(0), lse.stride(1)}};
    launch_step(queries, o, softmax_scale_);
  }

  /// The votes of an observation window over one sequence (`cache::window_votes`, which states
  /// the math): `queries` (host memory, [window][num_q_heads][head_dim] float, unscaled) are the
  /// queries of positions window_start .. window_start + window; `row_positions[r]` is the logical
  /// position of row r of the sequence's read order (-1: none, an evicted row or a page copy of an
  /// exact row). Returns [num_kv_heads][rows] fp32 in host memory: each row's probabilities under
  /// each window query's causal softmax, combined over the group, summed over the window; 0 for
  /// rows at or after window_start. Runs decode steps of up to `window_batch` copies of the
  /// sequence whose split kernels write their rows' logits, then `kernel::window_lse_kernel` and
  /// `kernel::window_votes_kernel` over them; waits for the result. Invalidates the last plan.
  /// Cost: ceil(window / window_batch) steps reading the sequence once per query (the queries of a
  /// step share no reads), plus 4 x group bytes written and read twice per row, KV head and query;
  /// device memory 4 x group x window_batch bytes per row and KV head (the step's logits).
  std::vector<float> window_votes(const kvmosaic::detail::sequence_ref& sequence, const float* queries, int window,
                                  const std::vector<std::int64_t>& row_positions, std::int64_t window_start,
                                  float softmax_scale, group_combine combine);
  /// Window queries per decode step of `window_votes`.
  static constexpr int window_batch = 8;

  /// Fixes the step metadata layout for batches up to `batch` sequences of up to
  /// `max_pages_per_sequence` pages. Steps within it reuse the same buffers and launch shape, which
  /// is what a captured CUDA graph needs; a larger step grows the layout (re-capture after that).
  void reserve_step(std::int32_t batch, std::int32_t max_pages_per_sequence, std::int32_t splits = 0,
                    bool live_masks = false) {
    const layout_capacity new_capacity{std::max(capacity_.batch, batch),
                                       std::max(capacity_.table_stride, max_pages_per_sequence),
                                       std::max({capacity_.work, splits, work_capacity(batch)}), capacity_.live_masks || live_masks};
    selection_.reserve(new_capacity.batch, new_capacity.table_stride, new_capacity.live_masks);
    if (new_capacity.batch == capacity_.batch && new_capacity.table_stride == capacity_.table_stride &&
        new_capacity.work == capacity_.work && new_capacity.live_masks == capacity_.live_masks &&
        layout_.bytes - layout_.selection >= selection_.staged_bytes())
      return;
    capacity_ = new_capacity;
    const std::int32_t work = capacity_.work;
    layout_.header = 0;
    layout_.work = align(4 * sizeof(std::int32_t));
    layout_.partial_offset = layout_.work + align(static_cast<std::size_t>(work) * sizeof(split_work));
    layout_.slots = layout_.partial_offset + align((capacity_.batch + 1) * sizeof(std::int32_t));
    layout_.tail_rows = layout_.slots + align(capacity_.batch * sizeof(std::int32_t));
    layout_.sealed = layout_.tail_rows + align(capacity_.batch * sizeof(std::int32_t));
    layout_.read_pages = layout_.sealed + align(capacity_.batch * sizeof(std::int32_t));
    layout_.tables = layout_.read_pages + align(capacity_.batch * sizeof(std::int32_t));
    layout_.live_masks = layout_.tables + align(static_cast<std::size_t>(capacity_.batch) * capacity_.table_stride * sizeof(std::int32_t));
    layout_.selection = layout_.live_masks + (capacity_.live_masks ? align(static_cast<std::size_t>(capacity_.batch) * capacity_.table_stride *
                                                                           live_mask_words() * sizeof(std::uint32_t))
                                                                     : 0);
    layout_.bytes = layout_.selection + align(selection_.staged_bytes());
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));
    staging_ = pinned_buffer(layout_.bytes);
    step_metadata_ = device_buffer(layout_.bytes);
    const std::size_t partial_floats = static_cast<std::size_t>(work) * shape_.num_kv_heads * shape_.group_size * (shape_.head_dim + 1);
    partials_ = device_buffer(partial_floats * sizeof(float));
    queries_ = device_buffer(static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * shape_.group_size *
                             shape_.head_dim * sizeof(float));
  }

  /// Host part of a step: the split plan from the lengths and the block tables, written to
  /// page-locked staging. Waits for the previous step's copy out of that staging, not for kernels.
  /// With a selection request, the selector's stage says which pages each sequence's splits cover
  /// (`selection_stage::plan`) and stages what the device selects from.
  void plan_step(const std::vector<kvmosaic::detail::sequence_ref>& batch,
                 const kvmosaic::detail::selection_request* request = nullptr) {
    const auto n = static_cast<std::int32_t>(batch.size());
    std::vector<std::int32_t> full_pages(batch.size()), tail_rows(batch.size()), slots(batch.size()), read_pages(batch.size());
    std::vector<step_sequence> sequences(batch.size());
    std::vector<std::int32_t> dense_rows(batch.size());  // the exact rows and the tail rows: one run
    std::int32_t longest = 1;
    // The step reads live-row masks where a sequence has evicted tokens or sealed rows attended
    // from their exact copies: window rows, and sinks unless the format's kernel skips them itself.
    bool masked = false;
    step_rows_ = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t exact = geometry_.exact_rows_held(static_cast<std::int64_t>(batch[b].pages->size()) * shape_.page_size);
      step_rows_ = std::max(step_rows_, batch[b].length + exact);
      const bool masks_exact_rows = exact > 0 && (geometry_.window_rows > 0 || !device::masks_sink_rows);
      masked = masked || batch[b].live != nullptr || masks_exact_rows;
      full_pages[b] = static_cast<std::int32_t>(batch[b].pages->size());
      tail_rows[b] = static_cast<std::int32_t>(batch[b].length - static_cast<std::int64_t>(full_pages[b]) * shape_.page_size);
      slots[b] = batch[b].slot;
      sequences[b] = step_sequence{slots[b], full_pages[b]};
      dense_rows[b] = tail_rows[b] + static_cast<std::int32_t>(exact);
      longest = std::max(longest, full_pages[b]);
    }
    selection_.plan(request, sequences, read_pages);
    const decode_tuning tuning = decode_tuning_for(shape_.head_dim, shape_.group_size);
    const split_plan plan =
        make_split_plan(read_pages, dense_rows, target_splits(), use_bulk_copy_ ? max_pages_per_split(tuning) : 1 << 30,
                        split_page_multiple, plan_segment_pages());
    reserve_step(n, longest, plan.num_splits(), masked);
    step_masked_ = masked;
    batch_ = n;
    step_splits_ = plan.num_splits();

    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));  // the previous copy has left the staging
    std::byte* host = staging_.as<std::byte>();
    const std::int32_t stride = capacity_.table_stride;
    const bool selected = selection_.planned();
    const std::int32_t header[4] = {plan.num_splits(), selected ? shape_.num_kv_heads * stride : stride, selected ? stride : 0,
                                    stride};
    std::memcpy(host + layout_.header, header, sizeof header);
    std::memcpy(host + layout_.sealed, full_pages.data(), full_pages.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.read_pages, read_pages.data(), read_pages.size() * sizeof(std::int32_t));
    selection_.stage(host + layout_.selection);
    std::memcpy(host + layout_.work, plan.work.data(), plan.work.size() * sizeof(split_work));
    std::memcpy(host + layout_.partial_offset, plan.partial_offset.data(), plan.partial_offset.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.slots, slots.data(), slots.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.tail_rows, tail_rows.data(), tail_rows.size() * sizeof(std::int32_t));
    auto* tables = reinterpret_cast<std::int32_t*>(host + layout_.tables);
    for (std::size_t b = 0; b < batch.size(); ++b)
      std::copy(batch[b].pages->begin(), batch[b].pages->end(), tables + b * capacity_.table_stride);
    if (masked) {  // per (sequence, table entry): its live rows (every row for a sequence with none evicted),
                   // less the rows attended from their exact copies (sinks, recent window)
      auto* masks = reinterpret_cast<std::uint32_t*>(host + layout_.live_masks);
      const int words = live_mask_words(), words64 = (shape_.page_size + 63) / 64;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const std::int64_t sealed = static_cast<std::int64_t>(full_pages[b]) * shape_.page_size;
        const bool exact = geometry_.exact_rows > 0 && sealed > 0;
        for (std::int32_t i = 0; i < full_pages[b]; ++i)
          for (int w = 0; w < words; ++w) {
            const int rows = std::min(32, shape_.page_size - 32 * w);
            const std::int64_t first = static_cast<std::int64_t>(i) * shape_.page_size + 32 * w;
            std::uint32_t word = rows >= 32 ? ~0u : (1u << rows) - 1;
            if (batch[b].live != nullptr)
              word = static_cast<std::uint32_t>(batch[b].live[static_cast<std::size_t>(i) * words64 + w / 2] >> (32 * (w % 2)));
            if (exact && geometry_.any_exact_position(first, first + rows, sealed))
              for (int r = 0; r < rows; ++r)
                if (geometry_.exact_position(first + r, sealed)) word &= ~(1u << r);
            masks[(b * static_cast<std::size_t>(capacity_.table_stride) + static_cast<std::size_t>(i)) * words + w] = word;
          }
      }
    }
  }

  /// The selection part of a planned selected step alone (the metadata copy, scoring and top-k),
  /// capturable like `launch_step`: for timing selection apart from attention.
  void launch_selection_only(const float* q);

 private:
  /// Room for the token scores of a step of the reserved layout: rows of the read order per
  /// (sequence, KV head), logits and scores on the device, scores in page-locked host memory.
  void reserve_token_scores() {
    const std::int64_t rows = static_cast<std::int64_t>(capacity_.table_stride) * shape_.page_size +
                              static_cast<std::int64_t>(geometry_.exact_rows) + shape_.page_size;
    if (rows <= logit_slots_ && capacity_.batch <= score_batch_) return;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffers may still be in use
    logit_slots_ = std::max(rows, logit_slots_);
    score_batch_ = std::max(capacity_.batch, score_batch_);
    const std::size_t slots = static_cast<std::size_t>(score_batch_) * shape_.num_kv_heads * static_cast<std::size_t>(logit_slots_);
    token_logits_ = device_buffer(slots * shape_.group_size * sizeof(float));
    token_scores_ = device_buffer(slots * sizeof(float));
    scores_host_ = pinned_buffer(slots * sizeof(float));
    score_lse_ = device_buffer(static_cast<std::size_t>(score_batch_) * shape_.num_kv_heads * shape_.group_size * sizeof(float));
  }

  /// Device part of a step (capturable in a CUDA graph): copy the staged metadata, run the split
  /// kernel over a grid of `work_capacity(batch)` x num_kv_heads CTAs, then the merge kernel. On
  /// sm_90 the split and merge kernels are programmatic dependents of the kernel before each
  /// (cuda/detail/dependent_launch.cuh): each is scheduled while its predecessor finishes.
  void launch_step(const float* q, const output_view& out, float softmax_scale);

  /// The step's queries as contiguous float: `q` itself, or a copy gathered into `queries_`
  /// (sized by reserve_step for the largest batch).
  const float* gathered_queries(const query_view& q);

  /// Copies the staged metadata to the device and returns the step's kernel parameters.
  kernel::decode_params stage_step(const float* q, const output_view& out, float softmax_scale) {
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
    p.block_tables = p.sequence_tables;
    p.planned_pages = reinterpret_cast<const std::int32_t*>(device + layout_.read_pages);
    // Evicted tokens: live-row masks per (sequence, entry). A selected step's stage ANDs them into
    // the row masks it writes; otherwise the split kernels read them, every head alike.
    const auto* live = step_masked_ ? reinterpret_cast<const std::uint32_t*>(device + layout_.live_masks) : nullptr;
    selection_.use_live_masks(selection_.planned() ? live : nullptr);
    selection_.bind(p);  // a selected step: the stage's page tables (and row masks)
    if (live != nullptr && !selection_.planned()) {
      p.token_masks = live;
      p.mask_words = live_mask_words();
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
    p.out = out.data;
    std::copy(out.strides, out.strides + 3, p.out_strides);
    p.lse = out.lse;
    std::copy(out.lse_strides, out.lse_strides + 2, p.lse_strides);
    p.group_size = shape_.group_size;
    p.sink_rows = static_cast<int>(geometry_.sink_rows);
    p.exact_rows = static_cast<int>(geometry_.exact_rows);
    if (planned_scores_.use != score_use::none) {
      p.token_logits = token_logits_.as<float>();
      p.logit_slots = logit_slots_;
      if (p.lse == nullptr) {  // the score kernel reads each head's log-sum-exp from the merge
        p.lse = score_lse_.as<float>();
        p.lse_strides[0] = static_cast<std::int64_t>(shape_.num_kv_heads) * shape_.group_size;
        p.lse_strides[1] = 1;
      }
    }
    return p;
  }

 public:
  /// Calls f(kernel, threads, dynamic shared bytes) with the split kernel this engine launches:
  /// the bulk-copy pipeline on sm_90 and later, the portable register-streaming kernel elsewhere.
  template <class F>
  void with_decode_kernel(F&& f) const {
    device::template with_decode_kernel<Shapes, records_token_scores>(format_state_, format_, context(),
                                                                      selection_.row_masks() || step_masked_, f);
  }

  /// The most pages one split may hold (the page ids a format's sm_90 kernel keeps in shared
  /// memory, or no limit).
  int max_pages_per_split(const decode_tuning& t) const { return device::max_pages_per_split(format_state_, t); }

  /// Formats whose sm_90 kernel streams compressed pages through shared-memory stages: sets the
  /// stages (1 to 4; what a stage holds is the format's) and re-reads the occupancy. For tuning
  /// experiments; the format picks a value by itself.
  void set_compressed_stages(int stages) {
    kvmosaic::detail::require(format_state_.stages > 0, "cuda::engine::set_compressed_stages", "this engine's kernel",
                              "without run-time stages", "a format's sm_90 kernel with compressed stages");
    kvmosaic::detail::require(stages >= 1 && stages <= 4, "cuda::engine::set_compressed_stages", "stages", stages,
                              "1 to 4");
    format_state_.stages = stages;
    prepare_decode_kernel();
  }
  /// The stages of the format's kernel (0: none at run time).
  int compressed_stages() const noexcept { return format_state_.stages; }

  /// Splits per KV head the plan aims for: exactly one wave of resident CTAs (occupancy of the
  /// kernel this engine launches, times the SMs), so every split runs at once.
  std::int32_t target_splits() const { return std::max(1, num_sms_ * ctas_per_sm_ / shape_.num_kv_heads); }
  /// Decode with the portable kernel (the sm_75+ path) even on sm_90: for tests and comparisons.
  /// Takes effect from the next step.
  void use_portable_kernel() {
    use_bulk_copy_ = false;
    configure_format();
  }

  /// Programmatic dependent launch of the split and merge kernels (on by default where the device
  /// supports it, sm_90 and later; elsewhere this does nothing). For comparisons: off, each kernel
  /// of a step starts after the one before it has drained. Takes effect from the next launch.
  void use_dependent_launch(bool enable) noexcept { dependent_launch_ = enable && supports_dependent_launch_; }
  bool uses_dependent_launch() const noexcept { return dependent_launch_; }

  /// True when decode runs an sm_90 pipeline (bulk copies or TMA), whose q is rounded to two
  /// 16-bit halves on tensor cores.
  bool uses_bulk_copy() const noexcept { return use_bulk_copy_; }
  /// True when the format's split kernel multiplies p.v on tensor cores, p split into two 16-bit
  /// halves (its device part says).
  bool splits_p_on_tensor_cores() const { return device::splits_p_on_tensor_cores(format_state_, context()); }
  /// Grid size of the split kernel for a batch: an upper bound on the splits of any plan for it
  /// (at most target + batch: each sequence rounds its split count up by less than one), so a
  /// captured graph stays valid. Plans capped by max_pages_per_split (longer than a wave) may need
  /// more; the grid then grows with them (re-capture).
  std::int32_t work_capacity(std::int32_t batch) const { return target_splits() + batch; }

 private:
  static std::size_t align(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
  /// Split sizes in multiples of the workers a format's split kernel deals its pages to.
  static constexpr std::int32_t split_page_multiple = device::split_page_multiple;
  /// Completed pages per encode pass (encoded formats): bounds the scratch arena for a prefill.
  static constexpr std::int32_t encode_chunk_pages = 64;

  /// The format's device part decides its kernel path for this device (and may turn the sm_90
  /// pipelines off); then the kernel's occupancy sizes the split plan.
  void configure_format();
  device_context context() const {
    return device_context{&shape_,  &geometry_, pages_.as<std::byte>(), tails_.as<std::byte>(), device_, use_bulk_copy_,
                          stream_,  segment_arena_.as<const std::byte>(), segments_per_sequence_,
                          !selector_traits<Selector>::reads_all_pages};
  }
  /// Pages per segment for the split plan (its splits stay within one), 0 for formats without.
  std::int32_t plan_segment_pages() const {
    if constexpr (has_segments_v<Format>) return traits::segment_pages(format_, shape_.page());
    else return 0;
  }

  /// Formats with segments: before pages [sealed_pages, sealed_pages + pages) of the sequence in
  /// `slot` are sealed from its tail (`tail_rows` rows) and rows [first, ...) of the call's
  /// device rows `k`, `v`, plans each of them that starts a segment on the host from the rows the
  /// host engine would see (`detail::plan_segments`: the tail as it will be at that seal, and the
  /// call's rows after it), keeps the host copy and writes the device entries. Cost per segment:
  /// a copy of the segment's rows to the host, the format's plan, a copy of the entries back
  /// (synchronizes the stream).
  template <class T>
  void plan_segments_in(std::int32_t slot, int tail_rows, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v,
                        std::int64_t first, std::int32_t pages, std::int64_t sealed_pages) {
    const page_shape shape = shape_.page();
    const int per = traits::segment_pages(format_, shape), p = shape_.page_size;
    const std::int64_t row_elements = static_cast<std::int64_t>(shape_.num_kv_heads) * shape_.head_dim;
    for (std::int32_t i = 0; i < pages; ++i) {
      const std::int64_t index = sealed_pages + i;
      if (index % per != 0) continue;
      const std::int64_t page_first = first + static_cast<std::int64_t>(i) * p - tail_rows;  // call row of the page's row 0
      const std::int64_t next = page_first + p;
      const std::int64_t ahead = std::min<std::int64_t>(k.extent(0) - next, static_cast<std::int64_t>(per - 1) * p);
      const std::int64_t base = std::max<std::int64_t>(0, page_first), count = next + ahead - base;
      std::vector<T> k_rows(static_cast<std::size_t>(count * row_elements)), v_rows(k_rows.size());
      std::vector<std::byte> tail(geometry_.tail_slot_bytes());
      const std::size_t row_bytes = static_cast<std::size_t>(row_elements) * sizeof(T);
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(k_rows.data(), k.data() + base * row_elements, count * row_bytes, cudaMemcpyDeviceToHost, stream_));
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(v_rows.data(), v.data() + base * row_elements, count * row_bytes, cudaMemcpyDeviceToHost, stream_));
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tail.data(), tails_.as<const std::byte>() + slot * tail.size(), tail.size(),
                                          cudaMemcpyDeviceToHost, stream_));
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
      const tensor_view<const T, 3> k_view(k_rows.data(), count, shape_.num_kv_heads, shape_.head_dim);
      const tensor_view<const T, 3> v_view(v_rows.data(), count, shape_.num_kv_heads, shape_.head_dim);
      // The tail as it is at the seal: the call's rows of the page after the tail's own.
      std::vector<float> row(static_cast<std::size_t>(shape_.head_dim));
      for (std::int64_t r = std::max<std::int64_t>(0, -page_first); r < p; ++r)
        for (int h = 0; h < shape_.num_kv_heads; ++h)
          for (const bool is_v : {false, true}) {
            for (int c = 0; c < shape_.head_dim; ++c) row[static_cast<std::size_t>(c)] = to_float((is_v ? v_view : k_view)(page_first + r - base, h, c));
            kvmosaic::detail::store_dense_rows(shape_.storage, row.data(), row.size(),
                                               tail.data() + geometry_.tail_offset(is_v, h) + geometry_.tail_row_offset() +
                                                   static_cast<std::size_t>(r) * geometry_.row_bytes);
          }
      std::vector<segment_t> planned =
          kvmosaic::detail::plan_segments(format_, shape_, geometry_, tail.data(), index, k_view, v_view, next - base);
      const std::size_t entry_bytes = device::segment_entry_bytes(format_, shape);
      std::vector<std::byte> entries(planned.size() * entry_bytes);
      for (std::size_t h = 0; h < planned.size(); ++h) device::store_segment(format_, shape, planned[h], entries.data() + h * entry_bytes);
      const std::size_t at = (static_cast<std::size_t>(slot) * segments_per_sequence_ + static_cast<std::size_t>(index / per)) *
                             shape_.num_kv_heads * entry_bytes;
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(segment_arena_.as<std::byte>() + at, entries.data(), entries.size(), cudaMemcpyHostToDevice, stream_));
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::vector<segment_t>& list = segments_[static_cast<std::size_t>(slot)];
      list.resize(static_cast<std::size_t>(index / per) * shape_.num_kv_heads);
      list.insert(list.end(), std::make_move_iterator(planned.begin()), std::make_move_iterator(planned.end()));
    }
  }
  static const kvmosaic::detail::engine_shape& validated(const kvmosaic::detail::engine_shape& shape, const Format& format) {
    kvmosaic::detail::require(Shapes::contains(shape.storage, shape.head_dim, shape.group_size), "cache_config",
                              "storage/head_dim/group_size",
                              std::string(to_string(shape.storage)) + "/" + std::to_string(shape.head_dim) + "/" +
                                  std::to_string(shape.group_size),
                              ("a shape of the cache's CUDA backend: " + Shapes::describe()).c_str());
    device::validate(format, shape);
    return shape;
  }

  /// Raises the chosen split kernel's dynamic shared-memory limit and reads its occupancy, which
  /// sizes the split plan.
  void prepare_decode_kernel();

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

  /// Writes rows and completes pages; `sealed[i]`: new page i's tail slot, first position and the
  /// sequence's window start once the write is done (its exact rows are copied to the tail slot).
  void run_extend(const std::vector<kernel::extend_item>& items, const page_id* new_pages, std::int32_t num_new_pages,
                  const void* k, const void* v, dtype rows_type, std::int64_t max_rows, const std::vector<kernel::exact_item>& sealed);
  /// What the exact-row copy needs of page `index` of the sequence in `slot` that has `pages_after`
  /// pages once the write is done.
  kernel::exact_item sealed_page(std::int32_t slot, std::int64_t index, std::int64_t pages_after) const noexcept {
    const std::int64_t p = shape_.page_size;
    return kernel::exact_item{index * p, pages_after * p - static_cast<std::int64_t>(geometry_.window_rows), slot, 0};
  }

  /// Grows the scratch arena of dense page rows that encoded formats compress from.
  void reserve_scratch(std::int32_t pages) {
    if (pages <= scratch_pages_) return;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old arena may still be read
    scratch_pages_ = std::max(pages, encode_chunk_pages);
    scratch_ = device_buffer(static_cast<std::size_t>(scratch_pages_) * geometry_.tail_slot_bytes());
  }

  /// Keeps the tail slot `slot` on the device for `rollback` (a stream-ordered copy).
  void save_tail(std::int32_t slot) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    if (saved_tail_.size() < bytes) saved_tail_ = device_buffer(bytes);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(saved_tail_.data(), tails_.as<const std::byte>() + slot * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    saved_slot_ = slot;
  }
  /// One chunk of a staged compaction pass: byte offsets in its metadata of the written pages'
  /// ids, their scratch ordinals and K weight rows, the pages to unpack, and the row map.
  struct move_chunk {
    std::size_t written = 0, ordinals = 0, weight_rows = 0, unpacked = 0, sources_of = 0;
    std::int32_t pages_written = 0, pages_unpacked = 0;
  };
  struct layout_capacity {
    std::int32_t batch = 0, table_stride = 0, work = 0;
    bool live_masks = false;  ///< room for live-row masks (once a step had evicted tokens)
  };
  /// 32-bit row-mask words per page.
  int live_mask_words() const noexcept { return (shape_.page_size + 31) / 32; }
  /// Byte offsets of the step metadata: [header][work][partial_offset][slots][tail_rows][sealed pages]
  /// [pages to read][tables][the selection stage's inputs].
  struct step_layout {
    std::size_t header = 0, work = 0, partial_offset = 0, slots = 0, tail_rows = 0, sealed = 0, read_pages = 0, tables = 0,
                live_masks = 0, selection = 0, bytes = 0;
  };
  kvmosaic::detail::engine_shape shape_;
  Format format_;
  kvmosaic::detail::arena_geometry geometry_;
  device_buffer pages_;
  device_buffer tails_;
  selection_type selection_;     ///< the selector's device part
  int device_ = 0;
  int num_sms_ = 1;
  int ctas_per_sm_ = 1;
  bool use_bulk_copy_ = false;
  bool supports_dependent_launch_ = false;  ///< sm_90 and later
  bool dependent_launch_ = false;           ///< split and merge kernels overlap their predecessor's end
  cudaStream_t stream_ = nullptr;
  cudaEvent_t staged_ = nullptr;  ///< the last copy out of page-locked staging
  layout_capacity capacity_;
  step_layout layout_;
  std::int32_t batch_ = 0;
  std::int32_t step_splits_ = 0;
  bool step_masked_ = false;  ///< the planned step reads live-row masks (a sequence has evicted tokens)
  pinned_buffer staging_, extend_staging_;
  device_buffer step_metadata_, extend_metadata_, partials_;
  device_buffer queries_;         ///< a step's queries gathered to contiguous float (when they are not)
  float softmax_scale_ = 1.0f;    ///< of the planned step
  score_settings planned_scores_;  ///< of the planned step
  bool logits_only_ = false;       ///< the step writes logits for `window_votes`, no token scores
  std::int64_t step_rows_ = 0;     ///< the planned step's most rows of one sequence's read order
  std::int64_t logit_slots_ = 0;   ///< rows per (sequence, KV head) of the token-score buffers
  std::int32_t score_batch_ = 0;   ///< sequences they hold
  device_buffer token_logits_;     ///< [batch][KV head][logit_slots_][group] (steps with token scores)
  device_buffer token_scores_;     ///< [batch][KV head][logit_slots_]
  pinned_buffer scores_host_;      ///< the same, downloaded
  device_buffer score_lse_;        ///< [batch][num_q_heads]: the merge's log-sum-exps when the caller wants none
  device_buffer scratch_;        ///< dense rows of pages to encode (encoded formats)
  device_buffer key_weights_;    ///< [max_sequences][num_kv_heads][head_dim] output-aware K weights
  std::vector<bool> has_key_weights_ = std::vector<bool>(static_cast<std::size_t>(shape_.max_sequences), false);
  std::int32_t scratch_pages_ = 0;
  pinned_buffer move_staging_;     ///< a compaction pass's metadata (`stage_moves`)
  device_buffer move_metadata_;
  std::size_t move_bytes_ = 0;
  std::vector<move_chunk> move_chunks_;
  device_buffer unpacked_;         ///< dense rows of the pages a compaction chunk reads (encoded formats)
  std::int32_t unpacked_pages_ = 0;
  device_buffer saved_tail_;      ///< one tail slot kept for `rollback`
  std::int32_t saved_slot_ = -1;  ///< its slot, -1: nothing to restore
  typename device::state format_state_{};  ///< the format's device decisions (kernel path, stages)
  /// Formats with segments: per tail slot the host copies of its sequence's segments,
  /// [segment * num_kv_heads + head], and the device arena of their entries.
  std::vector<std::vector<segment_t>> segments_ = std::vector<std::vector<segment_t>>(static_cast<std::size_t>(shape_.max_sequences));
  device_buffer segment_arena_;
  int segments_per_sequence_ = 0;
  Format reencoding_ = kvmosaic::detail::reencoding<Format>::format(format_);  ///< what a compaction encodes with
};

// The members that launch kernels, out of line: an explicit instantiation declaration of the
// engine (cuda/instantiate.cuh) then keeps them, and every kernel they launch, out of a
// translation unit.

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_selection_only(const float* q) {
  kvmosaic::detail::require(selects && selection_.planned(), "cuda::engine::launch_selection_only", "the planned step",
                            "not selected", "a step planned with a selection request (a read-less selector)");
  selection_.launch(stage_step(q, output_view{}, 1.0f), step_metadata_.as<const std::byte>() + layout_.selection, q, stream_);
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_step(const float* q, const output_view& out, float softmax_scale) {
  kernel::split_params<typename device::params> p{};
  static_cast<kernel::decode_params&>(p) = stage_step(q, out, softmax_scale);
  p.format = device::params_for(format_state_, format_, context());
  if constexpr (selects)
    if (selection_.planned()) selection_.launch(p, step_metadata_.as<const std::byte>() + layout_.selection, q, stream_);
  const int num_q_heads = shape_.num_kv_heads * shape_.group_size;
  const dim3 grid(static_cast<unsigned>(std::max(work_capacity(batch_), step_splits_)), static_cast<unsigned>(shape_.num_kv_heads));
  with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
    detail::launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), detail::opted_in_shared(kernel, shared_bytes),
                          stream_, dependent_launch_, p);
  });
  const kernel::decode_params& common = p;
  detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto, auto dim, auto) {
    constexpr int head_dim = decltype(dim)::value;
    detail::dispatch_io_type(out.type, [&](auto element) {
      detail::launch_kernel(kernel::merge_splits_kernel<head_dim, decltype(element)>, dim3(static_cast<unsigned>(batch_ * num_q_heads)),
                            dim3(merge_threads(head_dim)), 0, stream_, dependent_launch_, common, num_q_heads);
    });
  });
  if constexpr (records_token_scores) {
    if (planned_scores_.use == score_use::none || logits_only_) return;
    // About 8 rows per thread: enough CTAs to fill the device at one sequence, few partial-state
    // merges per CTA.
    constexpr std::int64_t rows_per_cta = 8 * kernel::token_score_threads;
    const dim3 grid_scores(static_cast<unsigned>(std::max<std::int64_t>(1, (step_rows_ + rows_per_cta - 1) / rows_per_cta)),
                           static_cast<unsigned>(shape_.num_kv_heads), static_cast<unsigned>(batch_));
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, shape_.group_size, [&](auto, auto, auto group) {
      detail::launch_kernel(kernel::token_scores_kernel<decltype(group)::value>, grid_scores,
                            dim3(static_cast<unsigned>(kernel::token_score_threads)), 0, stream_, dependent_launch_, common,
                            token_scores_.as<float>(), planned_scores_.combine == group_combine::max);
    });
  }
}

template <class Format, class Selector, class Shapes>
std::vector<float> engine<Format, Selector, Shapes>::window_votes(const kvmosaic::detail::sequence_ref& sequence,
                                                                  const float* queries, int window,
                                                                  const std::vector<std::int64_t>& row_positions,
                                                                  std::int64_t window_start, float softmax_scale,
                                                                  group_combine combine) {
  const char* where = "cuda::engine::window_votes";
  kvmosaic::detail::require(computes_window_votes, where, "the engine", "without exact logits",
                            "an engine of format::dense or bitmap_tiles under a selector that reads window votes");
  kvmosaic::detail::require(window >= 1, where, "window", window, ">= 1");
  const auto rows = static_cast<std::int64_t>(row_positions.size());
  const int heads = shape_.num_kv_heads, group = shape_.group_size;
  const std::size_t query_floats = static_cast<std::size_t>(heads) * group * shape_.head_dim;
  const int per_step = std::min(window, window_batch);
  device_buffer device_queries(static_cast<std::size_t>(window) * query_floats * sizeof(float));
  device_buffer outputs(static_cast<std::size_t>(per_step) * query_floats * sizeof(float));
  device_buffer positions(static_cast<std::size_t>(rows) * sizeof(std::int64_t));
  device_buffer lse(static_cast<std::size_t>(per_step) * heads * group * sizeof(float));
  device_buffer votes(static_cast<std::size_t>(heads) * static_cast<std::size_t>(rows) * sizeof(float));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(device_queries.data(), queries, device_queries.size(), cudaMemcpyHostToDevice, stream_));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(positions.data(), row_positions.data(), positions.size(), cudaMemcpyHostToDevice, stream_));
  KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(votes.data(), 0, votes.size(), stream_));
  struct logits_only_scope {  // the flag is the engine's state: cleared on every way out
    bool& flag;
    explicit logits_only_scope(bool& f) : flag(f) { flag = true; }
    ~logits_only_scope() { flag = false; }
  } scope(logits_only_);
  output_view out{outputs.data(), dtype::f32,
                  {static_cast<std::int64_t>(query_floats), static_cast<std::int64_t>(shape_.head_dim), 1}, nullptr, {0, 0}};
  for (int first = 0; first < window; first += per_step) {
    const int n = std::min(per_step, window - first);
    plan(std::vector<kvmosaic::detail::sequence_ref>(static_cast<std::size_t>(n), sequence), softmax_scale, nullptr,
         score_settings{score_use::last_step, combine});
    launch_step(device_queries.as<const float>() + static_cast<std::size_t>(first) * query_floats, out, softmax_scale_);
    const kernel::window_vote_params p{token_logits_.as<const float>(), logit_slots_, positions.as<const std::int64_t>(),
                                       rows, window_start, first, n, heads, lse.as<float>(), votes.as<float>(),
                                       combine == group_combine::max};
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, group, [&](auto, auto, auto g) {
      constexpr int Group = decltype(g)::value;
      kernel::window_lse_kernel<Group><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(heads)),
                                         kernel::window_vote_threads, 0, stream_>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      const auto blocks = static_cast<unsigned>((rows + kernel::window_vote_threads - 1) / kernel::window_vote_threads);
      kernel::window_votes_kernel<Group><<<dim3(std::max(blocks, 1u), static_cast<unsigned>(heads)),
                                           kernel::window_vote_threads, 0, stream_>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
  std::vector<float> out_votes(static_cast<std::size_t>(heads) * static_cast<std::size_t>(rows));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out_votes.data(), votes.data(), votes.size(), cudaMemcpyDeviceToHost, stream_));
  KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // also: the buffers above outlive their kernels
  return out_votes;
}

template <class Format, class Selector, class Shapes>
const float* engine<Format, Selector, Shapes>::gathered_queries(const query_view& q) {
  if (q.type == dtype::f32 && q.contiguous) return static_cast<const float*>(q.data);
  detail::dispatch_io_type(q.type, [&](auto element) {
    using Q = decltype(element);
    const kernel::query_source<Q> source{static_cast<const Q*>(q.data), {q.strides[0], q.strides[1], q.strides[2]},
                                         static_cast<int>(q.extents[0]), static_cast<int>(q.extents[1]),
                                         static_cast<int>(q.extents[2])};
    constexpr int threads = 256;
    kernel::gather_queries_kernel<Q><<<detail::grid_for(q.extents[0] * q.extents[1] * q.extents[2], threads), threads, 0, stream_>>>(
        source, queries_.as<float>());
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  });
  return queries_.as<const float>();
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::stage_moves(std::int32_t slot, const block_table& pages,
                                                   const kvmosaic::detail::compaction_plan& plan, bool first_page_sinks) {
  const int p = shape_.page_size;
  const std::vector<std::int32_t>& written = plan.pages_written;  // block-table indices, ascending
  const auto n = static_cast<std::int32_t>(written.size());
  const auto index_of = [&](std::int64_t page) {
    return static_cast<std::size_t>(std::lower_bound(written.begin(), written.end(), static_cast<std::int32_t>(page)) - written.begin());
  };
  // Row r of written page i takes the token in sealed slot source[i * p + r] (block-table slots).
  std::vector<std::int64_t> source(static_cast<std::size_t>(n) * p);
  for (std::int32_t i = 0; i < n; ++i)
    for (int r = 0; r < p; ++r) source[static_cast<std::size_t>(i) * p + r] = static_cast<std::int64_t>(written[i]) * p + r;
  for (const kvmosaic::detail::slot_move& m : plan.moves) source[index_of(m.to / p) * p + m.to % p] = m.from;
  const int sinks = kvmosaic::detail::hides_sink_rows_v<Format> && first_page_sinks && n > 0 && written[0] == 0
                        ? static_cast<int>(geometry_.sink_rows)
                        : 0;
  for (int t = 0; t < sinks; ++t) source[static_cast<std::size_t>(t)] = source[static_cast<std::size_t>(sinks)];  // hidden as at seal

  // Chunks of written pages; the pages a chunk reads (distinct source pages, first-use order).
  const auto pages_read = [&](std::int32_t first, std::int32_t last) {
    std::vector<std::int32_t> read;
    for (std::size_t at = static_cast<std::size_t>(first) * p; at < static_cast<std::size_t>(last) * p; ++at) {
      const auto page = static_cast<std::int32_t>(source[at] / p);
      if (std::find(read.begin(), read.end(), page) == read.end()) read.push_back(page);
    }
    return read;
  };
  std::vector<std::pair<std::int32_t, std::int32_t>> ranges;
  bool ordered = true;  // no chunk reads a page an earlier chunk wrote
  for (std::int32_t first = 0; first < n; first += encode_chunk_pages) {
    const std::int32_t last = std::min(n, first + encode_chunk_pages);
    for (const std::int32_t page : pages_read(first, last))
      ordered = ordered && !std::binary_search(written.begin(), written.begin() + first, page);
    ranges.emplace_back(first, last);
  }
  if (!ordered) ranges.assign(1, {0, n});

  if constexpr (!encodes_pages)  // read in place and written back as scratch rows are laid out
    kvmosaic::detail::require(geometry_.k_page_bytes == geometry_.v_page_bytes && geometry_.k_page_bytes == p * geometry_.row_bytes,
                              "cuda::engine::move_slots", "the format's page layout", "not dense rows",
                              "dense rows [page_size][head_dim] per head (a format without an encoder)");
  const std::int64_t max_sources = static_cast<std::int64_t>(shape_.max_pages) * p;
  kvmosaic::detail::require(max_sources <= std::numeric_limits<std::int32_t>::max(), "cache::compact", "max_pages * page_size",
                            max_sources, "below 2^31 on backend::cuda (the row map is 32-bit)");
  std::vector<std::vector<std::int32_t>> reads;
  std::size_t bytes = 0;
  std::int32_t most_written = 0, most_read = 0;
  move_chunks_.clear();
  for (const auto& [first, last] : ranges) {
    move_chunk c;
    c.pages_written = last - first;
    reads.push_back(encodes_pages ? pages_read(first, last) : std::vector<std::int32_t>{});
    c.pages_unpacked = static_cast<std::int32_t>(reads.back().size());
    const std::size_t ids = align(static_cast<std::size_t>(c.pages_written) * sizeof(std::int32_t));
    c.written = bytes;
    c.ordinals = c.written + ids;
    c.weight_rows = c.ordinals + ids;
    c.unpacked = c.weight_rows + ids;
    c.sources_of = c.unpacked + align(static_cast<std::size_t>(c.pages_unpacked) * sizeof(std::int32_t));
    bytes = c.sources_of + align(static_cast<std::size_t>(c.pages_written) * p * sizeof(std::int32_t));
    most_written = std::max(most_written, c.pages_written);
    most_read = std::max(most_read, c.pages_unpacked);
    move_chunks_.push_back(c);
  }
  reserve_scratch(most_written);
  if (most_read > unpacked_pages_) {
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old arena may still be read
    unpacked_pages_ = std::max(most_read, encode_chunk_pages);
    unpacked_ = device_buffer(static_cast<std::size_t>(unpacked_pages_) * geometry_.tail_slot_bytes());
  }
  KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));  // the previous copy has left the staging
  move_staging_.reserve(bytes);
  move_metadata_.reserve(bytes);
  move_bytes_ = bytes;
  std::byte* host = move_staging_.as<std::byte>();
  bool weighted = false;
  if constexpr (has_key_weights_v<Format>)
    weighted = kvmosaic::detail::reencoding<Format>::key_weights && has_key_weights_[static_cast<std::size_t>(slot)];
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const move_chunk& c = move_chunks_[k];
    const std::int32_t first = ranges[k].first;
    const std::vector<std::int32_t>& read = reads[k];
    auto* ids = reinterpret_cast<std::int32_t*>(host + c.written);
    auto* ordinals = reinterpret_cast<std::int32_t*>(host + c.ordinals);
    auto* weight_rows = reinterpret_cast<std::int32_t*>(host + c.weight_rows);
    auto* unpacked = reinterpret_cast<std::int32_t*>(host + c.unpacked);
    auto* sources_of = reinterpret_cast<std::int32_t*>(host + c.sources_of);
    for (std::int32_t i = 0; i < c.pages_written; ++i) {
      ids[i] = pages[static_cast<std::size_t>(written[static_cast<std::size_t>(first + i)])];
      ordinals[i] = i;
      weight_rows[i] = weighted ? slot : -1;
    }
    for (std::size_t i = 0; i < read.size(); ++i) unpacked[i] = pages[static_cast<std::size_t>(read[i])];
    for (std::size_t at = 0; at < static_cast<std::size_t>(c.pages_written) * p; ++at) {
      const std::int64_t from = source[static_cast<std::size_t>(first) * p + at];
      const auto page = static_cast<std::int32_t>(from / p);
      // Encoded formats read unpacked slot (index in `read`), others the page itself.
      const std::int64_t source_slot = encodes_pages ? static_cast<std::int64_t>(std::find(read.begin(), read.end(), page) - read.begin())
                                                     : static_cast<std::int64_t>(pages[static_cast<std::size_t>(page)]);
      sources_of[at] = static_cast<std::int32_t>(source_slot * p + from % p);
    }
  }
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_moves() {
  detail::pull_from_host(move_staging_, move_metadata_.data(), move_bytes_, stream_);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  KVMOSAIC_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
  if (capturing == cudaStreamCaptureStatusNone) KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
  const std::byte* metadata = move_metadata_.as<const std::byte>();
  const device_context c = context();
  const auto i32 = [&](std::size_t at) { return reinterpret_cast<const std::int32_t*>(metadata + at); };
  const auto copy_rows = [&](const kernel::copy_rows_params& params) {
    const std::int64_t vectors = static_cast<std::int64_t>(params.n) * shape_.page_size * 2 * shape_.num_kv_heads *
                                 (shape_.head_dim / detail::vector_elements);
    kernel::copy_rows_kernel<><<<detail::grid_for(vectors, kernel::copy_rows_threads), kernel::copy_rows_threads, 0, stream_>>>(params);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  };
  const auto tail_slot = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
  const auto tail_head = static_cast<std::int64_t>(geometry_.tail_head_bytes);
  for (const move_chunk& chunk : move_chunks_) {
    kernel::copy_rows_params gather{};
    if constexpr (encodes_pages) {
      device::template unpack_pages<Shapes>(format_state_, format_, unpack_context{&c, unpacked_.as<std::byte>(), i32(chunk.unpacked), chunk.pages_unpacked});
      gather = {unpacked_.as<const std::byte>(), tail_slot, tail_head, nullptr, 0, 0, nullptr, nullptr, 0, 0, 0, 0};
    } else {  // the pages are dense rows: read in place
      gather = {pages_.as<const std::byte>(), static_cast<std::int64_t>(geometry_.page_slot_bytes()),
                static_cast<std::int64_t>(geometry_.k_page_bytes), nullptr, 0, 0, nullptr, nullptr, 0, 0, 0, 0};
    }
    gather.rows = scratch_.as<std::byte>();
    gather.rows_slot_bytes = tail_slot;
    gather.rows_head_bytes = tail_head;
    gather.sources_of = i32(chunk.sources_of);
    gather.n = chunk.pages_written;
    gather.num_kv_heads = shape_.num_kv_heads;
    gather.head_dim = shape_.head_dim;
    gather.page_size = shape_.page_size;
    copy_rows(gather);
    selection_.seal(sealed_pages{scratch_.as<const std::byte>(), tail_slot, tail_head, i32(chunk.ordinals), i32(chunk.written),
                                 chunk.pages_written},
                    stream_);
    if constexpr (encodes_pages) {
      const encode_context e{&c, scratch_.as<const std::byte>(), i32(chunk.written), i32(chunk.weight_rows),
                             key_weights_.size() > 0 ? key_weights_.as<const float>() : nullptr, nullptr, chunk.pages_written,
                             nullptr};  // formats with segments do not compact on this backend (cache.hpp)
      device::template encode_pages<Shapes>(format_state_, reencoding_, e);
    } else {
      kernel::copy_rows_params back = gather;
      back.sources = scratch_.as<const std::byte>();
      back.source_slot_bytes = tail_slot;
      back.source_head_bytes = tail_head;
      back.rows = pages_.as<std::byte>();
      back.rows_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
      back.rows_head_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
      back.sources_of = nullptr;
      back.slot_ids = i32(chunk.written);
      copy_rows(back);
    }
  }
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::configure_format() {
  device_context c = context();
  device::template configure<Shapes>(format_state_, format_, c);
  use_bulk_copy_ = c.bulk_copy;
  prepare_decode_kernel();
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::prepare_decode_kernel() {
  with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
    if (shared_bytes > 48 * 1024)
      KVMOSAIC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
    KVMOSAIC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm_, kernel, threads, shared_bytes));
    ctas_per_sm_ = std::max(ctas_per_sm_, 1);
  });
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::run_extend(const std::vector<kernel::extend_item>& items, const page_id* new_pages,
                                               std::int32_t num_new_pages, const void* k, const void* v, dtype rows_type,
                                               std::int64_t max_rows, const std::vector<kernel::exact_item>& sealed) {
  // Staging: [items][new page ids], and for encoded formats [scratch ordinals 0 .. n) [the K
  // weight row of each new page, -1 for none] [sink slots: a sequence's first page's slot, else
  // -1]; then, for formats with exact rows, [exact items].
  const std::size_t items_bytes = align(items.size() * sizeof(kernel::extend_item));
  const std::size_t pages_bytes = align(static_cast<std::size_t>(num_new_pages) * sizeof(page_id));
  const bool exact = geometry_.exact_rows > 0 && num_new_pages > 0;
  const std::size_t exact_at = items_bytes + (encodes_pages ? 5 : 1) * pages_bytes;
  const std::size_t bytes = exact_at + (exact ? align(static_cast<std::size_t>(num_new_pages) * sizeof(kernel::exact_item)) : 0);
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
    auto* sink_slots = reinterpret_cast<std::int32_t*>(staging + items_bytes + 3 * pages_bytes);
    for (std::int32_t i = 0; i < num_new_pages; ++i)
      sink_slots[i] = sealed[static_cast<std::size_t>(i)].first == 0 && geometry_.sink_rows > 0 ? sealed[static_cast<std::size_t>(i)].slot : -1;
    auto* segment_entries = reinterpret_cast<std::int32_t*>(staging + items_bytes + 4 * pages_bytes);
    for (std::int32_t i = 0; i < num_new_pages; ++i) {
      const kernel::exact_item& page = sealed[static_cast<std::size_t>(i)];
      segment_entries[i] = plan_segment_pages() > 0
                               ? page.slot * segments_per_sequence_ + static_cast<std::int32_t>(page.first / shape_.page_size / plan_segment_pages())
                               : -1;
    }
    reserve_scratch(num_new_pages);
  }
  if (exact) std::memcpy(staging + exact_at, sealed.data(), sealed.size() * sizeof(kernel::exact_item));
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
  p.page_head_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_head_bytes : geometry_.k_page_bytes);
  p.tail_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
  p.tail_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
  p.tail_row_offset = static_cast<std::int64_t>(geometry_.tail_row_offset());
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
    detail::dispatch_io_type(rows_type, [&](auto input) {
      using T = decltype(input);
      kernel::scatter_rows_kernel<S, T><<<row_grid, extend_threads, 0, stream_>>>(p, static_cast<const T*>(k), static_cast<const T*>(v));
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    if (exact) {  // the sinks and the recent window, from the completed pages' dense rows
      const dim3 exact_grid(detail::grid_for(vectors_per_row * shape_.page_size, extend_threads), static_cast<unsigned>(num_new_pages));
      kernel::keep_exact_rows_kernel<S><<<exact_grid, extend_threads, 0, stream_>>>(
          p, reinterpret_cast<const kernel::exact_item*>(metadata + exact_at), static_cast<int>(geometry_.sink_rows),
          static_cast<int>(geometry_.window_rows));
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    }
  };
  detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto, auto) { scatter(element); });
  // The selector sees the new pages' dense rows: in their page slots, or in scratch slots 0 .. n.
  selection_.seal(sealed_pages{encodes_pages ? scratch_.as<const std::byte>() : pages_.as<const std::byte>(),
                               static_cast<std::int64_t>(encodes_pages ? geometry_.tail_slot_bytes() : geometry_.page_slot_bytes()),
                               static_cast<std::int64_t>(encodes_pages ? geometry_.tail_head_bytes : geometry_.k_page_bytes),
                               encodes_pages ? page_ids + pages_bytes / sizeof(std::int32_t) : page_ids, page_ids, num_new_pages},
                  stream_);
  if constexpr (encodes_pages) {
    if (num_new_pages > 0) {
      const device_context c = context();
      const encode_context e{&c,
                             scratch_.as<const std::byte>(),
                             page_ids,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 2 * pages_bytes),
                             key_weights_.size() > 0 ? key_weights_.as<const float>() : nullptr,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 3 * pages_bytes),
                             num_new_pages,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 4 * pages_bytes)};
      device::template encode_pages<Shapes>(format_state_, format_, e);
    }
  }
}
}  // namespace cuda

namespace detail {
template <class Format, class Selector, class... Shapes>
struct engine_for<backend::cuda_for<Shapes...>, Format, Selector> {
  using type = cuda::engine<Format, Selector, cuda::detail::shape_list<Shapes...>>;
};
}  // namespace detail

}  // namespace kvmosaic
// ---- end <kvmosaic/cuda/backend.cuh> ----
// The formats' device parts (cuda/format/device_format.cuh): one line per format.

// ---- begin <kvmosaic/cuda/format/dense/device.cuh> ----
/// \file
/// format::dense on the device (cuda/format/device_format.cuh says what a device part provides):
/// rows are copied into pages as they are (no encode pass); decode runs the sm_90 TMA +
/// tensor-core kernel where the page size divides or is a multiple of its 64-token stage, the
/// sm_90 bulk-copy pipeline for other page sizes, and the portable SIMT kernel before sm_90.



// ---- begin <kvmosaic/cuda/format/dense/decode.cuh> ----
/// \file
/// format::dense's split kernels: the portable SIMT kernel (`decode_partial_kernel`, sm_75+,
/// generic over a format's `page_attend` collective), the sm_90 bulk-copy pipeline
/// (`decode_partial_bulk_kernel`, page sizes that neither divide nor are multiples of 64) and the
/// sm_90 TMA + tensor-core kernel (`decode_partial_tma_kernel`). The dense tail always goes
/// through the dense collective.




namespace kvmosaic::cuda::kernel {

/// format::dense's fields of its split kernels' params: the page and tail arenas as 2D tensors
/// of rows (head_dim wide) for the sm_90 TMA kernel, row ((slot * 2 + is_v) * num_kv_heads +
/// head) * rows per head + row (page_size rows per page head; a tail head's rows: the exact rows,
/// then page_size tail rows), 128-byte swizzled boxes (unused by the other kernels).
struct dense_decode_params {
  CUtensorMap page_rows;
  CUtensorMap tail_rows;
};

/// The portable split kernel (any architecture): each thread streams its K/V slices from global
/// memory into registers, `Unroll` tokens in flight. Grid: (splits capacity, num_kv_heads).
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_kernel(const split_params<dense_decode_params> p) {
  using collective = page_attend<Format, T, HeadDim, Group, Threads, Unroll>;
  using tail_collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  static_assert(collective::rows == tail_collective::rows && collective::lanes_per_row == tail_collective::lanes_per_row,
                "a format's collective must use the shared thread mapping");
  constexpr int lanes_per_row = collective::lanes_per_row;
  __shared__ decode_temp_storage<Group, HeadDim, collective::rows> temp;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);

  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  // A step with token scores: format::dense's collective writes each row's logits (others: none
  // yet; the engine refuses scores for them).
  constexpr bool writes_logits = std::is_same<Format, format::dense>::value;
  float* const logits = writes_logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;
  std::int32_t next_page = range.begin < range.end ? table[range.begin] : 0;
  for (int i = range.begin; i < range.end; ++i) {
    const std::int32_t page = next_page;
    if (i + 1 < range.end) next_page = table[i + 1];  // in flight while this page is read
    const std::byte* slot = p.pages + static_cast<std::size_t>(page) * p.page_slot_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    if constexpr (writes_logits)
      collective::fold(slot + head * p.k_page_bytes, slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                       p.page_size, s, rows_read,
                       logits != nullptr ? logits + static_cast<std::size_t>(i - range.begin) * p.page_size * Group : nullptr);
    else
      collective::fold(slot + head * p.k_page_bytes, slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                       p.page_size, s, rows_read);
  }
  if (w.with_tail) {  // the exact rows and the tail rows
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * sizeof(T);
    tail_collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s,
                          nullptr,
                          logits != nullptr ? logits + static_cast<std::size_t>(range.end - range.begin) * p.page_size * Group
                                            : nullptr);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(p, work_index, head, s, temp);
}

/// Dynamic shared memory of the bulk-copy split kernel: the split's page ids, one barrier per
/// stage, one stage of logits, and `Stages` buffers of `StageTokens` K rows and V rows. The
/// reduction at the end reuses the stage buffers.
template <class T, int HeadDim, int Group, int StageTokens, int Stages, int MaxPagesPerSplit>
struct bulk_decode_layout {
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));
  static constexpr int ids_bytes = (MaxPagesPerSplit * 4 + 127) / 128 * 128;
  static constexpr int barrier_offset = ids_bytes;
  static constexpr int logits_offset = ids_bytes + 128;
  static constexpr int logits_bytes = (Group * StageTokens * 4 + 127) / 128 * 128;
  static constexpr int stage_offset = logits_offset + logits_bytes;
  static constexpr int stage_bytes = StageTokens * row_bytes;  ///< one stage of K (or of V)
  static constexpr int bytes = stage_offset + 2 * Stages * stage_bytes;
};

/// The sm_90 split kernel: thread 0 streams the split's K and V rows (pages, then the tail) into
/// `Stages` shared-memory buffers with bulk copies completing on mbarriers, `Stages` stages ahead
/// of the CTA. Per stage, each warp scores its share of the tokens on tensor cores
/// (`mma_scorer`), then the CTA folds the logits and V rows into its online-softmax state.
/// Dense rows only (the stages are token-granular).
/// Grid: (splits capacity, num_kv_heads); dynamic shared memory: bulk_decode_layout::bytes.
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll, int StageTokens, int Stages,
          int MaxPagesPerSplit>
__global__ void __launch_bounds__(Threads) decode_partial_bulk_kernel(const split_params<dense_decode_params> p) {
  static_assert(std::is_same<Format, format::dense>::value, "the bulk-copy pipeline stages dense rows");
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  using layout = bulk_decode_layout<T, HeadDim, Group, StageTokens, Stages, MaxPagesPerSplit>;
  constexpr int warps = Threads / 32;
  using scorer_type = mma_scorer<T, HeadDim, Group, StageTokens / warps>;
  using temp_storage = decode_temp_storage<Group, HeadDim, collective::rows>;
  static_assert(sizeof(temp_storage) <= 2 * Stages * layout::stage_bytes, "the reduction reuses the stage buffers");
  constexpr int lanes_per_row = collective::lanes_per_row;
  extern __shared__ __align__(128) std::byte shared[];
  auto* ids = reinterpret_cast<std::int32_t*>(shared);
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  auto* logits = reinterpret_cast<float*>(shared + layout::logits_offset);
  std::byte* k_stages = shared + layout::stage_offset;
  std::byte* v_stages = k_stages + Stages * layout::stage_bytes;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  detail_decode::stage_split_pages(p, w, range, head, Threads, Stages, ids, full);
  __syncthreads();

  const int page_tokens = num_pages * p.page_size;
  const detail_decode::dense_run run = w.with_tail ? detail_decode::dense_rows_of(p, w.batch_index) : detail_decode::dense_run{0, 0};
  const int tokens = page_tokens + run.rows;
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  float* const split_logits = detail_decode::split_logits(p, w, head, range, Group);
  const std::byte* tail_slot =
      w.with_tail ? p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                        static_cast<std::size_t>(run.first) * layout::row_bytes
                  : nullptr;
  // Thread 0: announce and issue the copies of one stage, one per contiguous run of rows.
  const auto issue = [&](int stage) {
    const int buffer = stage % Stages;
    const int first = stage * StageTokens;
    const int n = min(StageTokens, tokens - first);
    detail::barrier_arrive_expect(&full[buffer], static_cast<std::uint32_t>(2 * n * layout::row_bytes));
    for (int t = first; t < first + n;) {
      const std::byte *k, *v;
      int run;
      if (t < page_tokens) {
        const int row = t % p.page_size;
        run = min(p.page_size - row, first + n - t);
        const std::byte* slot = p.pages + static_cast<std::size_t>(ids[t / p.page_size]) * p.page_slot_bytes;
        k = slot + head * p.k_page_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
        v = slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
      } else {
        const int row = t - page_tokens;
        run = first + n - t;
        k = tail_slot + head * p.tail_head_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
        v = tail_slot + (p.num_kv_heads + head) * p.tail_head_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
      }
      const int offset = (buffer * StageTokens + (t - first)) * layout::row_bytes;
      detail::bulk_copy_to_shared(k_stages + offset, k, static_cast<std::uint32_t>(run * layout::row_bytes), &full[buffer]);
      detail::bulk_copy_to_shared(v_stages + offset, v, static_cast<std::uint32_t>(run * layout::row_bytes), &full[buffer]);
      t += run;
    }
  };
  if (tid == 0)
    for (int stage = 0; stage < min(Stages, num_stages); ++stage) issue(stage);

  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);
  scorer_type scorer;
  scorer.load_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                      p.softmax_scale);
  const int warp = tid / 32;
  for (int stage = 0; stage < num_stages; ++stage) {
    const int buffer = stage % Stages;
    const int n = min(StageTokens, tokens - stage * StageTokens);
    detail::barrier_wait(&full[buffer], static_cast<std::uint32_t>((stage / Stages) & 1));
    scorer.score(k_stages + buffer * layout::stage_bytes, warp * (StageTokens / warps), logits, StageTokens);
    __syncthreads();  // the stage's logits are complete
    if (p.token_masks != nullptr) {  // a token-granular selection: rows it did not pick get -inf
      const int first = stage * StageTokens;
      for (int index = tid; index < Group * n; index += Threads) {
        const int t = first + index % n;
        if (t >= page_tokens) continue;
        const std::uint32_t* rows_read =
            detail_decode::page_rows_read(p, w.batch_index, head, range.begin + t / p.page_size);
        const int row = t % p.page_size;
        if (((rows_read[row >> 5] >> (row & 31)) & 1u) == 0) logits[(index / n) * StageTokens + index % n] = -HUGE_VALF;
      }
      __syncthreads();
    }
    if (split_logits != nullptr) {  // a step with token scores: the stage's logits, [token][head]
      const int first = stage * StageTokens;
      for (int index = tid; index < Group * n; index += Threads)
        split_logits[static_cast<std::size_t>(first + index / Group) * Group + index % Group] =
            logits[(index % Group) * StageTokens + index / Group];
    }
    collective::template fold_scored<from_shared>(logits, StageTokens, v_stages + buffer * layout::stage_bytes, n, s);
    __syncthreads();  // every thread is done with this buffer (and the logits) before refills
    if (tid == 0 && stage + Stages < num_stages) issue(stage + Stages);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(p, work_index, head, s,
                                                                       *reinterpret_cast<temp_storage*>(k_stages));
}

/// Dynamic shared memory of the TMA split kernel: page ids, barriers, then `Stages` K tiles and
/// `Stages` V tiles of `StageTokens` rows, each a column of 64-channel swizzled blocks, 1024-byte
/// aligned. The reduction at the end reuses the tiles.
template <class T, int HeadDim, int StageTokens, int Stages, int MaxPagesPerSplit>
struct tma_decode_layout {
  static constexpr int ids_bytes = (MaxPagesPerSplit * 4 + 1023) / 1024 * 1024;
  static constexpr int barrier_offset = ids_bytes;
  static constexpr int query_offset = ids_bytes + 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int tile_offset = (query_offset + query_bytes + 1023) / 1024 * 1024;
  static constexpr int tile_bytes = StageTokens * HeadDim * static_cast<int>(sizeof(T));
  static constexpr int bytes = tile_offset + 2 * Stages * tile_bytes + 1024;  ///< + slack to align the base
};

/// The sm_90 tensor-core split kernel: thread 0 issues 2D TMA copies of the split's K and V rows
/// (128-byte swizzled) `Stages` stages ahead, completing on mbarriers; each of the 4 warps runs
/// q.k and p.v on tensor cores over its 16 tokens of every 64-token stage (`warp_attend_mma`);
/// the warps' states merge at the end. Needs page_size dividing or
/// divided by the stage (the engine checks). Grid: (splits capacity, num_kv_heads).
template <class T, int HeadDim, int Group, int StageTokens, int Stages, int MaxPagesPerSplit>
__global__ void __launch_bounds__(128) decode_partial_tma_kernel(const __grid_constant__ split_params<dense_decode_params> p) {
  constexpr int threads = 128, warps = 4;
  static_assert(StageTokens == warps * 16, "each warp takes 16 tokens of a stage");
  using layout = tma_decode_layout<T, HeadDim, StageTokens, Stages, MaxPagesPerSplit>;
  using attend = warp_attend_mma<T, HeadDim, Group, StageTokens>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  static_assert(sizeof(temp_storage) <= 2 * Stages * layout::tile_bytes, "the reduction reuses the tiles");
  extern __shared__ __align__(1024) std::byte raw_shared[];
  // The swizzle pattern is a function of the address: align the base to 1024 bytes.
  std::byte* shared = reinterpret_cast<std::byte*>(
      (reinterpret_cast<std::uintptr_t>(raw_shared) + 1023) & ~static_cast<std::uintptr_t>(1023));
  auto* ids = reinterpret_cast<std::int32_t*>(shared);
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  std::byte* k_tiles = shared + layout::tile_offset;
  std::byte* v_tiles = k_tiles + Stages * layout::tile_bytes;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");

  const int work_index = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {  // before the wait: the maps do not depend on the kernel before this one
    detail::tma_prefetch_map(&p.format.page_rows);
    detail::tma_prefetch_map(&p.format.tail_rows);
  }
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  detail_decode::stage_split_pages(p, w, range, head, threads, Stages, ids, full);
  __syncthreads();

  const int page_size = p.page_size;
  const int box_rows = min(page_size, StageTokens);
  const int page_tokens = num_pages * page_size;
  const detail_decode::dense_run run = w.with_tail ? detail_decode::dense_rows_of(p, w.batch_index) : detail_decode::dense_run{0, 0};
  const int tokens = page_tokens + run.rows;
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  const int tail_slot = w.with_tail ? p.tail_slots[w.batch_index] : 0;
  const int tail_head_rows = static_cast<int>(p.tail_head_bytes / (HeadDim * static_cast<int>(sizeof(T))));
  // Thread 0: one stage = whole boxes of rows (a page segment or the tail), K and V, every
  // 64-channel block.
  const auto issue = [&](int stage) {
    const int buffer = stage % Stages;
    const int first = stage * StageTokens;
    const int n = min(StageTokens, tokens - first);
    const int boxes = (n + box_rows - 1) / box_rows;
    detail::barrier_arrive_expect(&full[buffer],
                                  static_cast<std::uint32_t>(boxes * box_rows * 128 * (HeadDim / 64) * 2));
    for (int box = 0; box < boxes; ++box) {
      const int t = first + box * box_rows;
      const CUtensorMap* map;
      int row_k, row_v;
      if (t < page_tokens) {
        const int page = ids[t / page_size];
        const int row = t % page_size;
        map = &p.format.page_rows;
        row_k = ((page * 2 + 0) * p.num_kv_heads + head) * page_size + row;
        row_v = ((page * 2 + 1) * p.num_kv_heads + head) * page_size + row;
      } else {
        const int row = run.first + t - page_tokens;
        map = &p.format.tail_rows;
        row_k = ((tail_slot * 2 + 0) * p.num_kv_heads + head) * tail_head_rows + row;
        row_v = ((tail_slot * 2 + 1) * p.num_kv_heads + head) * tail_head_rows + row;
      }
#pragma unroll
      for (int block = 0; block < HeadDim / 64; ++block) {
        const int offset = buffer * layout::tile_bytes + block * StageTokens * 128 + box * box_rows * 128;
        detail::tma_load_2d(k_tiles + offset, map, block * 64, row_k, &full[buffer]);
        detail::tma_load_2d(v_tiles + offset, map, block * 64, row_v, &full[buffer]);
      }
    }
  };
  if (tid == 0)
    for (int stage = 0; stage < min(Stages, num_stages); ++stage) issue(stage);
  // The queries are staged while the first copies are in flight.
  attend::stage_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                        p.softmax_scale, query_tiles, threads);
  __syncthreads();

  const int warp = tid / 32;
  attend state;
  state.start();
  float* const split_logits = detail_decode::split_logits(p, w, head, range, Group);
  for (int stage = 0; stage < num_stages; ++stage) {
    const int buffer = stage % Stages;
    const int n = min(StageTokens, tokens - stage * StageTokens);
    detail::barrier_wait(&full[buffer], static_cast<std::uint32_t>((stage / Stages) & 1));
    // A warp whose 16 rows start past the stage's last token skips it: no box wrote those rows,
    // and stale shared memory could hold non-finite bits that p = 0 would not cancel (0 x NaN).
    // So does a warp none of whose rows a token-granular selection picked.
    const int row0 = stage * StageTokens + warp * 16;
    const std::uint32_t rows_read =
        row0 < page_tokens ? detail_decode::sixteen_rows_read(
                                 detail_decode::page_rows_read(p, w.batch_index, head, range.begin + row0 / page_size),
                                 row0 % page_size)
                           : 0xffffu;
    const std::uint32_t covered = attend::rows_before(warp * 16, n);
    const std::uint32_t rows = rows_read & covered;
    float* const warp_logits =
        split_logits != nullptr ? split_logits + static_cast<std::size_t>(row0) * Group : nullptr;
    if (rows != 0)
      state.fold(k_tiles + buffer * layout::tile_bytes, v_tiles + buffer * layout::tile_bytes, query_tiles, warp * 16, rows,
                 warp_logits, covered);
    else if (warp_logits != nullptr)
      attend::write_masked_logits(warp_logits, covered);
    __syncthreads();  // every warp is done with this buffer before it is refilled
    if (tid == 0 && stage + Stages < num_stages) issue(stage + Stages);
  }

  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(k_tiles));
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/dense/decode.cuh> ----

namespace kvmosaic::cuda {

template <>
struct device_format<format::dense> {
  static constexpr bool encodes_pages = false;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  static constexpr std::int32_t split_page_multiple = 1;
  static constexpr bool writes_token_logits = true;  ///< every dense split kernel (select::tova, select::h2o)
  static constexpr bool writes_exact_logits = true;  ///< fp32 q . k (sm_90: q in two 16-bit halves)
  using params = kernel::dense_decode_params;

  struct state {
    bool tma = false;  ///< the sm_90 TMA kernel (else bulk copies on sm_90, or the portable kernel)
    int stages = 0;    ///< no run-time stages: the TMA stages are tuning (decode_tuning::tma_stages)
    params maps{};
  };

  static void validate(const format::dense&, const kvmosaic::detail::engine_shape&) {}

  /// The TMA kernel needs page sizes that divide or are multiples of its 64-token box, and row
  /// indices of both arenas below 2^31.
  template <class Shapes>
  static void configure(state& s, const format::dense&, device_context& e) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const std::int64_t tail_head_rows = static_cast<std::int64_t>(e.geometry->tail_head_bytes / e.geometry->row_bytes);
    const std::int64_t arena_rows = std::max<std::int64_t>(static_cast<std::int64_t>(shape.max_pages) * shape.page_size,
                                                           static_cast<std::int64_t>(shape.max_sequences) * tail_head_rows) *
                                    2 * shape.num_kv_heads;
    s.tma = e.bulk_copy && (shape.page_size % 64 == 0 || 64 % shape.page_size == 0) && arena_rows < (std::int64_t{1} << 31);
    if (s.tma) {
      s.maps.page_rows = row_map(e, e.pages, static_cast<std::uint64_t>(shape.max_pages) * 2 * shape.num_kv_heads * shape.page_size);
      s.maps.tail_rows = row_map(e, e.tails, static_cast<std::uint64_t>(shape.max_sequences) * 2 * shape.num_kv_heads * tail_head_rows);
    }
  }

  template <class Shapes, bool /*Logits: its kernels branch on the step at run time*/ = false, class F>
  static void with_decode_kernel(const state& s, const format::dense&, const device_context& e, bool /*row_masks*/, F&& f) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
      if (s.tma) {
        constexpr int stage_tokens = 64, stages = t.tma_stages;
        using layout = kernel::tma_decode_layout<T, head_dim, stage_tokens, stages, t.max_pages_per_split>;
        f(kernel::decode_partial_tma_kernel<T, head_dim, group_size, stage_tokens, stages, t.max_pages_per_split>, 128,
          layout::bytes);
      } else if (e.bulk_copy) {
        using layout = kernel::bulk_decode_layout<T, head_dim, group_size, t.stage_tokens, t.stages, t.max_pages_per_split>;
        f(kernel::decode_partial_bulk_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll, t.stage_tokens,
                                             t.stages, t.max_pages_per_split>,
          t.threads, layout::bytes);
      } else {
        f(kernel::decode_partial_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll>, t.threads, 0);
      }
    });
  }

  static params params_for(const state& s, const format::dense&, const device_context&) { return s.maps; }

  /// The sm_90 kernels keep a split's page ids in shared memory.
  static int max_pages_per_split(const state&, const decode_tuning& t) { return t.max_pages_per_split; }

  /// The TMA kernel multiplies p.v on tensor cores, p split into two 16-bit halves.
  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.tma; }

 private:
  /// A 2D tensor map over `rows` rows of head_dim 16-bit values at `base`, boxes of 64 channels x
  /// min(page_size, 64) rows, 128-byte swizzle (the layout the TMA kernel reads with ldmatrix).
  static CUtensorMap row_map(const device_context& e, void* base, std::uint64_t rows) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    cudaDriverEntryPointQueryResult status{};
    KVMOSAIC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                                         12000, cudaEnableDefault, &status));
    kvmosaic::detail::require(status == cudaDriverEntryPointSuccess && encode != nullptr, "cuda::engine",
                              "cuTensorMapEncodeTiled", "missing", "a driver with TMA (CUDA 12+)");
    CUtensorMap map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(shape.head_dim), rows};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(shape.head_dim) * 2};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(std::min(shape.page_size, 64))};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result =
        encode(&map, shape.storage == dtype::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
               base, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    kvmosaic::detail::require(result == CUDA_SUCCESS, "cuda::engine", "cuTensorMapEncodeTiled result",
                              static_cast<int>(result), "CUDA_SUCCESS");
    return map;
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/dense/device.cuh> ----

// ---- begin <kvmosaic/cuda/format/bitmap_tiles/device.cuh> ----
/// \file
/// format::bitmap_tiles (MUSTAFAR) on the device (cuda/format/device_format.cuh says what a device
/// part provides): completed pages are pruned and packed by `encode_bitmap_pages_kernel` (bytes
/// equal to the host encoder's); decode runs the sm_90 kernel that bulk-copies compressed pages
/// into shared-memory stages and lets each warp gather its tensor-core fragments straight from
/// them (`decode_partial_bitmap_kernel`), or the portable kernel that expands a page into dense
/// tiles before sm_90 and for pages too large for one stage.



// ---- begin <kvmosaic/cuda/format/bitmap_tiles/decode.cuh> ----
/// \file
/// Decode split kernels for `format::bitmap_tiles` pages: MUSTAFAR's load-as-compressed,
/// compute-as-dense pipeline (appendix C). The compressed K and V pages of a split travel to the
/// SM as they are stored. On sm_90 each warp gathers its tokens' rows from the compressed page
/// straight into tensor-core fragments (`bitmap_page_rows`, `warp_attend_mma::fold_chunks`); the
/// portable kernel expands each 64-token segment into a dense shared tile
/// (`bitmap_segment_expand`) for the SIMT collective. No decompressed copy is ever written to
/// global memory. The partial states merge with the dense path's `merge_splits_kernel`.


// ---- begin <kvmosaic/cuda/format/bitmap_tiles/expand.cuh> ----
/// \file
/// The "extract" step of MUSTAFAR's load-as-compressed, compute-as-dense pipeline (appendix C):
/// a CTA expands one segment of tokens of a compressed `format::bitmap_tiles` page (K and V of one
/// head) into a dense tile pair in shared memory, which the dense attention collectives then
/// consume (tensor cores on sm_90, SIMT elsewhere). The compressed page may sit in shared memory
/// (staged by bulk copies) or in global memory (the portable kernel reads it in place).
///
/// Cost per segment: row tiles (a token's 64 channels of V, and of K when K is tiled along
/// channels) are gathered one 16-byte dense chunk per thread: per dense element a predicated
/// 16-bit load, whatever the sparsity, and one 16-byte store per 8 elements; the dense rows are
/// written whole. K in the paper's layout (a channel's tokens per tile) is scattered down columns:
/// per kept value a bit scan, a 16-bit load and a 16-bit store, into a K tile the kernels clear
/// between segments.



namespace kvmosaic::cuda {

namespace detail {
__device__ __forceinline__ void store_shared_u16(std::uint32_t address, std::uint16_t value) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(address), "h"(value) : "memory");
}
__device__ __forceinline__ std::uint16_t load_shared_u16(std::uint32_t address) {
  std::uint16_t value;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(value) : "r"(address));
  return value;
}
__device__ __forceinline__ void store_shared_v4(std::uint32_t address, uint4 value) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(value.x), "r"(value.y), "r"(value.z),
               "r"(value.w)
               : "memory");
}
__device__ __forceinline__ void store_shared_zero16(std::uint32_t address) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(address), "r"(0) : "memory");
}
}  // namespace detail

/// A compressed page ([bitmaps: tiles x u64][offsets: tiles x u32][values: u16]) in shared memory,
/// read through 32-bit shared addresses.
struct shared_bitmap_page {
  std::uint32_t base;
  int tiles;
  __device__ __forceinline__ shared_bitmap_page(const std::byte* page, int tile_count)
      : base(detail::shared_address(page)), tiles(tile_count) {}
  __device__ __forceinline__ std::uint64_t bitmap(int tile) const {
    std::uint64_t bits;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(bits) : "r"(base + tile * 8));
    return bits;
  }
  __device__ __forceinline__ std::uint32_t offset(int tile) const {
    std::uint32_t offset;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(offset) : "r"(base + tiles * 8 + tile * 4));
    return offset;
  }
  /// Cursor at value `index` of the run.
  struct cursor {
    std::uint32_t address;
    __device__ __forceinline__ std::uint16_t next() {
      const std::uint16_t value = detail::load_shared_u16(address);
      address += 2;
      return value;
    }
  };
  __device__ __forceinline__ cursor values_from(std::uint32_t index) const {
    return {base + static_cast<std::uint32_t>(tiles) * 12 + index * 2};
  }
};

/// A compressed page in global memory, read in place (the portable kernel).
struct global_bitmap_page {
  const std::byte* base;
  int tiles;
  __device__ __forceinline__ std::uint64_t bitmap(int tile) const {
    return reinterpret_cast<const std::uint64_t*>(base)[tile];
  }
  __device__ __forceinline__ std::uint32_t offset(int tile) const {
    return reinterpret_cast<const std::uint32_t*>(base + tiles * 8)[tile];
  }
  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint16_t next() { return *value++; }
  };
  __device__ __forceinline__ cursor values_from(std::uint32_t index) const {
    return {reinterpret_cast<const std::uint16_t*>(base + tiles * 12) + index};
  }
};

/// Calls f(bit) for each set bit of `bits`, lowest first (32-bit scans: cheaper than 64-bit ones).
template <class F>
__device__ __forceinline__ void for_each_set_bit(std::uint64_t bits, F&& f) {
  auto low = static_cast<std::uint32_t>(bits);
  auto high = static_cast<std::uint32_t>(bits >> 32);
  while (low != 0) {
    f(static_cast<std::uint32_t>(__ffs(static_cast<int>(low)) - 1));
    low &= low - 1;
  }
  while (high != 0) {
    f(static_cast<std::uint32_t>(__ffs(static_cast<int>(high)) + 31));
    high &= high - 1;
  }
}

/// Stores the values at `cursor` to tile_base + address.at(bit) for each set bit of `bits`, in
/// order. (The variants tried and their cost: benchmark/README.md, "Decisions the code cites".)
template <class Cursor, class Address>
__device__ __forceinline__ void scatter_set_bits(std::uint64_t bits, Cursor& cursor, const Address& address,
                                                 std::uint32_t tile_base) {
  for_each_set_bit(bits, [&](std::uint32_t bit) { detail::store_shared_u16(tile_base + address.at(bit), cursor.next()); });
}

/// Gathers the 8 dense values of channels [8 c, 8 c + 8) of a 1x64 row tile (one 16-byte chunk of
/// a dense row): value j is the tile's next kept value where bit 8 c + j of its bitmap is set, else
/// 0. A thread is bound to one chunk position c, so the masks of the bits before its chunk are
/// computed once. Cost per chunk: two broadcast loads (bitmap, offset), two popcounts and
/// `load_chunk_values`.
class row_chunk_gather {
 public:
  __device__ __forceinline__ explicit row_chunk_gather(int chunk)
      : below_low_(chunk >= 4 ? ~0u : (1u << (8 * chunk)) - 1u),
        below_high_(chunk >= 4 ? (1u << (8 * (chunk - 4))) - 1u : 0u),
        shift_(static_cast<std::uint32_t>(8 * (chunk % 4))),
        upper_(chunk >= 4) {}

  template <class Page>
  __device__ __forceinline__ uint4 operator()(const Page& page, int tile) const {
    const std::uint64_t bits = page.bitmap(tile);
    const auto low = static_cast<std::uint32_t>(bits), high = static_cast<std::uint32_t>(bits >> 32);
    const auto before = static_cast<std::uint32_t>(__popc(low & below_low_) + __popc(high & below_high_));
    const std::uint32_t mask = ((upper_ ? high : low) >> shift_) & 0xffu;
    std::uint32_t v[8];
    load_chunk_values(mask, page.values_from(page.offset(tile) + before), v);
    return pack_pairs(v);
  }

 private:
  std::uint32_t below_low_, below_high_, shift_;
  bool upper_;
};

/// One head's compressed rows (V, or K tiled along channels) of a page, from token `first` on, as
/// a row source of `warp_attend_mma::fold_chunks`: chunk c of row t is gathered from tile
/// (first + t) * D / 64 + c / 8. Cost per chunk: a bitmap and an offset load (per two chunks for
/// `pairs`), two popcounts and `load_chunk_values`.
template <class Page, int HeadDim>
struct bitmap_page_rows {
  Page page;
  int first;

  __device__ __forceinline__ void values(int token, int chunk, std::uint32_t (&v)[8]) const {
    const int tile = (first + token) * (HeadDim / 64) + chunk / 8;
    const std::uint64_t bits = page.bitmap(tile);
    const int shift = 8 * (chunk % 8);
    const auto before = static_cast<std::uint32_t>(__popcll(bits & ((std::uint64_t{1} << shift) - 1u)));
    const auto mask = static_cast<std::uint32_t>(bits >> shift) & 0xffu;
    load_chunk_values(mask, page.values_from(page.offset(tile) + before), v);
  }
  /// Chunks `chunk` and `chunk + 1` (chunk even) of a row: one bitmap and offset load for both.
  __device__ __forceinline__ void pairs(int token, int chunk, uint4 (&x)[2]) const {
    const int tile = (first + token) * (HeadDim / 64) + chunk / 8;
    const std::uint64_t bits = page.bitmap(tile);
    const int shift = 8 * (chunk % 8);
    const auto before = static_cast<std::uint32_t>(__popcll(bits & ((std::uint64_t{1} << shift) - 1u)));
    const auto mask = static_cast<std::uint32_t>(bits >> shift) & 0xffffu;
    const std::uint32_t start = page.offset(tile) + before;
    std::uint32_t v[8];
    load_chunk_values(mask & 0xffu, page.values_from(start), v);
    x[0] = pack_pairs(v);
    load_chunk_values(mask >> 8, page.values_from(start + static_cast<std::uint32_t>(__popc(mask & 0xffu))), v);
    x[1] = pack_pairs(v);
  }
};

/// Expands tokens [first, first + SegmentTokens) of one head's compressed K page and V page into
/// dense tiles (layout `Tile`, SegmentTokens rows). `first` is a multiple of SegmentTokens, which
/// is 64 or 32, so a segment never straddles a K tile.
template <int HeadDim, int SegmentTokens, int Threads, class Tile>
struct bitmap_segment_expand {
  static_assert(SegmentTokens == 64 || SegmentTokens == 32, "segments are whole or half 1x64 tiles");
  static_assert(Threads % 8 == 0, "a thread gathers the same 16-byte chunk position of every row tile");
  static constexpr int tile_bytes = SegmentTokens * HeadDim * 2;  ///< one dense tile (K or V)
  static constexpr int v_tiles_per_token = HeadDim / 64;

  /// Zeroes one dense tile. Every thread of the CTA calls it.
  __device__ __forceinline__ static void zero_tile(std::byte* tile) {
    const std::uint32_t base = detail::shared_address(tile);
    for (int i = static_cast<int>(threadIdx.x); i < tile_bytes / 16; i += Threads)
      detail::store_shared_zero16(base + i * 16);
  }

  /// Zeroes rows [first, first + rows) of a swizzled tile (whole 128-byte rows per 64-channel
  /// block). A warp calls it for the rows only it reads.
  __device__ __forceinline__ static void zero_rows_of_warp(std::byte* tile, int first, int rows) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    constexpr int blocks = HeadDim / 64;
    const int chunks = rows * 8;  // 16-byte chunks per block
    for (int i = lane; i < blocks * chunks; i += 32) {
      const int block = i / chunks, chunk = i % chunks;
      detail::store_shared_zero16(detail::shared_address(tile) + block * SegmentTokens * 128 + first * 128 + chunk * 16);
    }
  }

  /// Writes the segment's K and V into the tiles `k_tile`, `v_tile`. Row tiles (a token's 64
  /// channels: V always, K when tiled along channels, `k_along_tokens` false) are gathered chunk by
  /// chunk (`row_chunk_gather`): every element of their dense rows is written, zeros included, so
  /// they need no clearing. K in the paper's layout (`k_along_tokens`: tile c * tiles_per_channel +
  /// first / 64 holds channel c's tokens) is scattered down each channel's column, one work item
  /// per channel, into a K tile the caller keeps zero where nothing is kept. Every thread calls it.
  /// (The scatter variants the gather replaced: benchmark/README.md, "Decisions the code cites".)
  template <class Page>
  __device__ __forceinline__ static void expand(const Page& k_page, const Page& v_page, int page_size, int first,
                                                bool k_along_tokens, std::byte* k_tile, std::byte* v_tile) {
    const std::uint32_t k_base = detail::shared_address(k_tile), v_base = detail::shared_address(v_tile);
    if (k_along_tokens)
      scatter_columns(k_page, page_size, first, k_tile);
    else
      gather_rows(k_page, first, k_base);
    gather_rows(v_page, first, v_base);
  }

  /// K in the paper's layout (tile c * page_size / 64 + first / 64 holds channel c's tokens): the
  /// segment's kept values scattered down each channel's column of `k_tile`, one work item per
  /// channel; the caller keeps the tile zero where nothing is kept. Every thread calls it.
  template <class Page>
  __device__ __forceinline__ static void scatter_columns(const Page& k_page, int page_size, int first,
                                                         std::byte* k_tile) {
    const std::uint32_t k_base = detail::shared_address(k_tile);
    for (int channel = static_cast<int>(threadIdx.x); channel < HeadDim; channel += Threads) {
      const int k_part = first / 64, shift = first % 64;
      const int tile = channel * (page_size / 64) + k_part;
      const std::uint64_t all = k_page.bitmap(tile);
      std::uint64_t bits = all >> shift;
      if constexpr (SegmentTokens < 64) bits &= (std::uint64_t{1} << (SegmentTokens % 64)) - 1;
      // Values of the tile's tokens before the segment precede it in the run.
      const std::uint32_t skipped = shift == 0 ? 0u : __popcll(all & ((std::uint64_t{1} << shift) - 1));
      auto value = k_page.values_from(k_page.offset(tile) + skipped);
      scatter_set_bits(bits, value, Tile::column(channel), k_base);
    }
  }

 private:
  /// Row tiles of the segment into the dense tile at `tile_base`, one 16-byte chunk per thread
  /// per pass: thread x gathers chunk x mod 8 of row tile pass * (Threads / 8) + x / 8, so the 8
  /// lanes of a row tile share its bitmap and offset loads, a warp reads 4 consecutive value
  /// runs, and a thread's 64-channel block and swizzle key are the same in every pass.
  template <class Page>
  __device__ __forceinline__ static void gather_rows(const Page& page, int first, std::uint32_t tile_base) {
    constexpr int rows_per_pass = Threads / 8;
    constexpr int tokens_per_pass = rows_per_pass / v_tiles_per_token;
    static_assert(rows_per_pass % v_tiles_per_token == 0 && SegmentTokens % tokens_per_pass == 0,
                  "whole tokens per pass, whole passes per segment");
    const int thread = static_cast<int>(threadIdx.x);
    const int chunk = thread % 8, block = (thread / 8) % v_tiles_per_token;
    const int token_in_pass = (thread / 8) / v_tiles_per_token;
    const row_chunk_gather gather(chunk);
    const int first_tile = first * v_tiles_per_token + thread / 8;
#pragma unroll
    for (int pass = 0; pass < SegmentTokens / tokens_per_pass; ++pass) {
      const int token = pass * tokens_per_pass + token_in_pass;
      detail::store_shared_v4(tile_base + Tile::chunk(token, block * 8 + chunk),
                              gather(page, first_tile + pass * rows_per_pass));
    }
  }

 public:
  /// Copies rows [0, n) of dense K and V rows (global memory, head_dim 16-bit values each) into
  /// the tiles and zeroes rows [n, SegmentTokens): the dense tail's segments. Every thread calls it.
  __device__ __forceinline__ static void load_dense(const std::byte* k_rows, const std::byte* v_rows, int n,
                                                    std::byte* k_tile, std::byte* v_tile) {
    constexpr int chunks_per_row = HeadDim / 8;
    for (int i = static_cast<int>(threadIdx.x); i < 2 * SegmentTokens * chunks_per_row; i += Threads) {
      const int is_v = i / (SegmentTokens * chunks_per_row);
      const int rest = i % (SegmentTokens * chunks_per_row);
      const int token = rest / chunks_per_row, chunk = rest % chunks_per_row;
      const std::byte* source = (is_v ? v_rows : k_rows) + (static_cast<std::size_t>(token) * HeadDim + chunk * 8) * 2;
      const uint4 x = token < n ? *reinterpret_cast<const uint4*>(source) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>((is_v ? v_tile : k_tile) + Tile::chunk(token, chunk)) = x;
    }
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/bitmap_tiles/expand.cuh> ----

namespace kvmosaic::cuda::kernel {

/// bitmap_tiles' fields of its split kernels' params.
struct bitmap_decode_params {
  int stages;          ///< sm_90 kernel: compressed page pairs in flight per CTA
  int k_along_tokens;  ///< K tiles are one channel x 64 tokens (1) or per token as V (0)
};

/// Dynamic shared memory of the sm_90 bitmap kernel: barriers, the query tiles, a dense K tile
/// (only with K in the paper's layout, which is scattered), then `stages` compressed page pairs,
/// which the CTA's final reduction reuses (the region is at least its size). One formula for the
/// kernel (`bitmap_decode_layout`) and for the host's choice of stages.
constexpr int bitmap_decode_shared_bytes(int head_dim, int group, int stage_bytes, int stages, bool k_along_tokens) {
  const int query_end = 128 + 2 * 8 * (head_dim * 2 + 16);
  const int k_tile = (query_end + 1023) / 1024 * 1024;
  const int compressed = k_tile + (k_along_tokens ? 64 * head_dim * 2 : 0);
  const int reduction = 4 * group * head_dim * 4 + 2 * 4 * group * 4;  // decode_temp_storage<group, head_dim, 4>
  return compressed + (stages * stage_bytes > reduction ? stages * stage_bytes : reduction) + 1024;
}

/// CTAs per SM the sm_90 bitmap kernel's registers are bounded for (`__launch_bounds__`).
constexpr int bitmap_decode_min_ctas(int head_dim, int group) {
  return head_dim == 128 && group <= 4 ? 5 : 0;
}

/// Where the sm_90 bitmap kernel's shared memory goes (`bitmap_decode_shared_bytes`).
template <int HeadDim, int Group>
struct bitmap_decode_layout {
  static constexpr int segment_tokens = 64;
  static constexpr int max_stages = 4;
  static constexpr int barrier_offset = 0;  ///< `max_stages` mbarriers: a slot's pages have landed
  static constexpr int empty_offset = 64;   ///< `max_stages` mbarriers: the 4 warps are done with a slot
  static constexpr int query_offset = 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int k_tile_offset = (query_offset + query_bytes + 1023) / 1024 * 1024;
  static constexpr int tile_bytes = segment_tokens * HeadDim * 2;  ///< the dense K tile
  __host__ __device__ static constexpr int compressed_offset(bool k_along_tokens) {
    return k_tile_offset + (k_along_tokens ? tile_bytes : 0);
  }
  static_assert(sizeof(decode_temp_storage<Group, HeadDim, 4>) ==
                    static_cast<std::size_t>(bitmap_decode_shared_bytes(HeadDim, Group, 0, 0, false) -
                                             compressed_offset(false) - 1024),
                "one formula for the reduction's storage");
};

/// The sm_90 bitmap_tiles split kernel. Thread 0 streams the split's compressed K and V pages into
/// `p.format.stages` shared-memory slots with bulk copies (one per page and cache, completing on an
/// mbarrier). Each of the 4 warps folds its 16 tokens of every 64-token segment straight from the
/// compressed slot: its lanes gather the 16-byte row chunks their MMA fragments hold
/// (`bitmap_page_rows`, `warp_attend_mma::fold_chunks`), so no dense tile is written or read and
/// no barrier separates the warps within a page; one CTA barrier per page frees its slot for the
/// page `stages` ahead. K in the paper's layout (columns) is first scattered by the CTA into a
/// zeroed dense K tile (two barriers per segment), which the warps read as rows. The dense tail is
/// read as rows from global memory. `RowMasks`: whether a token-granular selection's row masks are
/// read; `Logits`: whether a step with token scores writes each row's logits
/// (`decode_params::token_logits`; without, the kernel has no store). Grid: (splits capacity,
/// num_kv_heads).
/// Why no dense tile: gathering each segment into dense K and V tiles first costs 32 KB of shared
/// stores and loads per segment, and shared-memory bandwidth bounded that kernel
/// (benchmark/README.md, "Decisions the code cites").
template <class T, int HeadDim, int Group, bool RowMasks = false, bool Logits = false>
__global__ void __launch_bounds__(128, bitmap_decode_min_ctas(HeadDim, Group))
    decode_partial_bitmap_kernel(const __grid_constant__ split_params<bitmap_decode_params> p) {
  constexpr int threads = 128, warps = 4;
  using layout = bitmap_decode_layout<HeadDim, Group>;
  constexpr int segment = layout::segment_tokens;
  using expand = bitmap_segment_expand<HeadDim, segment, threads, swizzled_tile<segment>>;
  using attend = warp_attend_mma<T, HeadDim, Group, segment, operand_path::row_chunks>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  using page_rows = bitmap_page_rows<shared_bitmap_page, HeadDim>;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");
  extern __shared__ __align__(1024) std::byte bitmap_raw_shared[];
  std::byte* shared = reinterpret_cast<std::byte*>(
      (reinterpret_cast<std::uintptr_t>(bitmap_raw_shared) + 1023) & ~static_cast<std::uintptr_t>(1023));
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  auto* empty = reinterpret_cast<std::uint64_t*>(shared + layout::empty_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  std::byte* k_tile = shared + layout::k_tile_offset;  // only with p.format.k_along_tokens
  const bool k_along_tokens = p.format.k_along_tokens != 0;
  std::byte* compressed = shared + layout::compressed_offset(k_along_tokens);

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const detail_decode::split_pages range =
      RowMasks ? detail_decode::pages_of_split(p, w, head) : detail_decode::split_pages{w.page_begin, w.page_end};
  const int num_pages = range.end - range.begin;
  const int stages = p.format.stages;
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int stage_bytes = k_bytes + v_bytes;
  const int tiles = p.page_size * HeadDim / 64;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  if (tid == 0)
    for (int b = 0; b < stages; ++b) {
      detail::barrier_init(&full[b], 1);
      detail::barrier_init(&empty[b], warps);
    }
  // Thread 0: the compressed K and V pages of split page i into slot i % stages (page ids are
  // read from the block table in global memory: one L2 hit per page, `stages` pages ahead).
  const auto issue = [&](int i) {
    const int slot = i % stages;
    const std::byte* page = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
    detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(stage_bytes));
    std::byte* destination = compressed + slot * stage_bytes;
    detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
    detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                static_cast<std::uint32_t>(v_bytes), &full[slot]);
  };
  __syncthreads();  // the barriers are initialized
  if (tid == 0)
    for (int i = 0; i < min(stages, num_pages); ++i) issue(i);
  if (k_along_tokens) expand::zero_tile(k_tile);  // scattered into
  attend::stage_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                        p.softmax_scale, query_tiles, threads);
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32;
  const int rows_first = warp * 16;  // the warp's rows of every segment
  attend state;
  state.start();
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;
  // The warp's 16 rows of segment `first` of split page i: their logits, or -inf where it folds none.
  const auto fold_rows = [&](const auto& k_rows, const auto& v_rows, int i, int first, std::uint32_t rows) {
    float* const warp_logits =
        Logits && split_logits != nullptr
            ? split_logits + (static_cast<std::size_t>(i) * p.page_size + first + rows_first) * Group
            : nullptr;
    if (rows != 0)
      state.fold_chunks(k_rows, v_rows, query_tiles, rows_first, rows, warp_logits, 0xffffu);
    else if (warp_logits != nullptr)
      attend::write_masked_logits(warp_logits, 0xffffu);
  };
  for (int i = 0; i < num_pages; ++i) {
    const int slot = i % stages;
    detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((i / stages) & 1));
    const shared_bitmap_page k_page(compressed + slot * stage_bytes, tiles);
    const shared_bitmap_page v_page(compressed + slot * stage_bytes + k_bytes, tiles);
    const std::uint32_t* rows_read = RowMasks ? detail_decode::page_rows_read(p, w.batch_index, head, range.begin + i) : nullptr;
    if (!k_along_tokens) {
      for (int first = 0; first < p.page_size; first += segment) {
        const std::uint32_t rows =
            RowMasks ? detail_decode::sixteen_rows_read(rows_read, first + rows_first) : 0xffffu;
        fold_rows(page_rows{k_page, first}, page_rows{v_page, first}, i, first, rows);
      }
      // Each warp releases the slot; thread 0 refills it once all four have, while warps 1-3 go on.
      __syncwarp();
      if (lane == 0) detail::barrier_arrive(&empty[slot]);
      if (tid == 0 && i + stages < num_pages) {
        detail::barrier_wait(&empty[slot], static_cast<std::uint32_t>((i / stages) & 1));
        issue(i + stages);
      }
    } else {
      for (int first = 0; first < p.page_size; first += segment) {
        const std::uint32_t rows =
            RowMasks ? detail_decode::sixteen_rows_read(rows_read, first + rows_first) : 0xffffu;
        expand::scatter_columns(k_page, p.page_size, first, k_tile);
        __syncthreads();  // the K tile is complete
        fold_rows(swizzled_tile_rows<segment>{detail::shared_address(k_tile)}, page_rows{v_page, first}, i, first, rows);
        __syncwarp();  // every lane's reads of these rows are done
        expand::zero_rows_of_warp(k_tile, rows_first, 16);
        __syncthreads();  // the K tile is zero again (and, after the last segment, the slot is read)
      }
      if (tid == 0 && i + stages < num_pages) issue(i + stages);
    }
  }
  __syncthreads();  // every warp is done with the slots, which the reduction reuses
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    const std::byte* k_rows = slot + head * p.tail_head_bytes;
    const std::byte* v_rows = slot + (p.num_kv_heads + head) * p.tail_head_bytes;
    const int rows = run.rows;
    for (int first = 0; first < rows; first += segment) {
      // A warp whose rows all lie past the tail skips: p would be 0 for them anyway.
      const std::uint32_t warp_rows = attend::rows_before(first + rows_first, rows);
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim * 2;
      float* const warp_logits =
          Logits && split_logits != nullptr
              ? split_logits + (static_cast<std::size_t>(num_pages) * p.page_size + first + rows_first) * Group
              : nullptr;
      if (warp_rows != 0)
        state.fold_chunks(global_dense_rows<HeadDim>{k_rows + skip, rows - first},
                          global_dense_rows<HeadDim>{v_rows + skip, rows - first}, query_tiles, rows_first, warp_rows,
                          warp_logits, warp_rows);
    }
  }
  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(compressed));
}

/// Dynamic shared memory of the portable bitmap kernel: one dense K and V tile pair (plain rows)
/// of `segment_tokens`, which the CTA reduction reuses at the end.
template <int HeadDim, int Group, int Rows>
struct bitmap_portable_layout {
  static constexpr int segment_tokens = 64;
  static constexpr int tile_bytes = segment_tokens * HeadDim * 2;
  static constexpr int bytes = 2 * tile_bytes > static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>))
                                   ? 2 * tile_bytes
                                   : static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>));
};

/// The portable bitmap_tiles split kernel (sm_75+): per 64-token segment the CTA expands the
/// compressed tiles, read in place from global memory, into a row-major tile pair in shared memory
/// (`bitmap_segment_expand::expand`) and folds it with the dense SIMT collective. No copy pipeline: the reference path
/// for GPUs without bulk copies, not a tuned one.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_bitmap_portable_kernel(const split_params<bitmap_decode_params> p) {
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  using layout = bitmap_portable_layout<HeadDim, Group, collective::rows>;
  constexpr int segment = layout::segment_tokens;
  using expand = bitmap_segment_expand<HeadDim, segment, Threads, row_major_tile<HeadDim>>;
  constexpr int lanes_per_row = collective::lanes_per_row;
  extern __shared__ __align__(16) std::byte tile_shared[];
  std::byte* shared = tile_shared;
  std::byte* k_tile = shared;
  std::byte* v_tile = shared + layout::tile_bytes;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);
  const int tiles = p.page_size * HeadDim / 64;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  float* const logits = detail_decode::split_logits(p, w, head, range, Group);  // a step with token scores
  for (int i = range.begin; i < range.end; ++i) {
    const std::byte* slot = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    const global_bitmap_page k_page{slot + head * p.k_page_bytes, tiles};
    const global_bitmap_page v_page{slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes, tiles};
    for (int first = 0; first < p.page_size; first += segment) {
      if (p.format.k_along_tokens) expand::zero_tile(k_tile);  // scattered into; row tiles are written whole
      __syncthreads();
      expand::expand(k_page, v_page, p.page_size, first, p.format.k_along_tokens != 0, k_tile, v_tile);
      __syncthreads();
      collective::template fold<from_shared>(
          k_tile, v_tile, segment, s, rows_read == nullptr ? nullptr : rows_read + first / 32,
          logits != nullptr ? logits + (static_cast<std::size_t>(i - range.begin) * p.page_size + first) * Group : nullptr);
      __syncthreads();
    }
  }
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s,
                     nullptr, logits != nullptr ? logits + static_cast<std::size_t>(range.end - range.begin) * p.page_size * Group : nullptr);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(
      p, work_index, head, s, *reinterpret_cast<decode_temp_storage<Group, HeadDim, collective::rows>*>(shared));
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/bitmap_tiles/decode.cuh> ----

// ---- begin <kvmosaic/cuda/format/bitmap_tiles/encode.cuh> ----
/// \file
/// Device encode of `format::bitmap_tiles` pages (MUSTAFAR sections 2-3): per-token pruning and
/// compression of full pages of dense 16-bit rows, byte for byte what the host encoder writes
/// (tests compare the pages). One CTA encodes one page of K or of V of one KV head.
///
/// Pruning: a warp per token finds the `keep`-th largest score by a bitwise search over the
/// scores' bit patterns (non-negative floats order as their bits), keeps every score above it and
/// the lowest channels among those equal to it (the host's tie rule). Compression: each thread
/// builds the bitmaps of its run of tiles, a block scan turns their counts into tile offsets, and
/// the kept values are written in bit order; the run's padding is zeroed. (The scan is written
/// here rather than taken from CUB: CUB brings libcu++'s global `::cuda` namespace into every
/// user's translation unit, where it collides with `kvmosaic::cuda` under `using namespace`.)



namespace kvmosaic::cuda::kernel {

/// Pages to encode: dense rows in `rows` (slot i = [K: heads][V: heads] x rows_head_bytes, the
/// first page_size rows 16-bit), written compressed to page `new_pages[i]` of the page arena.
struct bitmap_encode_params {
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;  ///< = the tail arena's: page_size rows plus the exact rows
  std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  const std::int32_t* new_pages;
  int num_kv_heads;
  int page_size;
  int keep_k;  ///< values each K vector keeps
  int keep_v;  ///< values each V vector keeps
  int k_along_tokens;  ///< K tiles: 1 = one channel, 64 tokens (the paper's); 0 = as V
  /// Output-aware K scores (MUSTAFAR section 2.1): page i uses weights row weight_rows[i] of
  /// key_weights ([rows][head][head_dim]), the score of K element c being |k_c| * weight_c; a row
  /// of -1 (or null arrays) scores |k_c|.
  const float* key_weights;
  const std::int32_t* weight_rows;
};

constexpr int encode_threads = 128;

namespace detail_encode {
__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

/// Exclusive prefix sum of x over the CTA's `Threads` threads (`warp_totals`: Threads / 32 ints
/// of shared memory). Every thread calls it; it ends with a barrier.
template <int Threads>
__device__ __forceinline__ int block_exclusive_sum(int x, int* warp_totals) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int inclusive = x;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += y;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  __syncthreads();
  return before + inclusive - x;
}
}  // namespace detail_encode

/// Grid: (pages, num_kv_heads, 2: K then V); dynamic shared memory: page_size x head_dim / 8
/// bytes (the kept-element masks). T: the 16-bit storage type.
template <class T, int HeadDim>
__global__ void __launch_bounds__(encode_threads) encode_bitmap_pages_kernel(const bitmap_encode_params p) {
  static_assert(HeadDim % 64 == 0, "head_dim is whole 1x64 tiles");
  constexpr int per_lane = HeadDim / 32;  // lane l holds channels l + 32 e
  constexpr int words = HeadDim / 32;     // mask words per token
  __shared__ int warp_totals[encode_threads / 32];
  extern __shared__ std::uint32_t masks[];  // [page_size][words]

  const int ordinal = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_v = blockIdx.z == 1;
  const int page_size = p.page_size, keep = is_v ? p.keep_v : p.keep_k;
  const auto* rows = reinterpret_cast<const std::uint16_t*>(
      p.rows + ordinal * p.rows_slot_bytes + (static_cast<std::int64_t>(is_v) * p.num_kv_heads + head) * p.rows_head_bytes);
  const int weight_row = !is_v && p.weight_rows != nullptr ? p.weight_rows[ordinal] : -1;
  const float* weights =
      weight_row >= 0 ? p.key_weights + (static_cast<std::size_t>(weight_row) * p.num_kv_heads + head) * HeadDim : nullptr;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;

  // Pruning: the kept elements of each token, as bit masks.
  for (int t = warp; t < page_size; t += encode_threads / 32) {
    std::uint32_t score[per_lane];
#pragma unroll
    for (int e = 0; e < per_lane; ++e) {
      const int c = lane + 32 * e;
      const std::uint16_t bits = rows[t * HeadDim + c];
      const float magnitude = fabsf(to_float(T::from_bits(bits)));
      score[e] = __float_as_uint(weights != nullptr ? magnitude * weights[c] : magnitude);
    }
    std::uint32_t threshold = 0;  // the largest value with at least `keep` scores >= it
    for (int bit = 30; bit >= 0; --bit) {
      const std::uint32_t candidate = threshold | (1u << bit);
      int count = 0;
#pragma unroll
      for (int e = 0; e < per_lane; ++e) count += score[e] >= candidate;
      if (detail_encode::warp_sum(count) >= keep) threshold = candidate;
    }
    int above = 0;
#pragma unroll
    for (int e = 0; e < per_lane; ++e) above += score[e] > threshold;
    int ties_left = keep - detail_encode::warp_sum(above);  // equal scores kept, lowest channels first
#pragma unroll
    for (int e = 0; e < per_lane; ++e) {
      const std::uint32_t equal = __ballot_sync(0xffffffffu, score[e] == threshold);
      const int rank = __popc(equal & ((1u << lane) - 1));
      const bool kept = score[e] > threshold || (score[e] == threshold && rank < ties_left);
      ties_left -= __popc(equal);
      const std::uint32_t mask = __ballot_sync(0xffffffffu, kept);
      if (lane == 0) masks[t * words + e] = mask;
    }
  }
  __syncthreads();

  // Compression: thread j owns tiles [j * per_thread, (j + 1) * per_thread).
  const int tiles = page_size * HeadDim / 64, tiles_per_channel = page_size / 64;
  const int per_thread = (tiles + encode_threads - 1) / encode_threads;
  const int begin = min(tiles, static_cast<int>(threadIdx.x) * per_thread), end = min(tiles, begin + per_thread);
  const bool along_channels = is_v || p.k_along_tokens == 0;
  const auto tile_bitmap = [&](int tile) {
    std::uint64_t bits = 0;
    if (along_channels) {  // token t, channels 64 j ..: mask words 2 j and 2 j + 1
      const int t = tile / (HeadDim / 64), j = tile % (HeadDim / 64);
      bits = masks[t * words + 2 * j] | static_cast<std::uint64_t>(masks[t * words + 2 * j + 1]) << 32;
    } else {     // channel c, tokens 64 j ..
      const int c = tile / tiles_per_channel, j = tile % tiles_per_channel;
      for (int b = 0; b < 64; ++b)
        bits |= static_cast<std::uint64_t>((masks[(64 * j + b) * words + c / 32] >> (c % 32)) & 1u) << b;
    }
    return bits;
  };
  int count = 0;
  for (int tile = begin; tile < end; ++tile) count += __popcll(tile_bitmap(tile));
  int offset = detail_encode::block_exclusive_sum<encode_threads>(count, warp_totals);

  std::byte* page = p.pages + static_cast<std::int64_t>(p.new_pages[ordinal]) * p.page_slot_bytes +
                    (is_v ? p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes : head * p.k_page_bytes);
  auto* bitmaps = reinterpret_cast<std::uint64_t*>(page);
  auto* offsets = reinterpret_cast<std::uint32_t*>(page + tiles * 8);
  auto* values = reinterpret_cast<std::uint16_t*>(page + tiles * 12);
  for (int tile = begin; tile < end; ++tile) {
    const std::uint64_t bits = tile_bitmap(tile);
    bitmaps[tile] = bits;
    offsets[tile] = static_cast<std::uint32_t>(offset);
    for (int b = 0; b < 64; ++b) {
      if (!((bits >> b) & 1u)) continue;
      const int t = along_channels ? tile / (HeadDim / 64) : 64 * (tile % tiles_per_channel) + b;
      const int c = along_channels ? 64 * (tile % (HeadDim / 64)) + b : tile / tiles_per_channel;
      values[offset++] = rows[t * HeadDim + c];
    }
  }
  // The run of values ends padded to 16 bytes with zeros.
  const int total = page_size * keep;
  const int padded = (total * 2 + 15) / 16 * 16 / 2;
  for (int i = total + static_cast<int>(threadIdx.x); i < padded; i += encode_threads) values[i] = 0;
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/bitmap_tiles/encode.cuh> ----

// ---- begin <kvmosaic/cuda/format/bitmap_tiles/unpack.cuh> ----
/// \file
/// Device unpack of `format::bitmap_tiles` pages, the inverse of `encode_bitmap_pages_kernel`:
/// every kept value back at its (token, channel), zeros elsewhere, exactly the host's
/// `format_traits<bitmap_tiles>::decode_k/v`. A compaction unpacks the pages it touches, moves
/// rows and encodes the pages it writes again, which keeps the same values (a token keeps as many
/// values as it had, and the pruned zeros never outrank them).



namespace kvmosaic::cuda::kernel {

/// Pages `page_ids[i]` of the page arena unpacked to dense rows in `rows` (slot i = [K: heads]
/// [V: heads] x rows_head_bytes, the first page_size rows 16-bit).
struct bitmap_unpack_params {
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  const std::int32_t* page_ids;
  int num_kv_heads;
  int page_size;
  int k_along_tokens;  ///< K tiled along tokens (a channel's 64 tokens per tile), not along channels
};

constexpr int bitmap_unpack_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V): the CTA clears its page's rows, then each thread
/// scatters the kept values of its tiles ([bitmaps: tiles x u64][offsets: tiles x u32][values]).
/// Cost per page: one read of the page, one write of its rows.
template <int HeadDim>
__global__ void __launch_bounds__(bitmap_unpack_threads) unpack_bitmap_pages_kernel(const bitmap_unpack_params u) {
  constexpr int tile = kvmosaic::detail::tile_length;
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const bool along_tokens = is_key && u.k_along_tokens != 0;
  const std::int64_t page_at = is_key ? head * u.k_page_bytes : u.num_kv_heads * u.k_page_bytes + head * u.v_page_bytes;
  const std::byte* page = u.pages + static_cast<std::int64_t>(u.page_ids[page_index]) * u.page_slot_bytes + page_at;
  auto* rows = reinterpret_cast<std::uint16_t*>(u.rows + page_index * u.rows_slot_bytes +
                                                ((is_key ? 0 : u.num_kv_heads) + head) * u.rows_head_bytes);
  const int elements = u.page_size * HeadDim, tiles = elements / tile;
  for (int i = static_cast<int>(threadIdx.x); i < elements; i += bitmap_unpack_threads) rows[i] = 0;
  __syncthreads();
  const auto* bitmaps = reinterpret_cast<const std::uint64_t*>(page);
  const auto* offsets = reinterpret_cast<const std::uint32_t*>(page + tiles * 8);
  const auto* values = reinterpret_cast<const std::uint16_t*>(page + tiles * 12);
  const int tiles_per_line = along_tokens ? u.page_size / tile : HeadDim / tile;
  for (int t = static_cast<int>(threadIdx.x); t < tiles; t += bitmap_unpack_threads) {
    std::uint64_t bits = bitmaps[t];
    std::uint32_t offset = offsets[t];
    const int line = t / tiles_per_line, part = t % tiles_per_line;
    while (bits != 0) {
      const int b = __ffsll(static_cast<long long>(bits)) - 1;
      bits &= bits - 1;
      const int token = along_tokens ? part * tile + b : line, channel = along_tokens ? line : part * tile + b;
      rows[token * HeadDim + channel] = values[offset++];
    }
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/bitmap_tiles/unpack.cuh> ----

namespace kvmosaic::cuda {

template <>
struct device_format<format::bitmap_tiles> {
  static constexpr bool encodes_pages = true;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  static constexpr std::int32_t split_page_multiple = 1;
  /// Both kernels write each row's logits for a step with token scores (select::tova, select::h2o,
  /// cache::window_votes): q . k of the pruned keys in fp32 (sm_90: q in two 16-bit halves).
  static constexpr bool writes_token_logits = true;
  static constexpr bool writes_exact_logits = true;
  using params = kernel::bitmap_decode_params;
  using traits = format_traits<format::bitmap_tiles>;

  struct state {
    int stages = 0;  ///< sm_90 kernel: compressed page pairs in flight per CTA (0: the portable kernel)
  };

  static void validate(const format::bitmap_tiles&, const kvmosaic::detail::engine_shape&) {}

  /// The sm_90 kernel's stages. Occupancy comes first: as many CTAs per SM as the kernel's
  /// registers allow (it is bounded to 96 registers at head_dim 128, groups <= 4: five CTAs) with
  /// at least one stage each, then up to two stages next to them (a third or fourth was slower
  /// or equal at batch 8-32: benchmark/README.md). Pages too large for one stage: the portable
  /// kernel (stages = 0).
  template <class Shapes>
  static void configure(state& s, const format::bitmap_tiles& f, device_context& e) {
    s.stages = 0;
    if (!e.bulk_copy) return;
    s.stages = 1;  // what with_decode_kernel sizes the kernel with while the registers are read
    int kernel_registers = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int) { kernel_registers = detail::registers_of(kernel); });
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const int pair = static_cast<int>(g.k_page_bytes + g.v_page_bytes);
    const auto shared_bytes = [&](int stages) {
      return kernel::bitmap_decode_shared_bytes(e.shape->head_dim, e.shape->group_size, pair, stages, traits::k_along_tokens(f));
    };
    s.stages = detail::stages_for(e.device, kernel_registers, 16, 2, shared_bytes);
    if (s.stages == 0) e.bulk_copy = false;  // not even one page pair fits: the portable kernel
  }

  /// `Logits`: the sm_90 kernel that writes each row's logits for a step with token scores (its
  /// own instantiations: a kernel without scores has no store); the portable kernel branches at
  /// run time.
  template <class Shapes, bool Logits = false, class F>
  static void with_decode_kernel(const state& s, const format::bitmap_tiles& f, const device_context& e, bool row_masks,
                                 F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
      if (s.stages > 0) {
        const int shared_bytes = kernel::bitmap_decode_shared_bytes(
            head_dim, group_size, static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes), s.stages,
            traits::k_along_tokens(f));
        if (row_masks)  // row masks: their own instantiation
          call(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size, true, Logits>, 128, shared_bytes);
        else
          call(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size, false, Logits>, 128, shared_bytes);
      } else {
        using collective = page_attend<format::dense, T, head_dim, group_size, t.threads, t.unroll>;
        call(kernel::decode_partial_bitmap_portable_kernel<T, head_dim, group_size, t.threads, t.unroll>, t.threads,
             kernel::bitmap_portable_layout<head_dim, group_size, collective::rows>::bytes);
      }
    });
  }

  static params params_for(const state& s, const format::bitmap_tiles& f, const device_context&) {
    return params{s.stages, traits::k_along_tokens(f) ? 1 : 0};
  }

  /// Page ids are read from the block table: no limit.
  static int max_pages_per_split(const state&, const decode_tuning&) { return 1 << 30; }

  /// The sm_90 kernel multiplies p.v on tensor cores, p split into two 16-bit halves.
  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.stages > 0; }

  /// Prunes and packs `n` completed pages (K and V of every KV head): one CTA per (page, head,
  /// K or V), the rows from the scratch slots, output-aware K weights where a page has a row.
  template <class Shapes>
  static void encode_pages(const state&, const format::bitmap_tiles& f, const encode_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    kernel::bitmap_encode_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.k_page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.v_page_bytes = static_cast<std::int64_t>(g.v_page_bytes);
    p.new_pages = c.page_ids;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.keep_k = kvmosaic::detail::kept_per_vector(f.s_k, shape.head_dim);
    p.keep_v = kvmosaic::detail::kept_per_vector(f.s_v, shape.head_dim);
    p.k_along_tokens = traits::k_along_tokens(f) ? 1 : 0;
    p.key_weights = c.key_weights;
    p.weight_rows = c.key_weights != nullptr ? c.weight_rows : nullptr;
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    const int mask_bytes = shape.page_size * shape.head_dim / 8;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      kernel::encode_bitmap_pages_kernel<S, head_dim><<<grid, kernel::encode_threads, mask_bytes, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Unpacks `n` pages to dense rows (a compaction's sources): one CTA per (page, head, K or V).
  template <class Shapes>
  static void unpack_pages(const state&, const format::bitmap_tiles& f, const unpack_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const kernel::bitmap_unpack_params p{c.rows,
                                         static_cast<std::int64_t>(g.tail_slot_bytes()),
                                         static_cast<std::int64_t>(g.tail_head_bytes),
                                         e.pages,
                                         static_cast<std::int64_t>(g.page_slot_bytes()),
                                         static_cast<std::int64_t>(g.k_page_bytes),
                                         static_cast<std::int64_t>(g.v_page_bytes),
                                         c.page_ids,
                                         shape.num_kv_heads,
                                         shape.page_size,
                                         traits::k_along_tokens(f) ? 1 : 0};
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto, auto dim, auto) {
      kernel::unpack_bitmap_pages_kernel<decltype(dim)::value><<<grid, kernel::bitmap_unpack_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/bitmap_tiles/device.cuh> ----

// ---- begin <kvmosaic/cuda/format/quant/device.cuh> ----
/// \file
/// format::quant<Bits, ValueAxis> (HACK; quant2, quant4) on the device
/// (cuda/format/device_format.cuh says what a device part provides): completed pages are quantized
/// by `encode_quant_pages_kernel` (bytes equal to the host encoder's); decode computes on the codes
/// with int8 tensor cores (`decode_partial_quant_kernel`), each of 4 warps streaming its own pages
/// through shared-memory stages with bulk copies on sm_90, one stage with plain loads before. K is
/// read partitioned per channel (`key_axis::tokens`); the per-token K layout runs on the host
/// backend. V runs either way (the axis is a template parameter of the format and the kernel).



// ---- begin <kvmosaic/cuda/format/quant/decode.cuh> ----
/// \file
/// Decode split kernel for `format::quant<Bits, ValueAxis>` pages (HACK, Eq. 4): attention on the
/// 2- or 4-bit codes with int8 tensor cores (`quant_warp_attend`); the cache is never dequantized. The dense tail is
/// folded in fp32 by the same collective. Partial states merge with the dense path's
/// `merge_splits_kernel`.


// ---- begin <kvmosaic/cuda/format/quant/attend.cuh> ----
/// \file
/// `quant_warp_attend`: the warp collective of `format::quant<Bits, ValueAxis>` decode attention
/// (HACK, Eq. 4), computed on the 2- or 4-bit codes with int8 tensor cores; the cache is never
/// dequantized.
///
/// A warp folds a partition of Pi tokens (K partitioned along tokens per channel; V along tokens
/// per channel, or along head_dim per token) into a running softmax state for every query head of
/// its GQA group:
///  1. q' = q * s_K (the partition's per-channel K scales) is quantized to 8 bits per group of Pi
///     channels, and base = q . m_K (the per-channel K mins) is one number per head;
///  2. S^T = K Q'^T on tensor cores: int8 m16n8k32 products of the codes, unpacked from the page
///     by shift and mask (the page stores them as the A operand), with the quantized q';
///     logit = base + sum over channel groups of (m_q' * code sum of the token + s_q' * dot);
///  3. p = exp(logit - partition max) is quantized to 8 bits over the partition (V per token:
///     p' = p s_V, per group of Pi channels, with base = p . m_V per group: step 1 mirrored);
///  4. O^T = V^T P^T on tensor cores, with Eq. 4's corrections per (channel, head):
///     o += Pi m_p m_v + m_p s_v sum(v codes) + s_p m_v sum(p codes) + s_p s_v dot
///     (V per token: o += base + m_p' sum(v codes) + s_p' dot, the sums along tokens).
/// The quantization of q' and p is the host reference's (`detail::quantize8`) operation for
/// operation, in round-to-nearest fp32 without contraction, so both draw the same 8-bit codes;
/// the logits and outputs then differ by fp32 rounding only, and where that moves a p value
/// across a rounding boundary of its 8-bit grid, by one step of that code.
///
/// Mins and scales are read in the cache's storage dtype (`Storage`: half or bfloat16, as the
/// encoder stores them). NaN: a NaN min or scale (a partition the encoder saw a non-finite value
/// in) or a NaN q makes the outputs that read it NaN, as on the host; every float-to-integer
/// conversion is clamped first (NaN to code 0), so no input is undefined behaviour.
///
/// Thread mapping: lane 4 g + q owns heads 2q and 2q + 1 (the C fragment's columns) and, of the
/// output, channels 16 t + g and 16 t + g + 8 of every 16-channel tile t. Groups of fewer than 8
/// heads leave columns unused: the product costs the same, so the group size is a run-time value
/// (one instantiation serves groups 1-8).
///
/// Cost per partition and warp: (Pi / 16) (D / 32) + (D / 16) (Pi / 32) tensor-core products,
/// four shift-and-mask pairs per 16 codes (from Bits / 2 words), and O(G D / 32 + G Pi / 32) fp32
/// work per lane for the quantization of q' and p and the corrections (V per token: G D / 32 for
/// p' instead of G Pi / 32, and D / Pi 8-bit grids of p per head instead of one).



namespace kvmosaic::cuda {

/// Where the parts of one quantized page (K or V of one head) lie, in bytes from its start (see
/// format/quant.hpp: mins, scales, code sums, codes).
struct quant_page_geometry {
  int page_size;
  int partitions;
  int per_channel;  ///< partitions per channel: page_size / Pi
  int sums_at;
  int codes_at;

  __host__ __device__ static quant_page_geometry of(int page_size, int head_dim, int partition, int bits) {
    const int partitions = page_size * head_dim / partition;
    const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, partition);
    return quant_page_geometry{page_size, partitions, page_size / partition, partitions * 4,
                                partitions * (4 + sum_bytes)};
  }
};

/// `Storage`: the cache's 16-bit storage type (kvmosaic::half or kvmosaic::bfloat16), the type
/// of the pages' mins and scales. `Format`: the `format::quant<Bits, ValueAxis>` the pages hold.
template <int HeadDim, int Partition, class Storage, class Format>
class quant_warp_attend {
  static_assert(Partition == 32 || Partition == 64 || Partition == 128,
                "quant_warp_attend: Partition (format::quant::partition) must be 32, 64 or 128");
  static_assert(HeadDim % Partition == 0 && HeadDim % 32 == 0,
                "quant_warp_attend: HeadDim must be a multiple of Partition (K groups channels by Pi)");
  static_assert(sizeof(dtype_traits<Storage>) > 0 && sizeof(Storage) == 2,
                "quant_warp_attend: Storage must be kvmosaic::half or kvmosaic::bfloat16");

 public:
  static constexpr int max_group = 8;  ///< query heads per KV head: the product's N
  static constexpr int channels_per_lane = HeadDim / 32;           ///< of q' while it is quantized
  static constexpr int lanes_per_channel_group = Partition / channels_per_lane;
  static constexpr int channel_groups = HeadDim / Partition;       ///< 8-bit partitions of q'
  static constexpr int token_tiles = Partition / 16;               ///< M tiles of q.k
  static constexpr int channel_steps = HeadDim / 32;               ///< K steps of q.k
  static constexpr int channel_tiles = HeadDim / 16;               ///< M tiles of p.v
  static constexpr int token_steps = Partition / 32;               ///< K steps of p.v
  static constexpr int bits = Format::bits;
  static constexpr int code_words = bits / 2;  ///< 32-bit words of codes per lane and tile
  static constexpr bool v_per_token = Format::v_axis == format::value_axis::head_dim;
  static constexpr int p_rows = v_per_token ? channel_groups : 1;  ///< 8-bit grids of p per head
  static constexpr int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, Partition);
  // Rows of the operand tables padded by 4 words: lanes g = 0..7 reading column q land in
  // distinct banks.
  static constexpr int q_row_words = HeadDim / 4 + 4;
  static constexpr int p_row_words = Partition / 4 + 4;

  /// Per-warp scratch: the partition's 8-bit q' and p (or p') operands and q's quantization
  /// constants.
  struct temp_storage {
    std::uint32_t q_codes[8][q_row_words];
    std::uint32_t p_codes[8][p_rows][p_row_words];
    float q_min[8][channel_groups];
    float q_scale[8][channel_groups];
    float q_base[8];
  };

  float o[channel_tiles][4];  ///< unnormalized output, C fragment layout: channels x heads
  float m[2];                 ///< running max of heads 2q, 2q + 1
  float l[2];                 ///< running sum of exp(logit - m) over this lane's tokens (rows g, g + 8):
                              ///< the 8 lanes of a column sum theirs once, at the end
  int group;                  ///< query heads per KV head, 1 to 8

  /// Empty state for `group_size` query heads; zeroes the rows of heads past the group in `temp`
  /// (read as zero operands).
  __device__ __forceinline__ void start(int group_size, temp_storage& temp) {
    group = group_size;
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[t][e] = 0.0f;
    m[0] = m[1] = -HUGE_VALF;
    l[0] = l[1] = 0.0f;
    const int lane = lane_id();
    for (int h = group; h < max_group; ++h) {
      for (int i = lane; i < q_row_words; i += 32) temp.q_codes[h][i] = 0u;
      if (lane < channel_groups) {
        temp.q_min[h][lane] = 0.0f;
        temp.q_scale[h][lane] = 0.0f;
      }
      if (lane == 0) temp.q_base[h] = 0.0f;
    }
    __syncwarp();
  }

  /// Folds partition `j` of a page in shared memory (`k_page`, `v_page`: one head's quantized K and
  /// V pages) into the state. `q`: the group's queries times the softmax scale, [group][HeadDim]
  /// in shared memory. The page's first `masked` tokens (sinks, attended as dense rows) get p = 0,
  /// and so do those whose bit in `rows_read` (bit t % 32 of word t / 32; null: all read) is clear.
  /// The partition must hold a token read (the caller skips the others: `reads_partition`, and
  /// `write_masked_logits` for them). With `logits` (a step that records token scores: the page's
  /// row 0 of `decode_params::token_logits`, [row][group]), each token's logit per query head as
  /// the softmax takes it (-inf where masked) is written there.
  __device__ __forceinline__ void fold_partition(const std::byte* k_page, const std::byte* v_page,
                                                 const quant_page_geometry& geometry, int j, const float* q,
                                                 temp_storage& temp, int masked = 0,
                                                 const std::uint32_t* rows_read = nullptr, float* logits = nullptr) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    quantize_folded_query(k_page, geometry, j, q, group, temp);
    __syncwarp();

    // q.k: int8 products per 16-token tile, then the per-group corrections.
    std::uint32_t b_q[channel_steps][2];
    load_b_fragments(temp.q_codes[g], quad, b_q);
    float base[2], q_min[2][channel_groups], q_scale[2][channel_groups];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      base[hh] = temp.q_base[2 * quad + hh];
#pragma unroll
      for (int c = 0; c < channel_groups; ++c) {
        q_min[hh][c] = temp.q_min[2 * quad + hh][c];
        q_scale[hh][c] = temp.q_scale[2 * quad + hh][c];
      }
    }
    const auto* k_codes = reinterpret_cast<const std::uint32_t*>(k_page + geometry.codes_at);
    const std::byte* k_sums = k_page + geometry.sums_at;
    float s[token_tiles][4];
#pragma unroll
    for (int t = 0; t < token_tiles; ++t) {
      int dot[channel_groups][4];
#pragma unroll
      for (int c = 0; c < channel_groups; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) dot[c][e] = 0;
      const int tile_row = j * token_tiles + t;
#pragma unroll
      for (int k = 0; k < channel_steps; ++k) {
        std::uint32_t a[4];
        unpack(k_codes, tile_row * channel_steps + k, lane, a);
        detail::mma_u8_16832(dot[k * 32 / Partition], a, b_q[k][0], b_q[k][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = j * Partition + t * 16 + g + 8 * (e / 2), hh = e % 2;
        float logit = base[hh];
#pragma unroll
        for (int c = 0; c < channel_groups; ++c) {
          const float code_sum = load_sum(k_sums, token * channel_groups + c);
          logit += q_min[hh][c] * code_sum + q_scale[hh][c] * small_to_float(dot[c][e]);
        }
        s[t][e] = logit;
      }
    }
    if (masked > 0 || rows_read != nullptr) {  // branches the warp takes together
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = j * Partition + t * 16 + g + 8 * (e / 2);
          if (token < masked || (rows_read != nullptr && ((rows_read[token >> 5] >> (token & 31)) & 1u) == 0))
            s[t][e] = -HUGE_VALF;
        }
    }
    if (logits != nullptr) write_logits(logits, j * Partition, s);

    // Softmax over the partition: p relative to the partition's max (as the host's page-local
    // softmax when a page is one partition), quantized to 8 bits per head.
    float block_max[2] = {-HUGE_VALF, -HUGE_VALF};
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) block_max[e % 2] = fmaxf(block_max[e % 2], s[t][e]);
    float p_lo[2] = {HUGE_VALF, HUGE_VALF}, p_sum[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) block_max[hh] = reduce_max_over_rows(block_max[hh]);
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[t][e] = __expf(s[t][e] - block_max[e % 2]);
        p_lo[e % 2] = fminf(p_lo[e % 2], s[t][e]);
      }
    if constexpr (v_per_token) {
      fold_values_per_token(v_page, geometry, j, s, block_max, temp);
    } else {  // V per channel
      // The largest p is exp(0) = 1 exactly (ex2.approx(0) = 1), as on the host.
      float p_step[2], p_inverse[2], p_bias[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        p_lo[hh] = reduce_min_over_rows(p_lo[hh]);
        p_step[hh] = step_of(p_lo[hh], 1.0f);
        p_inverse[hh] = inverse_of(p_step[hh]);
        p_bias[hh] = bias_of(p_lo[hh], p_inverse[hh]);
        p_sum[hh] = 0.0f;
      }
      int code_sum[2] = {0, 0};
      auto* p_bytes = reinterpret_cast<std::uint8_t*>(&temp.p_codes[0][0][0]);
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e % 2;
          p_sum[hh] += s[t][e];
          const int code = quantize8(s[t][e], p_inverse[hh], p_bias[hh]);
          code_sum[hh] += code;
          p_bytes[(2 * quad + hh) * p_rows * p_row_words * 4 + t * 16 + g + 8 * (e / 2)] = static_cast<std::uint8_t>(code);
        }
      float alpha[2], b_mean[2], b_min[2], b_step[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        code_sum[hh] = reduce_sum_over_rows(code_sum[hh]);
        const float m_new = fmaxf(m[hh], block_max[hh]);
        alpha[hh] = __expf(m[hh] - m_new);
        const float beta = __expf(block_max[hh] - m_new);
        m[hh] = m_new;
        l[hh] = l[hh] * alpha[hh] + beta * p_sum[hh];
        // Eq. 4 regrouped: o += m_v (Pi m_p + s_p sum_p) + s_v (m_p sum_v + s_p dot), all times beta.
        b_mean[hh] = beta * (static_cast<float>(Partition) * p_lo[hh] + p_step[hh] * small_to_float(code_sum[hh]));
        b_min[hh] = beta * p_lo[hh];
        b_step[hh] = beta * p_step[hh];
      }
      __syncwarp();

      // p.v: int8 products per 16-channel tile, Eq. 4's corrections per output.
      std::uint32_t b_p[token_steps][2];
      load_b_fragments(temp.p_codes[g][0], quad, b_p);
      const auto* v_codes = reinterpret_cast<const std::uint32_t*>(v_page + geometry.codes_at);
      const int token_columns = geometry.page_size / 32;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        int dot[4];
        value_tile_dot(v_codes, t * token_columns + j * token_steps, lane, b_p, dot);
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int part = (t * 16 + g + 8 * half_row) * geometry.per_channel + j;
          const float v_min = load_stored(v_page, part);
          const float v_scale = load_stored(v_page + geometry.partitions * 2, part);
          const float v_sum = load_sum(v_page + geometry.sums_at, part);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * half_row + hh;
            const float corrected = b_min[hh] * v_sum + b_step[hh] * small_to_float(dot[e]);
            o[t][e] = o[t][e] * alpha[hh] + v_min * b_mean[hh] + v_scale * corrected;
          }
        }
      }
      __syncwarp();  // temp is rewritten by the next partition
    }
  }

  /// -inf as the logits of partition `j`'s tokens (`logits`: the page's row 0, [row][group]): a
  /// partition the caller skips reads none of its tokens. The whole warp calls it.
  __device__ __forceinline__ void write_masked_logits(float* logits, int j) const {
    for (int i = lane_id(); i < Partition * group; i += 32) logits[static_cast<std::size_t>(j) * Partition * group + i] = -HUGE_VALF;
  }

  /// Whether partition `j` of a page holds a token to fold: past the first `masked` of the page,
  /// and marked in `rows_read` (null: all).
  __device__ __forceinline__ static bool reads_partition(const std::uint32_t* rows_read, int j, int masked) {
    if (rows_read == nullptr) return masked < (j + 1) * Partition;
    std::uint32_t any = 0;
#pragma unroll
    for (int w = 0; w < Partition / 32; ++w) {
      const int base = (j * (Partition / 32) + w) * 32;
      const std::uint32_t past_masked = masked <= base ? ~0u : masked - base >= 32 ? 0u : ~((1u << (masked - base)) - 1u);
      any |= rows_read[base / 32] & past_masked;
    }
    return any != 0;
  }

  /// Folds `n` (1 to 16) dense rows of the tail (16-bit, [n][HeadDim] from `k_rows`, `v_rows` in
  /// global memory) in fp32: exact softmax, as the host folds its tail. With `logits` (the first
  /// row's place in `decode_params::token_logits`, [row][group]), each row's logits go there.
  template <class T>
  __device__ __forceinline__ void fold_dense_rows(const T* k_rows, const T* v_rows, int n, const float* q,
                                                  float* logits = nullptr) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = g + 8 * (e / 2), head = 2 * quad + e % 2;
      float dot = 0.0f;
      if (token < n && head < group) {
        const T* k = k_rows + static_cast<std::size_t>(token) * HeadDim;
        const float* q_h = q + head * HeadDim;
#pragma unroll 8
        for (int c = 0; c < HeadDim; ++c) dot += q_h[c] * to_float(k[c]);
      }
      s[e] = token < n ? dot : -HUGE_VALF;
      if (logits != nullptr && token < n && head < group) logits[static_cast<std::size_t>(token) * group + head] = dot;
    }
    float block_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])}, p_sum[2], alpha[2], beta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) block_max[hh] = reduce_max_over_rows(block_max[hh]);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = __expf(s[e] - block_max[e % 2]);  // 0 past n
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      p_sum[hh] = s[hh] + s[2 + hh];
      const float m_new = fmaxf(m[hh], block_max[hh]);
      alpha[hh] = __expf(m[hh] - m_new);
      beta[hh] = __expf(block_max[hh] - m_new);
      m[hh] = m_new;
      l[hh] = l[hh] * alpha[hh] + beta[hh] * p_sum[hh];
    }
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[t][e] *= alpha[e % 2];
    for (int token = 0; token < n; ++token) {
      // p of (token, heads 2q, 2q + 1) lives in lane 4 (token % 8) + q, elements 2 (token / 8) + hh.
      const int source = 4 * (token % 8) + quad;
      const float p0 = __shfl_sync(0xffffffffu, token < 8 ? s[0] : s[2], source) * beta[0];
      const float p1 = __shfl_sync(0xffffffffu, token < 8 ? s[1] : s[3], source) * beta[1];
      const T* v = v_rows + static_cast<std::size_t>(token) * HeadDim;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        const float v0 = to_float(v[t * 16 + g]), v1 = to_float(v[t * 16 + g + 8]);
        o[t][0] += p0 * v0;
        o[t][1] += p1 * v0;
        o[t][2] += p0 * v1;
        o[t][3] += p1 * v1;
      }
    }
  }

  /// This lane's share of the state for a CTA reduction: calls out(head, channel, o) for its
  /// outputs and, on lanes 0..3, state(head, m, l), for heads of the group.
  template <class Out, class State>
  __device__ __forceinline__ void for_each_output(Out&& out, State&& state) const {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    const float l_total[2] = {reduce_sum_over_rows(l[0]), reduce_sum_over_rows(l[1])};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int head = 2 * quad + hh;
      if (head >= group) continue;
#pragma unroll
      for (int t = 0; t < channel_tiles; ++t) {
        out(head, t * 16 + g, o[t][hh]);
        out(head, t * 16 + g + 8, o[t][2 + hh]);
      }
      if (g == 0) state(head, m[hh], l_total[hh]);
    }
  }

 private:
  __device__ __forceinline__ static int lane_id() { return static_cast<int>(threadIdx.x) % 32; }
  /// This lane's logits of a partition starting at page row `first` (rows g, g + 8 of each 16-row
  /// tile, heads 2q, 2q + 1) into `logits`, [row][group], heads past the group skipped.
  __device__ __forceinline__ void write_logits(float* logits, int first, const float (&s)[token_tiles][4]) const {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
#pragma unroll
    for (int t = 0; t < token_tiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = 2 * quad + e % 2;
        if (head < group) logits[static_cast<std::size_t>(first + t * 16 + g + 8 * (e / 2)) * group + head] = s[t][e];
      }
  }

  /// The B fragments of K steps of 32 from `row` (column g of B: one head's 8-bit codes).
  template <int Steps>
  __device__ __forceinline__ static void load_b_fragments(const std::uint32_t* row, int quad,
                                                          std::uint32_t (&b)[Steps][2]) {
#pragma unroll
    for (int k = 0; k < Steps; ++k) {
      b[k][0] = row[k * 8 + quad];
      b[k][1] = row[k * 8 + 4 + quad];
    }
  }

  /// The A fragment of code tile `tile` (16 x 32 codes) for this lane: register s is, byte-wise,
  /// bits (s % (8 / Bits)) Bits .. of word s / (8 / Bits) of the lane's Bits / 2 words
  /// (`kvmosaic::detail::quant_code_bit`): one 4- or 8-byte load, four shift-and-mask pairs.
  __device__ __forceinline__ static void unpack(const std::uint32_t* codes, int tile, int lane, std::uint32_t (&a)[4]) {
    if constexpr (bits == 2) {
      const std::uint32_t word = codes[tile * 32 + lane];
#pragma unroll
      for (int s = 0; s < 4; ++s) a[s] = (word >> (2 * s)) & 0x03030303u;
    } else {
      const uint2 words = reinterpret_cast<const uint2*>(codes)[tile * 32 + lane];
      a[0] = words.x & 0x0f0f0f0fu;
      a[1] = (words.x >> 4) & 0x0f0f0f0fu;
      a[2] = words.y & 0x0f0f0f0fu;
      a[3] = (words.y >> 4) & 0x0f0f0f0fu;
    }
  }

  /// The integer part of one 16-channel tile of O^T = V^T P^T over a partition: `token_steps`
  /// int8 products of the code tiles from `first_tile` on (along tokens) with the B operand `b_p`.
  __device__ __forceinline__ static void value_tile_dot(const std::uint32_t* v_codes, int first_tile, int lane,
                                                        const std::uint32_t (&b_p)[token_steps][2], int (&dot)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dot[e] = 0;
#pragma unroll
    for (int k = 0; k < token_steps; ++k) {
      std::uint32_t a[4];
      unpack(v_codes, first_tile + k, lane, a);
      detail::mma_u8_16832(dot, a, b_p[k][0], b_p[k][1]);
    }
  }

  /// Steps 3 and 4 for V partitioned per token (`value_axis::head_dim`): for each group c of Pi
  /// channels, p' = p s_V(token, c) is quantized to 8 bits over the partition's tokens and
  /// base = p . m_V(., c) summed; then O^T = V^T P'^T with the group's own B operand per
  /// 16-channel tile, o += base + m_p' sum_t(v codes) + s_p' dot, all times beta. `s`: this lane's
  /// p (exp(logit - block_max)), rows g, g + 8 of each 16-token tile, heads 2q, 2q + 1.
  __device__ __forceinline__ void fold_values_per_token(const std::byte* v_page, const quant_page_geometry& geometry,
                                                        int j, const float (&s)[token_tiles][4],
                                                        const float (&block_max)[2], temp_storage& temp) {
    const int lane = lane_id(), g = lane / 4, quad = lane % 4;
    float alpha[2], beta[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float p_sum = 0.0f;
#pragma unroll
      for (int t = 0; t < token_tiles; ++t) p_sum += s[t][hh] + s[t][2 + hh];
      const float m_new = fmaxf(m[hh], block_max[hh]);
      alpha[hh] = __expf(m[hh] - m_new);
      beta[hh] = __expf(block_max[hh] - m_new);
      m[hh] = m_new;
      l[hh] = l[hh] * alpha[hh] + beta[hh] * p_sum;
    }
    float v_base[2][channel_groups], v_min[2][channel_groups], v_step[2][channel_groups];
    auto* p_bytes = reinterpret_cast<std::uint8_t*>(&temp.p_codes[0][0][0]);
    const std::byte* v_scales = v_page + geometry.partitions * 2;
#pragma unroll
    for (int c = 0; c < channel_groups; ++c) {
      float folded[token_tiles][4], lo[2] = {HUGE_VALF, HUGE_VALF}, hi[2] = {-HUGE_VALF, -HUGE_VALF}, base[2] = {0.0f, 0.0f};
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int part = (j * Partition + t * 16 + g + 8 * half_row) * channel_groups + c;
          const float v_scale = load_stored(v_scales, part), v_min_value = load_stored(v_page, part);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * half_row + hh;
            folded[t][e] = __fmul_rn(s[t][e], v_scale);
            lo[hh] = fminf(lo[hh], folded[t][e]);
            hi[hh] = fmaxf(hi[hh], folded[t][e]);
            base[hh] += s[t][e] * v_min_value;
          }
        }
      float inverse[2], bias[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        lo[hh] = reduce_min_over_rows(lo[hh]);
        hi[hh] = reduce_max_over_rows(hi[hh]);
        const float step = step_of(lo[hh], hi[hh]);
        inverse[hh] = inverse_of(step);
        bias[hh] = bias_of(lo[hh], inverse[hh]);
        v_base[hh][c] = beta[hh] * reduce_sum_over_rows(base[hh]);
        v_min[hh][c] = beta[hh] * lo[hh];
        v_step[hh][c] = beta[hh] * step;
      }
#pragma unroll
      for (int t = 0; t < token_tiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e % 2;
          p_bytes[((2 * quad + hh) * p_rows + c) * p_row_words * 4 + t * 16 + g + 8 * (e / 2)] =
              static_cast<std::uint8_t>(quantize8(folded[t][e], inverse[hh], bias[hh]));
        }
    }
    __syncwarp();

    // p'.v: int8 products per 16-channel tile against its channel group's p', then the corrections.
    const auto* v_codes = reinterpret_cast<const std::uint32_t*>(v_page + geometry.codes_at);
    const int token_columns = geometry.page_size / 32;
#pragma unroll
    for (int t = 0; t < channel_tiles; ++t) {
      constexpr int tiles_per_group = Partition / 16;
      const int c = t / tiles_per_group;
      std::uint32_t b_p[token_steps][2];
      load_b_fragments(temp.p_codes[g][c], quad, b_p);
      int dot[4];
      value_tile_dot(v_codes, t * token_columns + j * token_steps, lane, b_p, dot);
#pragma unroll
      for (int half_row = 0; half_row < 2; ++half_row) {
        const float v_sum = load_sum(v_page + geometry.sums_at, (t * 16 + g + 8 * half_row) * geometry.per_channel + j);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int e = 2 * half_row + hh;
          o[t][e] = o[t][e] * alpha[hh] + v_base[hh][c] + v_min[hh][c] * v_sum + v_step[hh][c] * small_to_float(dot[e]);
        }
      }
    }
    __syncwarp();  // temp is rewritten by the next partition
  }

  /// x as a float for 0 <= x < 2^22 (dot products and code sums are): 2^23 + x has x in its
  /// mantissa, so one integer and one float addition replace a quarter-rate I2F conversion.
  __device__ __forceinline__ static float small_to_float(int x) {
    return __int_as_float(0x4b000000 + x) - 8388608.0f;
  }

  /// The step of an 8-bit grid over [lo, hi] and its reciprocal (0 for an empty range, and for a
  /// step below the smallest normal float, whose reciprocal may overflow: `quantize8_inverse`):
  /// the host's quantize8, operation for operation (no division: a multiply and a correctly
  /// rounded reciprocal).
  __device__ __forceinline__ static float step_of(float lo, float hi) {
    return __fmul_rn(__fsub_rn(hi, lo), 1.0f / 255.0f);
  }
  __device__ __forceinline__ static float inverse_of(float step) {
    return step >= 1.17549435e-38f ? __frcp_rn(step) : 0.0f;
  }

  /// The bias of the 8-bit grid (lo, 1 / step): code = floor(x / step + bias).
  __device__ __forceinline__ static float bias_of(float lo, float inverse) { return __fmaf_rn(-lo, inverse, 0.5f); }

  /// 8-bit code of x, round half up: the host's quantize8, rounding for rounding (one fused
  /// multiply-add). floor(y) for |y| < 2^22 is the mantissa of y + 2^23 rounded down, which keeps
  /// the float-to-int conversion off the quarter-rate pipe. For any other y (huge, infinite or
  /// NaN) the bit pattern is still an integer in [0xcb000000, 0x7fffffff] as int32, so the
  /// subtraction cannot overflow and the clamp puts it in [0, 255]: no conversion, no undefined
  /// behaviour. Finite inputs get the host's codes; a NaN gets some code in range where the host's
  /// is 0 (what reads it is NaN either way). Clamping y in float instead cost 2-3% (benchmark/README.md).
  __device__ __forceinline__ static int quantize8(float x, float inverse, float bias) {
    const float y = __fmaf_rn(x, inverse, bias);
    const int code = __float_as_int(__fadd_rd(y, 8388608.0f)) - 0x4b000000;
    return max(min(code, 255), 0);
  }

  /// Min or scale `index` of the array at `base`, in the storage dtype.
  __device__ __forceinline__ static float load_stored(const std::byte* base, int index) {
    return to_float(Storage::from_bits(reinterpret_cast<const std::uint16_t*>(base)[index]));
  }
  __device__ __forceinline__ static float load_sum(const std::byte* sums, int index) {
    if constexpr (sum_bytes == 1)
      return small_to_float(reinterpret_cast<const std::uint8_t*>(sums)[index]);
    else
      return small_to_float(reinterpret_cast<const std::uint16_t*>(sums)[index]);
  }

  // Reductions over the 8 lanes of one column pair (same q, g = 0..7).
  template <class V>
  __device__ __forceinline__ static V reduce_sum_over_rows(V x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
  }
  __device__ __forceinline__ static float reduce_max_over_rows(float x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
  }
  __device__ __forceinline__ static float reduce_min_over_rows(float x) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
  }

  /// Step 1: q' = q * s_K of partition j quantized to 8 bits per group of Pi channels (lane owns
  /// channels_per_lane consecutive channels), its min, scale and base = q . m_K, into temp.
  __device__ __forceinline__ static void quantize_folded_query(const std::byte* k_page,
                                                               const quant_page_geometry& geometry, int j,
                                                               const float* q, int group, temp_storage& temp) {
    const int lane = lane_id();
    const int first_channel = lane * channels_per_lane;
    float k_min[channels_per_lane], k_scale[channels_per_lane];
#pragma unroll
    for (int i = 0; i < channels_per_lane; ++i) {
      const int part = (first_channel + i) * geometry.per_channel + j;
      k_min[i] = load_stored(k_page, part);
      k_scale[i] = load_stored(k_page + geometry.partitions * 2, part);
    }
    // Two heads per pass: their shuffle chains interleave (a pass for one head is one long chain).
    for (int first_head = 0; first_head < group; first_head += 2) {
      float folded[2][channels_per_lane], base[2], lo[2], hi[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int h = min(first_head + u, group - 1);  // an odd group repeats its last head, unstored
        base[u] = 0.0f;
        lo[u] = HUGE_VALF;
        hi[u] = -HUGE_VALF;
#pragma unroll
        for (int i = 0; i < channels_per_lane; ++i) {
          const float q_c = q[h * HeadDim + first_channel + i];
          folded[u][i] = __fmul_rn(q_c, k_scale[i]);
          base[u] += q_c * k_min[i];
          lo[u] = fminf(lo[u], folded[u][i]);
          hi[u] = fmaxf(hi[u], folded[u][i]);
        }
      }
#pragma unroll
      for (int offset = 1; offset < lanes_per_channel_group; offset *= 2)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          lo[u] = fminf(lo[u], __shfl_xor_sync(0xffffffffu, lo[u], offset));
          hi[u] = fmaxf(hi[u], __shfl_xor_sync(0xffffffffu, hi[u], offset));
        }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2)
#pragma unroll
        for (int u = 0; u < 2; ++u) base[u] += __shfl_xor_sync(0xffffffffu, base[u], offset);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int h = first_head + u;
        if (h >= group) break;
        const float step = step_of(lo[u], hi[u]);
        const float inverse = inverse_of(step);
        store_codes(temp.q_codes[h], first_channel, folded[u], inverse, bias_of(lo[u], inverse));
        if (lane % lanes_per_channel_group == 0) {
          temp.q_min[h][lane / lanes_per_channel_group] = lo[u];
          temp.q_scale[h][lane / lanes_per_channel_group] = step;
        }
        if (lane == 0) temp.q_base[h] = base[u];
      }
    }
  }

  /// The 8-bit codes of x[0 .. channels_per_lane) into row bytes [first, ...), 4 per store.
  __device__ __forceinline__ static void store_codes(std::uint32_t* row, int first, const float (&x)[channels_per_lane],
                                                     float inverse, float bias) {
    if constexpr (channels_per_lane % 4 == 0) {
#pragma unroll
      for (int w = 0; w < channels_per_lane / 4; ++w) {
        std::uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) word |= static_cast<std::uint32_t>(quantize8(x[4 * w + b], inverse, bias)) << (8 * b);
        row[first / 4 + w] = word;
      }
    } else {
      auto* bytes = reinterpret_cast<std::uint8_t*>(row) + first;
#pragma unroll
      for (int i = 0; i < channels_per_lane; ++i) bytes[i] = static_cast<std::uint8_t>(quantize8(x[i], inverse, bias));
    }
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/quant/attend.cuh> ----

namespace kvmosaic::cuda::kernel {

/// The quantized formats' fields of their split kernel's params.
struct quant_decode_params {
  int stages;  ///< sm_90: compressed page pairs in flight per warp
};

/// Dynamic shared memory of the quantized formats' kernel: per-warp barriers, the group's scaled queries, one
/// `temp_storage` per warp, then `stages` compressed page pairs (K and V) per warp. The CTA's
/// final reduction reuses the stage area. The same for either storage type (the collective's
/// scratch holds no stored value; `attend` is the f16 instantiation, the bf16 one is checked
/// equal in the kernel).
template <int HeadDim, int Partition, class Format>
struct quant_decode_layout {
  static constexpr int warps = 4;
  static constexpr int max_stages = 4;
  using attend = quant_warp_attend<HeadDim, Partition, half, Format>;
  static constexpr int max_group = attend::max_group;
  static constexpr int barrier_offset = 0;
  static constexpr int query_offset = 128;
  static constexpr int temp_offset = query_offset + (max_group * HeadDim * 4 + 127) / 128 * 128;
  static constexpr int stage_offset =
      temp_offset + (warps * static_cast<int>(sizeof(typename attend::temp_storage)) + 127) / 128 * 128;
  using reduction_storage = decode_temp_storage<max_group, HeadDim, warps>;
  static constexpr int reduction_bytes = static_cast<int>(sizeof(reduction_storage));
  /// Total bytes for `stages` page pairs of `stage_bytes` per warp.
  static constexpr int bytes(int stage_bytes, int stages) {
    const int stage_area = warps * stages * stage_bytes;
    return stage_offset + (stage_area > reduction_bytes ? stage_area : reduction_bytes);
  }
};

/// The quantized formats' split kernel. Each of the 4 warps takes every 4th page of the split and streams it
/// through its own ring of `p.format.stages` shared-memory slots: with `BulkCopy` (sm_90), lane 0 issues
/// one bulk copy per page and cache on the slot's mbarrier, `stages` pages ahead; without (the
/// portable path, sm_75+), the warp copies each page with 16-byte loads before folding it. Warps
/// never wait for each other until the tail and the CTA reduction.
/// The GQA group size is `p.group_size` (1-8), a run-time value: one instantiation per (element
/// type, head_dim, Pi, format (code width and V axis), copy path, `RowMasks`: whether a token-granular selection's row masks are
/// read; without, the code has no mask test: benchmark/README.md, "Decisions the code cites";
/// `Logits`: whether a step with token scores writes its rows' logits, `decode_params::token_logits`;
/// without, the code has no store: a runtime test alone slowed steps without scores,
/// benchmark/README.md).
/// Grid: (splits capacity, num_kv_heads).
template <class T, int HeadDim, int Partition, class Format, bool BulkCopy, bool RowMasks = false, bool Logits = false>
__global__ void __launch_bounds__(128) decode_partial_quant_kernel(const __grid_constant__ split_params<quant_decode_params> p) {
  using layout = quant_decode_layout<HeadDim, Partition, Format>;
  using attend = quant_warp_attend<HeadDim, Partition, T, Format>;
  static_assert(sizeof(typename attend::temp_storage) == sizeof(typename layout::attend::temp_storage) &&
                    attend::max_group == layout::max_group,
                "decode_partial_quant_kernel: the shared-memory layout must not depend on the storage type");
  constexpr int warps = layout::warps, threads = warps * 32;
  extern __shared__ __align__(128) std::byte quant_shared[];
  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int stages = BulkCopy ? p.format.stages : 1;
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int stage_bytes = k_bytes + v_bytes;

  auto* full = reinterpret_cast<std::uint64_t*>(quant_shared + layout::barrier_offset) + warp * layout::max_stages;
  auto* q = reinterpret_cast<float*>(quant_shared + layout::query_offset);
  auto& temp = reinterpret_cast<typename attend::temp_storage*>(quant_shared + layout::temp_offset)[warp];
  std::byte* ring = quant_shared + layout::stage_offset + warp * stages * stage_bytes;

  const int group = p.group_size, num_q_heads = p.num_kv_heads * group;
  const float* q_group = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * group) * HeadDim;
  for (int i = tid; i < group * HeadDim; i += threads) q[i] = __fmul_rn(q_group[i], p.softmax_scale);
  if constexpr (BulkCopy) {
    if (lane == 0)
      for (int b = 0; b < stages; ++b) detail::barrier_init(&full[b], 1);
  }
  attend state;
  state.start(group, temp);
  __syncthreads();  // q and the barriers are ready

  const detail_decode::split_pages range =
      RowMasks ? detail_decode::pages_of_split(p, w, head) : detail_decode::split_pages{w.page_begin, w.page_end};
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  const int num_pages = range.end - range.begin;
  // A step with token scores: every row's logits, at the split's place in the read order.
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, group) : nullptr;
  const int my_pages = num_pages > warp ? (num_pages - warp + warps - 1) / warps : 0;
  const quant_page_geometry geometry = quant_page_geometry::of(p.page_size, HeadDim, Partition, Format::bits);
  const auto page_of = [&](int k) {
    return p.pages + static_cast<std::size_t>(table[warp + k * warps]) * p.page_slot_bytes;
  };
  const auto issue = [&](int k) {  // lane 0: this warp's k-th page into slot k % stages
    const int slot = k % stages;
    const std::byte* page = page_of(k);
    detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(stage_bytes));
    std::byte* destination = ring + slot * stage_bytes;
    detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
    detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                static_cast<std::uint32_t>(v_bytes), &full[slot]);
  };
  if constexpr (BulkCopy) {
    if (lane == 0)
      for (int k = 0; k < min(stages, my_pages); ++k) issue(k);
  }
  for (int k = 0; k < my_pages; ++k) {
    const int slot = k % stages;
    std::byte* k_page = ring + slot * stage_bytes;
    if constexpr (BulkCopy) {
      detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((k / stages) & 1));
    } else {
      const std::byte* page = page_of(k);
      const std::byte* sources[2] = {page + head * p.k_page_bytes,
                                     page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes};
      const int sizes[2] = {k_bytes, v_bytes};
      std::byte* destination = k_page;
      for (int part = 0; part < 2; ++part) {
        for (int at = lane * 16; at < sizes[part]; at += 32 * 16)
          *reinterpret_cast<uint4*>(destination + at) = *reinterpret_cast<const uint4*>(sources[part] + at);
        destination += sizes[part];
      }
      __syncwarp();
    }
    // The sequence's first page (warp 0's first page of the split that starts the sequence, when
    // it is the sequence's page 0: a selection may skip it) masks its sink tokens: they are
    // attended below, as the dense rows the tail slot keeps.
    const int masked = k == 0 && warp == 0 && range.begin == 0 && p.sink_rows > 0 &&
                               table[0] == p.sequence_tables[static_cast<std::size_t>(w.batch_index) * p.step_header[3]]
                           ? p.sink_rows
                           : 0;
    const std::uint32_t* rows_read =
        RowMasks ? detail_decode::page_rows_read(p, w.batch_index, head, range.begin + warp + k * warps) : nullptr;
    if (!Logits || split_logits == nullptr) {  // a step without scores
      for (int j = 0; j < geometry.per_channel; ++j)
        if (!RowMasks || attend::reads_partition(rows_read, j, j == 0 ? masked : 0))
          state.fold_partition(k_page, k_page + k_bytes, geometry, j, q, temp, j == 0 ? masked : 0, rows_read);
    } else {  // every row's logits, -inf for a partition not folded
      float* const page_logits = split_logits + static_cast<std::size_t>(warp + k * warps) * p.page_size * group;
      for (int j = 0; j < geometry.per_channel; ++j) {
        if (attend::reads_partition(RowMasks ? rows_read : nullptr, j, j == 0 ? masked : 0))
          state.fold_partition(k_page, k_page + k_bytes, geometry, j, q, temp, j == 0 ? masked : 0, rows_read, page_logits);
        else
          state.write_masked_logits(page_logits, j);
      }
    }
    __syncwarp();  // every lane is done with the slot
    if constexpr (BulkCopy) {
      if (lane == 0 && k + stages < my_pages) issue(k + stages);
    }
  }
  if (w.with_tail) {  // the exact rows (sinks, recent window) and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* tail_slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes;
    const auto* k_rows = reinterpret_cast<const T*>(tail_slot + head * p.tail_head_bytes) + static_cast<std::size_t>(run.first) * HeadDim;
    const auto* v_rows =
        reinterpret_cast<const T*>(tail_slot + (p.num_kv_heads + head) * p.tail_head_bytes) + static_cast<std::size_t>(run.first) * HeadDim;
    const int rows = run.rows;
    for (int first = warp * 16; first < rows; first += warps * 16) {
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim;
      float* const run_logits =
          Logits && split_logits != nullptr ? split_logits + (static_cast<std::size_t>(num_pages) * p.page_size + first) * group : nullptr;
      state.fold_dense_rows(k_rows + skip, v_rows + skip, min(16, rows - first), q, run_logits);
    }
  }
  __syncthreads();  // every warp is done with the stage area
  auto& reduction = *reinterpret_cast<typename layout::reduction_storage*>(quant_shared + layout::stage_offset);
  state.for_each_output([&](int g, int c, float o) { reduction.o[warp][g][c] = o; },
                        [&](int g, float m, float l) {
                          reduction.m[warp][g] = m;
                          reduction.l[warp][g] = l;
                        });
  detail_decode::merge_and_write_partial<HeadDim, layout::max_group, threads, warps>(p, work_index, head, reduction,
                                                                                   group);
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/quant/decode.cuh> ----

// ---- begin <kvmosaic/cuda/format/quant/encode.cuh> ----
/// \file
/// Device encode of `format::quant<Bits, ValueAxis>` pages (HACK sections 5.2-5.3): 2- or 4-bit
/// quantization of full pages of dense 16-bit rows, byte for byte what the host encoder writes
/// (tests compare the pages): the same `quant_extent`, `quant_range` (min and scale in the storage
/// dtype T, rounded outward; NaN for a partition with a non-finite value, whose codes are then 0)
/// and `quant_code`, so the same stochastic draws for the same seed. One CTA encodes one page of K
/// or of V of one KV head; K is partitioned along tokens per channel (the layout the CUDA decode
/// kernel reads), V as the format says.



namespace kvmosaic::cuda::kernel {

/// Pages to encode: dense rows in `rows` (slot i = [K: heads][V: heads] x rows_head_bytes, the
/// first page_size rows 16-bit), written quantized to page `new_pages[i]` of the page arena.
struct quant_encode_params {
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;  ///< = the tail arena's (its first page_size rows used)
  std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* new_pages;
  int num_kv_heads;
  int page_size;
  int partition;
  bool stochastic;
  std::uint64_t seed;
  /// Sinks: page i with sink_slots[i] >= 0 is a sequence's first page. Its first sink_rows rows
  /// are quantized as copies of row sink_rows (the engine keeps them exact in the tail slot).
  int sink_rows;
  const std::int32_t* sink_slots;
};

constexpr int quant_encode_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V); dynamic shared memory page_size x HeadDim bytes (the
/// codes as a [token][channel] byte matrix, before they are packed into the operand tiles).
template <class T, int HeadDim, class Format>
__global__ void __launch_bounds__(quant_encode_threads) encode_quant_pages_kernel(const quant_encode_params e) {
  constexpr int bits = Format::bits, levels = Format::levels;
  constexpr bool v_per_token = Format::v_axis == format::value_axis::head_dim;
  extern __shared__ std::uint8_t quant_codes[];
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const int tid = static_cast<int>(threadIdx.x);
  const int pi = e.partition, page_size = e.page_size, per_channel = page_size / pi;
  const int partitions = page_size * HeadDim / pi;
  const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, pi);
  const std::int64_t head_at = (static_cast<std::int64_t>(is_key ? 0 : e.num_kv_heads) + head) * e.rows_head_bytes;
  const auto* rows = reinterpret_cast<const T*>(e.rows + page_index * e.rows_slot_bytes + head_at);
  const int sinks = e.sink_slots != nullptr && e.sink_slots[page_index] >= 0 ? e.sink_rows : 0;
  // Row t as the encoder sees it: the sinks replaced by the first row after them.
  const auto row_of = [&](int t) { return rows + static_cast<std::size_t>(t < sinks ? sinks : t) * HeadDim; };
  std::byte* page = e.pages + static_cast<std::int64_t>(e.new_pages[page_index]) * e.page_slot_bytes +
                    (static_cast<std::int64_t>(is_key ? 0 : e.num_kv_heads) + head) * e.page_bytes;
  const int sums_at = partitions * 4, codes_at = partitions * (4 + sum_bytes);

  // Partition = (channel, token block) along tokens (K per channel, V per channel), or
  // (token, channel block) along head_dim (V per token).
  const bool along_tokens = is_key || !v_per_token;
  for (int part = tid; part < partitions; part += quant_encode_threads) {
    const int channel_groups = HeadDim / pi;
    const int first_token = along_tokens ? part % per_channel * pi : part / channel_groups;
    const int first_channel = along_tokens ? part / per_channel : part % channel_groups * pi;
    const int token_step = along_tokens ? 1 : 0, channel_step = along_tokens ? 0 : 1;
    const auto value = [&](int i) { return to_float(row_of(first_token + i * token_step)[first_channel + i * channel_step]); };
    // The extent in element order, as the host's: the same signed zero is kept.
    kvmosaic::detail::quant_extent extent(value(0));
    for (int i = 1; i < pi; ++i) extent.add(value(i));
    const kvmosaic::detail::quant_range_bits range = kvmosaic::detail::quant_range(extent, dtype_traits<T>::id, levels);
    unsigned sum = 0;
    for (int i = 0; i < pi; ++i) {
      const int code = extent.finite ? kvmosaic::detail::quant_code(levels, e.stochastic, e.seed,
                                                                    static_cast<std::uint64_t>(part) * pi + i, value(i),
                                                                    range.min, range.scale)
                                     : 0;
      sum += static_cast<unsigned>(code);
      quant_codes[(first_token + i * token_step) * HeadDim + first_channel + i * channel_step] = static_cast<std::uint8_t>(code);
    }
    reinterpret_cast<std::uint16_t*>(page)[part] = range.min_bits;
    reinterpret_cast<std::uint16_t*>(page + partitions * 2)[part] = range.scale_bits;
    if (!is_key && !v_per_token) {  // V per channel: the partition's code sum
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[part] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[part] = static_cast<std::uint16_t>(sum);
    }
  }
  __syncthreads();

  // V per token: per channel, the code sum of each block of Pi tokens (the token dimension's
  // Eq. 4 sums), indexed as V per channel's partitions.
  if (!is_key && v_per_token) {
    for (int index = tid; index < partitions; index += quant_encode_threads) {
      const int channel = index / per_channel, first_token = index % per_channel * pi;
      unsigned sum = 0;
      for (int i = 0; i < pi; ++i) sum += quant_codes[(first_token + i) * HeadDim + channel];
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[index] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[index] = static_cast<std::uint16_t>(sum);
    }
  }
  // K: per token, the code sum of each group of Pi channels (the channel dimension's Eq. 4 sums).
  if (is_key) {
    const int groups = HeadDim / pi;
    for (int index = tid; index < page_size * groups; index += quant_encode_threads) {
      const std::uint8_t* codes = quant_codes + (index / groups) * HeadDim + index % groups * pi;
      unsigned sum = 0;
      for (int i = 0; i < pi; ++i) sum += codes[i];
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[index] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[index] = static_cast<std::uint16_t>(sum);
    }
  }
  // Codes packed into the operand tiles (`quant_code_bit`): K as [tokens][channels], V as
  // [channels][tokens]; Bits / 2 32-bit words per (tile, lane), each packing 8 / Bits registers.
  constexpr int code_words = bits / 2, per_word = 8 / bits;
  const int columns = is_key ? HeadDim : page_size;
  const int words = page_size * HeadDim * bits / 32;
  for (int word_index = tid; word_index < words; word_index += quant_encode_threads) {
    const int tile = word_index / (32 * code_words), lane = word_index / code_words % 32, w = word_index % code_words;
    const int tile_row = tile / (columns / 32), tile_column = tile % (columns / 32);
    std::uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < per_word; ++i)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int s = w * per_word + i;
        const int row = tile_row * 16 + lane / 4 + 8 * (s % 2);
        const int column = tile_column * 32 + 16 * (s / 2) + 4 * (lane % 4) + b;
        const int token = is_key ? row : column, channel = is_key ? column : row;
        word |= static_cast<std::uint32_t>(quant_codes[token * HeadDim + channel]) << (b * 8 + i * bits);
      }
    reinterpret_cast<std::uint32_t*>(page + codes_at)[word_index] = word;
  }
  // Padding to the page's 16-byte size.
  for (int at = codes_at + words * 4 + tid; at < static_cast<int>(e.page_bytes); at += quant_encode_threads)
    page[at] = std::byte{0};
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/quant/encode.cuh> ----

// ---- begin <kvmosaic/cuda/format/quant/unpack.cuh> ----
/// \file
/// Device unpack of `format::quant<Bits, ValueAxis>` pages, the inverse of
/// `encode_quant_pages_kernel`: every element x = min + scale * code of its partition, rounded to
/// the storage dtype, exactly what the host's `format_traits<quant<...>>::decode_k/v` give rounded
/// the same way (the product of a code of at most 4 bits and a 16-bit scale is exact in fp32, so a
/// fused multiply-add rounds as the host's two operations do). A compaction unpacks the pages it touches, moves rows and encodes the pages it writes.



namespace kvmosaic::cuda::kernel {

/// Pages `page_ids[i]` of the page arena unpacked to dense rows in `rows` (slot i = [K: heads]
/// [V: heads] x rows_head_bytes, the first page_size rows 16-bit).
struct quant_unpack_params {
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* page_ids;
  int num_kv_heads;
  int page_size;
  int partition;
  dtype storage;
};

constexpr int quant_unpack_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V). Partition = (channel, token block of Pi) for K and V
/// per channel, (token, channel block) for V per token, as the encoder writes them. Cost per page:
/// one read of the page, one write of its rows.
template <int HeadDim, class Format>
__global__ void __launch_bounds__(quant_unpack_threads) unpack_quant_pages_kernel(const quant_unpack_params u) {
  constexpr int bits = Format::bits;
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const bool along_tokens = is_key || Format::v_axis == format::value_axis::tokens;
  const int pi = u.partition, page_size = u.page_size, per_channel = page_size / pi;
  const int partitions = page_size * HeadDim / pi;
  const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, pi);
  const int head_index = (is_key ? 0 : u.num_kv_heads) + head;
  const std::byte* page = u.pages + static_cast<std::int64_t>(u.page_ids[page_index]) * u.page_slot_bytes + head_index * u.page_bytes;
  auto* rows = reinterpret_cast<std::uint16_t*>(u.rows + page_index * u.rows_slot_bytes + head_index * u.rows_head_bytes);
  const auto* mins = reinterpret_cast<const std::uint16_t*>(page);
  const auto* scales = reinterpret_cast<const std::uint16_t*>(page + partitions * 2);
  const std::byte* codes = page + partitions * (4 + sum_bytes);
  for (int index = static_cast<int>(threadIdx.x); index < page_size * HeadDim; index += quant_unpack_threads) {
    const int token = index / HeadDim, channel = index % HeadDim;
    const int part = along_tokens ? channel * per_channel + token / pi : token * (HeadDim / pi) + channel / pi;
    const std::size_t bit = is_key ? kvmosaic::detail::quant_code_bit(bits, HeadDim, token, channel)
                                   : kvmosaic::detail::quant_code_bit(bits, page_size, channel, token);
    const int code = (static_cast<int>(codes[bit / 8]) >> (bit % 8)) & Format::levels;
    const float x = kvmosaic::detail::storage_value(mins[part], u.storage) +
                    kvmosaic::detail::storage_value(scales[part], u.storage) * static_cast<float>(code);
    rows[index] = kvmosaic::detail::storage_bits(x, u.storage);
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/quant/unpack.cuh> ----

namespace kvmosaic::cuda {

template <int Bits, format::value_axis ValueAxis>
struct device_format<format::quant<Bits, ValueAxis>> {
  using format_type = format::quant<Bits, ValueAxis>;
  static constexpr bool encodes_pages = true;
  /// The split kernel masks the sinks of a sequence's first page (`decode_partial_quant_kernel`'s
  /// `masked`): a step whose only exact rows are sinks runs the kernel without row masks.
  static constexpr bool masks_sink_rows = true;
  /// Split sizes in multiples of the kernel's 4 warps, which deal a split's pages among them (so
  /// none idles at the end of a split: 3% at batch 8, 128K).
  static constexpr std::int32_t split_page_multiple = 4;
  /// Both paths write each row's logits for a step with token scores (select::tova, select::h2o),
  /// in the kernels `with_decode_kernel<Shapes, true>` hands out (an engine whose selector reads
  /// scores takes those, every other engine the kernels without the stores):
  /// HACK's, from the 8-bit q' and the codes, as the softmax takes them: not the exact q . k of
  /// the dequantized keys, so `cache::window_votes` scores those on the host.
  static constexpr bool writes_token_logits = true;
  using params = kernel::quant_decode_params;

  struct state {
    int stages = 1;  ///< compressed page pairs in flight per warp (sm_90; 1 on the portable path)
  };

  static void validate(const format_type& f, const kvmosaic::detail::engine_shape& shape) {
    kvmosaic::detail::require(f.k_axis == format::key_axis::tokens, "cuda::engine", k_axis_name(),
                              "key_axis::head_dim",
                              "key_axis::tokens (the CUDA kernels read K partitioned per channel; the per-token "
                              "layout runs on the host backend)");
    dispatch_partition(shape.head_dim, f.partition, [](auto, auto) {});  // rejects Pi > head_dim
  }

  /// Up to 4 CTAs per SM (as tuned) and up to 4 stages per warp.
  template <class Shapes>
  static void configure(state& s, const format_type& f, device_context& e) {
    s.stages = 1;
    if (!e.bulk_copy) return;
    int registers = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int) {
      cudaFuncAttributes attributes{};
      KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
      registers = attributes.numRegs;
    });
    const int pair = 4 * static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);  // a page pair per warp
    int stage_offset = 0;
    dispatch_partition(e.shape->head_dim, f.partition, [&](auto dim, auto partition) {
      stage_offset = kernel::quant_decode_layout<decltype(dim)::value, decltype(partition)::value, format_type>::stage_offset;
    });
    const int stages = detail::stages_for(e.device, registers, 4, 4, [&](int n) { return stage_offset + 1024 + n * pair; });
    if (stages == 0) {
      e.bulk_copy = false;  // not even one page pair per warp fits: plain loads
      return;
    }
    s.stages = stages;
  }

  /// The group size is a run-time value of this kernel: instantiations per (type, head_dim, Pi).
  template <class Shapes, bool Logits = false, class F>
  static void with_decode_kernel(const state& s, const format_type& f, const device_context& e, bool row_masks, F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const int stage_bytes = static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      dispatch_partition_of<head_dim>(f.partition, [&](auto partition) {
        constexpr int pi = decltype(partition)::value;
        using layout = kernel::quant_decode_layout<head_dim, pi, format_type>;
        // Row masks and logits: their own instantiations (an engine takes the logit-writing ones
        // only, where its selector reads token scores).
        if (e.bulk_copy && row_masks)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, true, true, Logits>, 128,
               layout::bytes(stage_bytes, s.stages));
        else if (e.bulk_copy)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, true, false, Logits>, 128,
               layout::bytes(stage_bytes, s.stages));
        else if (row_masks)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, false, true, Logits>, 128,
               layout::bytes(stage_bytes, 1));
        else
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, false, false, Logits>, 128,
               layout::bytes(stage_bytes, 1));
      });
    });
  }

  static params params_for(const state& s, const format_type&, const device_context&) { return params{s.stages}; }

  /// Page ids are read from the block table: no limit.
  static int max_pages_per_split(const state&, const decode_tuning&) { return 1 << 30; }

  /// p is quantized to 8 bits (Eq. 4), not split into 16-bit halves.
  static bool splits_p_on_tensor_cores(const state&, const device_context&) { return false; }

  /// Quantizes `n` completed pages (K and V of every KV head): one CTA per (page, head, K or V);
  /// a sequence's first page is quantized with its sinks hidden (`detail::hides_sink_rows`).
  template <class Shapes>
  static void encode_pages(const state&, const format_type& f, const encode_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    kernel::quant_encode_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.sink_rows = static_cast<int>(g.sink_rows);
    p.sink_slots = c.sink_slots;
    p.new_pages = c.page_ids;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.partition = f.partition;
    p.stochastic = f.mode == format::rounding::stochastic;
    p.seed = f.seed;
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    const int code_bytes = shape.page_size * shape.head_dim;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      const auto encode = kernel::encode_quant_pages_kernel<S, head_dim, format_type>;
      encode<<<grid, kernel::quant_encode_threads, detail::opted_in_shared(encode, code_bytes), e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Unpacks `n` pages to dense rows (a compaction's sources): one CTA per (page, head, K or V).
  template <class Shapes>
  static void unpack_pages(const state&, const format_type& f, const unpack_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const kernel::quant_unpack_params p{c.rows,
                                         static_cast<std::int64_t>(g.tail_slot_bytes()),
                                         static_cast<std::int64_t>(g.tail_head_bytes),
                                         e.pages,
                                         static_cast<std::int64_t>(g.page_slot_bytes()),
                                         static_cast<std::int64_t>(g.k_page_bytes),
                                         c.page_ids,
                                         shape.num_kv_heads,
                                         shape.page_size,
                                         f.partition,
                                         shape.storage};
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto, auto dim, auto) {
      kernel::unpack_quant_pages_kernel<decltype(dim)::value, format_type><<<grid, kernel::quant_unpack_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

 private:
  /// "format::quant2::k_axis" and the like, for messages.
  static const char* k_axis_name() {
    static const std::string name = std::string(kvmosaic::detail::quant_where<Bits, ValueAxis>()) + "::k_axis";
    return name.c_str();
  }
  static const char* partition_name() {
    static const std::string name = std::string(kvmosaic::detail::quant_where<Bits, ValueAxis>()) + "::partition";
    return name.c_str();
  }
  /// Calls f(partition constant) for Pi at most HeadDim.
  template <int HeadDim, class F>
  static void dispatch_partition_of(int partition, F&& f) {
    switch (partition) {
      case 32: return f(std::integral_constant<int, 32>{});
      case 64: return f(std::integral_constant<int, 64>{});
      case 128:
        if constexpr (HeadDim >= 128) return f(std::integral_constant<int, 128>{});
        break;
    }
    kvmosaic::detail::require(false, "cuda::engine", partition_name(), partition, "32, 64 or 128, at most head_dim");
  }
  /// Calls f(head_dim constant, partition constant) for a quantized shape (Pi at most head_dim).
  template <class F>
  static void dispatch_partition(int head_dim, int partition, F&& f) {
    const auto by_partition = [&](auto dim) {
      switch (partition) {
        case 32: return f(dim, std::integral_constant<int, 32>{});
        case 64: return f(dim, std::integral_constant<int, 64>{});
        case 128:
          if constexpr (decltype(dim)::value >= 128) return f(dim, std::integral_constant<int, 128>{});
          break;
      }
      kvmosaic::detail::require(false, "cuda::engine", partition_name(), partition,
                                "32, 64 or 128, at most head_dim");
    };
    switch (head_dim) {
      case 64: return by_partition(std::integral_constant<int, 64>{});
      case 128: return by_partition(std::integral_constant<int, 128>{});
      case 256: return by_partition(std::integral_constant<int, 256>{});
    }
    kvmosaic::detail::require(false, "cuda::engine", "head_dim", head_dim, limits::supported_head_dims);
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/quant/device.cuh> ----

// ---- begin <kvmosaic/cuda/format/packed_bitmap/device.cuh> ----
/// \file
/// format::packed_bitmap (MosaicKV) on the device (cuda/format/device_format.cuh says what a
/// device part provides; a format with segments adds `segment_entry_bytes` and `store_segment`).
/// The segments are planned on the host from the rows the host backend would fit them to (the
/// same `format_traits::plan_segment`, so the same bases), copied into the engine's segment arena,
/// and read by the encode kernel (`encode_packed_pages_kernel`) and the split kernel
/// (`decode_partial_packed_mma_kernel`, PackedAttention on tensor cores with bulk copies, sm_90;
/// `decode_partial_packed_kernel` on CUDA cores elsewhere, sm_75+).



// ---- begin <kvmosaic/cuda/format/packed_bitmap/decode.cuh> ----
/// \file
/// The split kernels of `format::packed_bitmap` (MosaicKV's PackedAttention, section 5.3). Per
/// segment of the pages a split reads, the CTA rotates the group's queries once into the
/// segment's K basis, scores the records in the rotated space (no K tile in global memory),
/// accumulates p.v in the rotated V space and rotates the segment's merged output back once, into
/// the split's state in head_dim space. The engine's plan keeps a `select::all` split within one
/// segment (one rotation each way per split); a selection's pages may span several. Two kernels:
/// on sm_90, `decode_partial_packed_mma_kernel` streams the pages by bulk copies and each warp
/// gathers its MMA fragments straight from the records (`packed_page_rows`); elsewhere (sm_75+),
/// `decode_partial_packed_kernel` scores on CUDA cores from records staged by `cp.async`. The
/// partials merge with `merge_splits_kernel`.

#include <climits>

// ---- begin <kvmosaic/cuda/format/packed_bitmap/rows.cuh> ----
/// \file
/// `format::packed_bitmap` records as a row source of `warp_attend_mma::fold_chunks`
/// (collective/row_sources.cuh): a lane gathers the 8 or 16 rotated channels its MMA fragment
/// holds straight from a token's record (its bitmap of one bit per group of g channels, then its
/// retained 16-bit values, packed in channel order), zeros where no bit is set. No dense tile is
/// written. Cost per chunk pair: the record's bitmap words before the chunk's (popcounts), the
/// group bits spread to one bit per channel, and 16 predicated 16-bit loads.



namespace kvmosaic::cuda {

namespace detail {

/// The low 16 / 2^shift group bits of `groups` spread to one bit per channel: bit i becomes bits
/// [i 2^shift, (i + 1) 2^shift) (shift 0, 1, 2: groups of 1, 2, 4 channels). Morton spreads.
__device__ __forceinline__ std::uint32_t spread_groups(std::uint32_t groups, int shift) {
  if (shift == 0) return groups & 0xffffu;
  if (shift == 1) {
    std::uint32_t x = groups & 0xffu;
    x = (x | (x << 4)) & 0x0f0fu;
    x = (x | (x << 2)) & 0x3333u;
    x = (x | (x << 1)) & 0x5555u;
    return x | (x << 1);
  }
  std::uint32_t x = groups & 0xfu;
  x = (x | (x << 6)) & 0x0303u;
  x = (x | (x << 3)) & 0x1111u;
  return x * 0xfu;
}

}  // namespace detail

/// One head's K or V records of a packed_bitmap page (`kvmosaic::detail::packed_geometry`: the
/// bitmaps [page_size][stride] words, then the values [page_size][retained]), from token `first`
/// on, in the rotated space of the segment the page was sealed in: channel c is kept where bit
/// c >> group_shift of the record is set, and its value is the record's value number
/// (set bits before c's group) << group_shift + c mod g. Channels past the segment's `words`
/// (its kept channels) read as zeros.
template <int HeadDim>
struct packed_page_rows {
  const std::uint32_t* bits;    ///< the page's bitmaps
  const std::uint16_t* page_values;  ///< the page's values
  int stride;                   ///< bitmap words per record of the slot
  int retained;                 ///< values per record of the slot
  int words;                    ///< bitmap words the segment's groups fill (kept / g, rounded up)
  int group_shift;              ///< log2 g
  int first;
  /// `pairs` locates its 16 channels once: `fold_chunks` reads V by it too.
  static constexpr bool gathers_value_pairs = true;

  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint32_t next() { return *value++; }
  };

  /// Channels [8 chunk, 8 chunk + 16) of `token`'s record: the per-channel mask (16 bits) and
  /// the cursor at the value of its first kept channel.
  __device__ __forceinline__ std::uint32_t locate(int token, int chunk, cursor& at) const {
    const int row = first + token;
    const std::uint32_t* record = bits + static_cast<std::size_t>(row) * stride;
    const int bit = (8 * chunk) >> group_shift, word = bit >> 5, shift = bit & 31;
    int before = 0;
#pragma unroll
    for (int w = 0; w < HeadDim / 32; ++w)
      if (w < word && w < words) before += __popc(record[w]);
    const std::uint32_t x = word < words ? record[word] : 0u;
    before += __popc(x & ((1u << shift) - 1u));
    at.value = page_values + static_cast<std::size_t>(row) * retained + (before << group_shift);
    return detail::spread_groups(x >> shift, group_shift);
  }
  __device__ __forceinline__ void pairs(int token, int chunk, uint4 (&x)[2]) const {
    cursor at;
    const std::uint32_t mask = locate(token, chunk, at);
    std::uint32_t v[8];
    load_chunk_values(mask & 0xffu, at, v);
    x[0] = pack_pairs(v);
    at.value += __popc(mask & 0xffu);
    load_chunk_values(mask >> 8, at, v);
    x[1] = pack_pairs(v);
  }
  __device__ __forceinline__ void values(int token, int chunk, std::uint32_t (&v)[8]) const {
    cursor at;
    const std::uint32_t mask = locate(token, chunk, at);
    load_chunk_values(mask & 0xffu, at, v);
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/packed_bitmap/rows.cuh> ----

namespace kvmosaic::cuda::kernel {

/// packed_bitmap's fields of its split kernels' params.
struct packed_decode_params {
  const std::byte* segments;   ///< [max_sequences][segments_per_sequence][num_kv_heads] entries (`packed_entry`)
  std::int32_t* page_segments; ///< [max_pages] the segment (of its sequence) each page was sealed in
  std::int64_t entry_bytes;
  int segments_per_sequence;
  int segment_pages;           ///< pages per segment
  int kept;                    ///< channels of the rotated space
  int words;                   ///< bitmap words per record of a page slot (its stride)
  int retained;                ///< 16-bit values per record of a page slot (its stride)
  std::int64_t bitmap_bytes;   ///< the bitmaps of a page (page_size x words x 4): values follow
  int stages;                  ///< sm_90 kernel: page pairs in flight per CTA (0: the portable kernel)
};

/// One segment of one KV head on the device: B_k ([head_dim][kept] fp32, rotates a query in),
/// B_v transposed ([kept][head_dim] fp32, rotates an output back), then r and g of K and of V.
/// `entry_bytes` = 2 x head_dim x kept x 4 + 16.
struct packed_entry {
  const float* k_basis;
  const float* v_basis_t;
  int retained[2];
  int group[2];

  __host__ __device__ static std::int64_t bytes(int head_dim, int kept) {
    return 2 * static_cast<std::int64_t>(head_dim) * kept * 4 + 16;
  }
  __device__ static packed_entry at(const packed_decode_params& f, int head_dim, int num_kv_heads, int slot, int segment,
                                    int head) {
    const std::byte* base = f.segments + ((static_cast<std::int64_t>(slot) * f.segments_per_sequence + segment) * num_kv_heads + head) *
                                             f.entry_bytes;
    const std::int64_t basis = static_cast<std::int64_t>(head_dim) * f.kept;
    const auto* strategy = reinterpret_cast<const std::int32_t*>(base + 2 * basis * 4);
    return packed_entry{reinterpret_cast<const float*>(base), reinterpret_cast<const float*>(base) + basis,
                        {strategy[0], strategy[2]}, {strategy[1], strategy[3]}};
  }
};

/// Shared memory of the packed kernel: the rotated queries ([kept][Group] fp32), a tile's
/// probabilities ([64][Group]), a segment's merged rotated output ([Group][HeadDim]), the split's
/// state in head_dim space (o [Group][HeadDim], then m, l, the segment's m, l and two warps'
/// partial sums of p, [Group] each), and a tile's K and V records (the bitmaps as stored, at most
/// head_dim / 32 words a token; the values at a padded stride, `padded_values`), whose space the
/// warps' reduction and the tail's reuse.
template <int HeadDim, int Group, int Rows>
struct packed_decode_layout {
  static constexpr int tile_tokens = 64;
  static constexpr int warps = 4;
  static constexpr int query_offset = 0;
  static constexpr int p_offset = query_offset + HeadDim * Group * 4;
  static constexpr int output_offset = p_offset + tile_tokens * Group * 4;
  static constexpr int split_offset = output_offset + Group * HeadDim * 4;
  static constexpr int records_offset = (split_offset + Group * (HeadDim + 6) * 4 + 15) / 16 * 16;
  static constexpr int reduction_bytes = static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>)) >
                                                 warps * Group * HeadDim * 4
                                             ? static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>))
                                             : warps * Group * HeadDim * 4;
  /// One stage: a tile's K records, then its V records, each the bitmaps (`words` a token) and
  /// the values at a stride of `padded_values(retained)`.
  __host__ __device__ static constexpr int stage_bytes(int words, int retained) {
    return 2 * tile_tokens * (words * 4 + ((retained + 1) / 2 * 2 + 2) * 2);
  }
  /// The dynamic shared memory of a launch for a slot of `words` and `retained`.
  __host__ __device__ static constexpr int bytes(int words, int retained) {
    return records_offset + (2 * stage_bytes(words, retained) > reduction_bytes ? 2 * stage_bytes(words, retained) : reduction_bytes);
  }
};

namespace detail_packed {

/// Token t's record of a K or V page: its bitmap words and its 16-bit values.
struct record {
  const std::uint32_t* bits;
  const std::uint16_t* values;
};
__device__ __forceinline__ record record_of(const packed_decode_params& f, const std::byte* page, int t) {
  return record{reinterpret_cast<const std::uint32_t*>(page) + static_cast<std::size_t>(t) * f.words,
                reinterpret_cast<const std::uint16_t*>(page + f.bitmap_bytes) + static_cast<std::size_t>(t) * f.retained};
}

/// Starts copying `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared
/// memory, the CTA's threads striding over 16-byte words (`detail::async_copy`: in flight until
/// `detail::async_copy_wait`).
template <int Threads>
__device__ __forceinline__ void copy_to_shared(const std::byte* from, std::byte* to, int bytes) {
  for (int i = static_cast<int>(threadIdx.x); i < bytes / 16; i += Threads)
    detail::async_copy<16>(to + static_cast<std::size_t>(i) * 16, from + static_cast<std::size_t>(i) * 16);
}

/// Starts copying the values of `n` records (`retained` 16-bit values each, contiguous in global
/// memory) to shared memory with a record stride of `padded_values(retained)` values: whole
/// 32-bit words and one more, so the threads that read one record each, at about the same
/// offset, hit different banks.
__host__ __device__ constexpr int padded_values(int retained) { return (retained + 1) / 2 * 2 + 2; }
template <int Threads>
__device__ __forceinline__ void copy_values_padded(const std::byte* from, std::uint16_t* to, int n, int retained) {
  const int stride = padded_values(retained);
  if (retained % 2 == 0) {
    const int words = retained / 2;
    for (int i = static_cast<int>(threadIdx.x); i < n * words; i += Threads)
      detail::async_copy<4>(reinterpret_cast<std::uint32_t*>(to) + i / words * (stride / 2) + i % words,
                            reinterpret_cast<const std::uint32_t*>(from) + i);
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < n * retained; i += Threads)
      to[i / retained * stride + i % retained] = __ldg(reinterpret_cast<const std::uint16_t*>(from) + i);
  }
}

/// The group's logits of one token: q' . y^ over its record's set bits (groups of `G` channels),
/// q' the rotated, pre-scaled queries in shared memory ([kept][Group]). Cost: r x Group FMAs and
/// one pass over the bitmap.
template <class T, int Group, int G>
__device__ __forceinline__ void score_record(const std::uint32_t* bits, const std::uint16_t* values, int words,
                                             const float* q_rotated, float (&logit)[Group]) {
#pragma unroll
  for (int g = 0; g < Group; ++g) logit[g] = 0.0f;
  int at = 0;
  for (int w = 0; w < words; ++w)
    for (std::uint32_t word = bits[w]; word != 0; word &= word - 1) {
      const int j = w * 32 + __ffs(static_cast<int>(word)) - 1;
#pragma unroll
      for (int i = 0; i < G; ++i, ++at) {
        const float value = to_float(T::from_bits(values[at]));
        const float* q = q_rotated + (j * G + i) * Group;
#pragma unroll
        for (int g = 0; g < Group; ++g) logit[g] = fmaf(q[g], value, logit[g]);
      }
    }
}

/// One token's p.v into a lane's accumulators: lane l owns the rotated channels c = 32 k + l; in
/// groups of `G` channels, channel c is bit (c / G) mod 32 of bitmap word k / G (G divides 32),
/// and its value's index is G x (the set bits before its group) + c mod G. Channels from `kept`
/// on are not stored. Cost per lane: head_dim / 32 bit tests and popcounts, Group FMAs per set one.
template <class T, int HeadDim, int Group, int G>
__device__ __forceinline__ void accumulate_record(const std::uint32_t* bits, const std::uint16_t* values, int words, int kept,
                                                  int lane, const float (&p)[Group], float (&acc)[HeadDim / 32][Group]) {
  constexpr int lane_channels = HeadDim / 32;
  constexpr int word_count = (lane_channels + G - 1) / G;  // the words the lane's channels lie in
  std::uint32_t word[word_count];
  int below[word_count];
  int count = 0;
#pragma unroll
  for (int x = 0; x < word_count; ++x) {
    word[x] = x < words ? bits[x] : 0u;
    below[x] = count;
    count += __popc(word[x]);
  }
#pragma unroll
  for (int k = 0; k < lane_channels; ++k) {
    const int c = k * 32 + lane, b = (c / G) & 31;
    const std::uint32_t wk = word[k / G];
    if (c < kept && ((wk >> b) & 1u) != 0) {
      const int at = (below[k / G] + __popc(wk & ((1u << b) - 1u))) * G + c % G;
      const float value = to_float(T::from_bits(values[at]));
#pragma unroll
      for (int g = 0; g < Group; ++g) acc[k][g] = fmaf(p[g], value, acc[k][g]);
    }
  }
}

/// Calls f(std::integral_constant<int, g>) for a group size g of 1, 2 or 4.
template <class F>
__device__ __forceinline__ void with_group(int group, F&& f) {
  if (group == 1) f(std::integral_constant<int, 1>{});
  else if (group == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 4>{});
}

/// A packed split's state in head_dim space in shared memory (o [Group][HeadDim], then m, l) and
/// the (m, l) of the segment being merged into it ([Group] each, after l): `Group x (HeadDim + 4)`
/// floats from `o` on. Every thread of the CTA calls its members.
template <int HeadDim, int Group, int Threads>
struct split_state {
  float* o;
  __device__ __forceinline__ float* m() const { return o + Group * HeadDim; }
  __device__ __forceinline__ float* l() const { return m() + Group; }
  __device__ __forceinline__ float* segment_m() const { return l() + Group; }
  __device__ __forceinline__ float* segment_l() const { return segment_m() + Group; }

  /// The empty state. A barrier must follow before it is read.
  __device__ __forceinline__ void start() const {
    for (int index = static_cast<int>(threadIdx.x); index < Group * HeadDim; index += Threads) o[index] = 0.0f;
    if (threadIdx.x < Group) {
      m()[threadIdx.x] = -HUGE_VALF;
      l()[threadIdx.x] = 0.0f;
    }
  }

  /// Merges a segment's output into the state: o_seg = rotated B_v^T (`rotated`: [Group][HeadDim]
  /// in shared memory, its first `kept` channels; `basis` B_v transposed, [kept][HeadDim], or null
  /// for an output already in head_dim space) with the segment's (m, l). A thread takes output
  /// channels c for every head, so each basis element is loaded once (coalesced along c) and used
  /// Group times. Cost: Group x head_dim x kept FMAs, head_dim x kept loads, one barrier; a
  /// barrier must follow before the state is read.
  __device__ __forceinline__ void merge_segment(const float* rotated, const float* basis, int kept) const {
    for (int c = static_cast<int>(threadIdx.x); c < HeadDim; c += Threads) {
      float out[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) out[g] = basis == nullptr ? rotated[g * HeadDim + c] : 0.0f;
      if (basis != nullptr) {
#pragma unroll 16
        for (int j = 0; j < kept; ++j) {
          const float b = __ldg(basis + j * HeadDim + c);
#pragma unroll
          for (int g = 0; g < Group; ++g) out[g] = fmaf(rotated[g * HeadDim + j], b, out[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < Group; ++g) {
        softmax_state<float> split{m()[g], l()[g]};
        const merge_weights<float> mw = split.merge(softmax_state<float>{segment_m()[g], segment_l()[g]});
        o[g * HeadDim + c] = o[g * HeadDim + c] * mw.self + out[g] * mw.other;
      }
    }
    __syncthreads();  // every thread has read m and l
    if (threadIdx.x < Group) {
      softmax_state<float> split{m()[threadIdx.x], l()[threadIdx.x]};
      split.merge(softmax_state<float>{segment_m()[threadIdx.x], segment_l()[threadIdx.x]});
      m()[threadIdx.x] = split.m;
      l()[threadIdx.x] = split.l;
    }
  }

  /// The split's partial: o / l and its log-sum-exp (an empty split, every row masked, writes the
  /// empty state, which merges as nothing). After a barrier.
  __device__ __forceinline__ void write(const decode_params& p, int work_index, int head) const {
    const int num_q_heads = p.num_kv_heads * Group;
    const std::size_t partial_base = static_cast<std::size_t>(work_index) * num_q_heads + head * Group;
    for (int index = static_cast<int>(threadIdx.x); index < Group * HeadDim; index += Threads) {
      const int g = index / HeadDim;
      const softmax_state<float> split{m()[g], l()[g]};
      p.partial_o[(partial_base + g) * HeadDim + index % HeadDim] = split.l > 0.0f ? o[index] / split.l : 0.0f;
      if (index % HeadDim == 0) p.partial_lse[partial_base + g] = split.log_sum_exp();
    }
  }
};

}  // namespace detail_packed

/// The packed_bitmap split kernel (sm_75+). Grid: (splits capacity, num_kv_heads); 128 threads.
/// Per segment of the split's pages: q' = scale x q B_k (Group x head_dim x kept FMAs). Per
/// 64-token tile the CTA stages the K and V records in shared memory as stored (coalesced), one
/// thread per token scores its K record on its set bits, the tile's softmax step is taken once
/// for the CTA, and each warp accumulates p.v for a quarter of the tokens straight from the V
/// records: lane l owns the rotated channels l, l + 32, ..., finds its bit in the token's bitmap
/// and its value by the popcount of the bits below it (no dense tile: r x Group FMAs a token). At
/// the segment's end (`leave_segment`) the warps' accumulators add up in shared memory and o =
/// o' B_v^T (Group x head_dim x kept FMAs) merges into the split's state in head_dim space. A
/// split without pages reads the exact rows and the tail, dense, as `decode_partial_kernel`.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_packed_kernel(const split_params<packed_decode_params> p) {
  static_assert(Threads == 128, "the packed kernel runs 4 warps");
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  constexpr int rows = collective::rows;
  using layout = packed_decode_layout<HeadDim, Group, rows>;
  constexpr int tile = layout::tile_tokens, warps = layout::warps;
  constexpr int lane_channels = HeadDim / 32;  // rotated channels a lane owns: kept <= head_dim
  extern __shared__ __align__(16) std::byte packed_shared[];
  float* q_rotated = reinterpret_cast<float*>(packed_shared + layout::query_offset);
  float* tile_p = reinterpret_cast<float*>(packed_shared + layout::p_offset);  // [tile][Group]
  float* o_rotated = reinterpret_cast<float*>(packed_shared + layout::output_offset);
  const detail_packed::split_state<HeadDim, Group, Threads> split{reinterpret_cast<float*>(packed_shared + layout::split_offset)};
  float* segment_m = split.segment_m();  // the segment's running (m, l), [Group] each
  float* segment_l = split.segment_l();
  float* rescale = segment_l + Group;  // the tile's partial sums of p, [2][Group]
  std::byte* records = packed_shared + layout::records_offset;  // two stages of a tile's K and V records
  float* warp_o = reinterpret_cast<float*>(records);  // [warps][Group][HeadDim], after a segment's tiles

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);

  if (range.begin == range.end) {  // the exact rows and the tail rows, dense, in head_dim space
    thread_state<Group> s;
    detail_decode::start_state<HeadDim, Group, collective::lanes_per_row>(p, w, head, s);
    if (w.with_tail) {
      const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
      const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                              static_cast<std::size_t>(run.first) * HeadDim * 2;
      collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s);
    }
    detail_decode::write_partial<HeadDim, Group, Threads, collective::lanes_per_row>(
        p, work_index, head, s, *reinterpret_cast<decode_temp_storage<Group, HeadDim, rows>*>(records));
    return;
  }

  const packed_decode_params& f = p.format;
  const int kept = f.kept, slot_index = p.tail_slots[w.batch_index];
  const int stride = detail_packed::padded_values(f.retained);
  const int stage_bytes = layout::stage_bytes(f.words, f.retained);
  const int num_q_heads = p.num_kv_heads * Group;
  const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group) * HeadDim;
  split.start();
  float acc[lane_channels][Group];  // this warp's p.v for the lane's channels, relative to segment_m
#pragma unroll
  for (int k = 0; k < lane_channels; ++k)
#pragma unroll
    for (int g = 0; g < Group; ++g) acc[k][g] = 0.0f;

  // Enters a segment: q' = scale x q B_k, [kept][Group], a thread per rotated channel j for every
  // head (each element of B_k loaded once, coalesced along j), and an empty state.
  const auto enter_segment = [&](const packed_entry& segment) {
    for (int j = tid; j < kept; j += Threads) {
      float dot[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) dot[g] = 0.0f;
#pragma unroll 16
      for (int c = 0; c < HeadDim; ++c) {
        const float b = __ldg(segment.k_basis + c * kept + j);
#pragma unroll
        for (int g = 0; g < Group; ++g) dot[g] = fmaf(__ldg(q + g * HeadDim + c), b, dot[g]);
      }
#pragma unroll
      for (int g = 0; g < Group; ++g) q_rotated[j * Group + g] = dot[g] * p.softmax_scale;
    }
    if (tid < Group) {
      segment_m[tid] = -HUGE_VALF;
      segment_l[tid] = 0.0f;
    }
    __syncthreads();
  };
  // The warps' accumulators to shared memory (the records' space: every thread calls it after
  // the last tile's barrier), and zero. Not in a lambda: `acc` stays in registers.
#define KVMOSAIC_PACKED_STORE_ACCUMULATORS()                                                   \
  do {                                                                                          \
    _Pragma("unroll") for (int k = 0; k < lane_channels; ++k) {                                \
      _Pragma("unroll") for (int g = 0; g < Group; ++g) {                                      \
        warp_o[(warp * Group + g) * HeadDim + k * 32 + lane] = acc[k][g];                      \
        acc[k][g] = 0.0f;                                                                       \
      }                                                                                         \
    }                                                                                           \
  } while (false)
  // Leaves a segment: the warps' accumulators (in warp_o) added up (rotated V space), rotated
  // back once and merged into the split's state.
  const auto leave_segment = [&](const packed_entry& segment) {
    __syncthreads();
    for (int index = tid; index < Group * kept; index += Threads) {
      const int g = index / kept, c = index % kept;
      float o = 0.0f;
#pragma unroll
      for (int v = 0; v < warps; ++v) o += warp_o[(v * Group + g) * HeadDim + c];
      o_rotated[g * HeadDim + c] = o;
    }
    __syncthreads();
    split.merge_segment(o_rotated, segment.v_basis_t, kept);
    __syncthreads();
  };

  // The split's pages segment by segment, in increasing order: a selection's page list may
  // interleave segments, and each entry and exit costs a rotation.
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  for (int current = -1;;) {
    int next = INT_MAX;
    for (int i = range.begin; i < range.end; ++i) {
      const int page_segment = f.page_segments[table[i]];
      if (page_segment > current && page_segment < next) next = page_segment;
    }
    if (next == INT_MAX) break;
    current = next;
    const packed_entry segment = packed_entry::at(f, HeadDim, p.num_kv_heads, slot_index, current, head);
    enter_segment(segment);
    const int k_words = (kept / segment.group[0] + 31) / 32, v_words = (kept / segment.group[1] + 31) / 32;
    // The segment's tiles (entry i, first row), the next one's records in flight while a tile is
    // folded: two stages of K and V records.
    const auto next_entry = [&](int i) {
      while (i < range.end && f.page_segments[table[i]] != current) ++i;
      return i;
    };
    const auto stage_tile = [&](int i, int first, int stage) {
      const std::byte* slot = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
      const std::byte* k_page = slot + head * p.k_page_bytes;
      const std::byte* v_page = slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes;
      const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
      std::byte* k_stage = records + stage * stage_bytes;
      std::byte* v_stage = k_stage + stage_bytes / 2;
      const int n = min(tile, p.page_size - first);
      // The bitmaps as stored, the values at a padded stride (`copy_values_padded`), 16 rows at a
      // time, skipping the blocks of 16 rows a selection's row masks leave out entirely (their
      // logits are -inf and their p 0 below).
      for (int block = 0; block < n; block += 16) {
        if (detail_decode::sixteen_rows_read(rows_read, first + block) == 0) continue;
        const std::size_t row = static_cast<std::size_t>(first + block);
        for (int which = 0; which < 2; ++which) {
          const std::byte* page = which == 0 ? k_page : v_page;
          std::byte* to = which == 0 ? k_stage : v_stage;
          detail_packed::copy_to_shared<Threads>(page + row * f.words * 4, to + block * f.words * 4, 16 * f.words * 4);
          detail_packed::copy_values_padded<Threads>(page + f.bitmap_bytes + row * f.retained * 2,
                                                     reinterpret_cast<std::uint16_t*>(to + tile * f.words * 4) + block * stride, 16,
                                                     f.retained);
        }
      }
      detail::async_copy_commit();
    };
    int i = next_entry(range.begin), first = 0, stage = 0;
    if (i < range.end) stage_tile(i, 0, 0);
    while (i < range.end) {
      int next_i = i, next_first = first + tile;
      if (next_first >= p.page_size) {
        next_i = next_entry(i + 1);
        next_first = 0;
      }
      if (next_i < range.end) {
        stage_tile(next_i, next_first, stage ^ 1);
        detail::async_copy_wait<1>();  // this tile's copies are done, the next tile's in flight
      } else {
        detail::async_copy_wait<0>();
      }
      __syncthreads();
      const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
      const int n = min(tile, p.page_size - first);
      const std::byte* k_records = records + stage * stage_bytes;
      const std::byte* v_records = k_records + stage_bytes / 2;
      const auto* k_values = reinterpret_cast<const std::uint16_t*>(k_records + tile * f.words * 4);
      const auto* v_values = reinterpret_cast<const std::uint16_t*>(v_records + tile * f.words * 4);
      // Logits, one thread per token (tile <= 64: warps 0 and 1).
      float logit[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) logit[g] = -HUGE_VALF;
      if (tid < n) {
        const int row = first + tid;
        if (rows_read == nullptr || ((rows_read[row >> 5] >> (row & 31)) & 1u) != 0)
          detail_packed::with_group(segment.group[0], [&](auto g) {
            detail_packed::score_record<T, Group, decltype(g)::value>(reinterpret_cast<const std::uint32_t*>(k_records) + tid * f.words,
                                                                      k_values + tid * stride, k_words, q_rotated, logit);
          });
      }
      // The tile's softmax step, once for the CTA: the max and the sum of p by warp shuffles.
      if (warp < 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          float m = logit[g];
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
          if (lane == 0) tile_p[warp * Group + g] = m;  // tile_p is free until the p are written
        }
      }
      __syncthreads();
      float m_new[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) m_new[g] = fmaxf(segment_m[g], fmaxf(tile_p[g], tile_p[Group + g]));
      __syncthreads();  // every thread has read the maxima
      if (warp < 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          const float pt = logit[g] == -HUGE_VALF ? 0.0f : __expf(logit[g] - m_new[g]);
          if (tid < n) tile_p[tid * Group + g] = pt;
          float sum = pt;
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
          if (lane == 0) rescale[warp * Group + g] = sum;  // [2][Group] partial sums, after rescale's [Group]
        }
      }
      float factor[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) factor[g] = segment_m[g] == -HUGE_VALF ? 0.0f : __expf(segment_m[g] - m_new[g]);
      __syncthreads();
      if (tid < Group) {
        segment_l[tid] = segment_l[tid] * factor[tid] + rescale[tid] + rescale[Group + tid];
        segment_m[tid] = m_new[tid];
      }
      // p.v: warp `warp` takes tokens warp, warp + 4, ...; lane owns channels lane + 32 k.
#pragma unroll
      for (int g = 0; g < Group; ++g)
#pragma unroll
        for (int k = 0; k < lane_channels; ++k) acc[k][g] *= factor[g];
      detail_packed::with_group(segment.group[1], [&](auto g) {
        for (int t = warp; t < n; t += warps) {
          const int row = first + t;
          if (rows_read != nullptr && ((rows_read[row >> 5] >> (row & 31)) & 1u) == 0) continue;  // p = 0
          float pt[Group];
#pragma unroll
          for (int x = 0; x < Group; ++x) pt[x] = tile_p[t * Group + x];
          detail_packed::accumulate_record<T, HeadDim, Group, decltype(g)::value>(
              reinterpret_cast<const std::uint32_t*>(v_records) + t * f.words, v_values + t * stride, v_words, kept, lane, pt, acc);
        }
      });
      __syncthreads();  // this stage and tile_p are free for the tile after next
      i = next_i;
      first = next_first;
      stage ^= 1;
    }
    KVMOSAIC_PACKED_STORE_ACCUMULATORS();
    leave_segment(segment);
  }
#undef KVMOSAIC_PACKED_STORE_ACCUMULATORS

  split.write(p, work_index, head);
}


/// Dynamic shared memory of the sm_90 packed kernel: barriers, the query tiles, a segment's
/// rotated queries or merged rotated output ([Group][HeadDim] fp32), the split's state in
/// head_dim space (o, then m, l and the segment's m, l), the warps' states at a segment's end
/// (`decode_temp_storage`: not the slots, which hold the next segment's pages in flight), then
/// `stages` page pairs (K and V records of one head, as stored). One formula for the kernel and
/// for the host's choice of stages.
template <int HeadDim, int Group>
struct packed_mma_layout {
  static constexpr int max_stages = 4;
  static constexpr int full_offset = 0;      ///< `max_stages` mbarriers: a slot's pages have landed
  static constexpr int empty_offset = 32;    ///< `max_stages` mbarriers: the 4 warps are done with a slot
  static constexpr int segment_offset = 64;  ///< `max_stages` ints: the segment of a slot's page
  static constexpr int query_offset = 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int rotated_offset = query_offset + query_bytes;
  static constexpr int split_offset = rotated_offset + Group * HeadDim * 4;
  static constexpr int temp_offset = (split_offset + Group * (HeadDim + 4) * 4 + 15) / 16 * 16;
  static constexpr int temp_bytes = 4 * Group * HeadDim * 4 + 2 * 4 * Group * 4;
  static constexpr int slots_offset = (temp_offset + temp_bytes + 127) / 128 * 128;
  static_assert(sizeof(decode_temp_storage<Group, HeadDim, 4>) == temp_bytes, "the warps' states: 4 rows");
  __host__ __device__ static constexpr int bytes(int pair_bytes, int stages) { return slots_offset + stages * pair_bytes; }
};

/// CTAs per SM the sm_90 packed kernel's registers are bounded for (`__launch_bounds__`): five at
/// head_dim 128 with groups of 4 or fewer, as bitmap_tiles' row-chunk kernel.
constexpr int packed_mma_min_ctas(int head_dim, int group) { return head_dim == 128 && group <= 4 ? 5 : 0; }

/// The sm_90 packed_bitmap split kernel (MosaicKV's PackedAttention on tensor cores). Thread 0
/// streams the split's K and V pages of the head into `p.format.stages` shared slots with bulk
/// copies (one per page and cache, completing on an mbarrier), recording each page's segment.
/// Per segment the CTA rotates the group's queries once (q' = scale x q B_k, split into hi + lo
/// halves in T as the dense path does) and each of the 4 warps folds its 16 tokens of every 64
/// straight from the records in the slot: its lanes gather the rotated channels their MMA
/// fragments hold (`packed_page_rows`, `warp_attend_mma::fold_chunks`), so q'.k and p.v' are
/// MMAs over zero-filled fragments and no dense tile is written. At a segment's end the warps'
/// states merge, o = o' B_v^T once, and the result merges into the split's state; then the dense
/// tail, if the split has it, is folded in head_dim space. Grid: (splits capacity, num_kv_heads).
/// Cost per 16 tokens and warp: the MMAs of the dense kernel over head_dim channels plus, per
/// lane, 2 x head_dim / 64 K and 2 x head_dim / 64 V gathers of 16 channels (4 of 8 for V at
/// head_dim 64); per segment 2 x Group x head_dim x kept FMAs and five CTA barriers.
template <class T, int HeadDim, int Group>
__global__ void __launch_bounds__(128, packed_mma_min_ctas(HeadDim, Group)) decode_partial_packed_mma_kernel(const __grid_constant__ split_params<packed_decode_params> p) {
  constexpr int threads = 128, warps = 4, tokens = 64;
  using layout = packed_mma_layout<HeadDim, Group>;
  using attend = warp_attend_mma<T, HeadDim, Group, tokens, operand_path::row_chunks>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");
  static_assert(layout::query_bytes >= Group * HeadDim * 4, "the query tiles hold q transposed while a segment opens");
  extern __shared__ __align__(128) std::byte packed_mma_shared[];
  std::byte* shared = packed_mma_shared;
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::full_offset);
  auto* empty = reinterpret_cast<std::uint64_t*>(shared + layout::empty_offset);
  auto* slot_segment = reinterpret_cast<std::int32_t*>(shared + layout::segment_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  float* rotated = reinterpret_cast<float*>(shared + layout::rotated_offset);  // [Group][HeadDim]
  const detail_packed::split_state<HeadDim, Group, threads> split{reinterpret_cast<float*>(shared + layout::split_offset)};
  temp_storage& temp = *reinterpret_cast<temp_storage*>(shared + layout::temp_offset);
  std::byte* slots = shared + layout::slots_offset;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  const packed_decode_params& f = p.format;
  const int stages = f.stages, kept = f.kept, slot_index = p.tail_slots[w.batch_index];
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int pair_bytes = k_bytes + v_bytes;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  const int num_q_heads = p.num_kv_heads * Group;
  const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group) * HeadDim;
  if (tid == 0)
    for (int b = 0; b < stages; ++b) {
      detail::barrier_init(&full[b], 1);
      detail::barrier_init(&empty[b], warps);
    }
  // Thread 0: split page i's K and V records into slot i % stages, and its segment (visible to
  // the warps once they have waited on the slot's barrier); pages are issued in order. The page
  // ids and segments are loaded ahead (the next page's segment, the id of the one after), so a
  // refill waits on neither of its two dependent global loads.
  std::int32_t next_id = 0, next_segment = 0, later_id = 0;
  if (tid == 0 && num_pages > 0) {
    next_id = table[0];
    next_segment = f.page_segments[next_id];
    if (num_pages > 1) later_id = table[1];
  }
  const auto issue = [&](int i) {
    const int slot = i % stages;
    const std::int32_t page_id = next_id;
    slot_segment[slot] = next_segment;
    const std::byte* page = p.pages + static_cast<std::size_t>(page_id) * p.page_slot_bytes;
    detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(pair_bytes));
    std::byte* destination = slots + slot * pair_bytes;
    detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
    detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                static_cast<std::uint32_t>(v_bytes), &full[slot]);
    if (i + 1 < num_pages) {
      next_id = later_id;
      next_segment = f.page_segments[next_id];
    }
    if (i + 2 < num_pages) later_id = table[i + 2];
  };
  split.start();
  __syncthreads();  // the barriers are initialized
  if (tid == 0)
    for (int i = 0; i < min(stages, num_pages); ++i) issue(i);

  attend state;
  // Ends a segment (every thread): the warps' states merge (rotated V space, or head_dim space
  // for the tail: `basis` null), o = o' B_v^T, and the result merges into the split's state.
  const auto close_segment = [&](const float* basis) {
    state.store(temp, warp);
    __syncthreads();
    for (int index = tid; index < Group * HeadDim; index += threads) {
      const int g = index / HeadDim, c = index % HeadDim;
      softmax_state<float> total;
      float o = 0.0f;
#pragma unroll
      for (int r = 0; r < warps; ++r) {
        const merge_weights<float> mw = total.merge(softmax_state<float>{temp.m[r][g], temp.l[r][g]});
        o = o * mw.self + temp.o[r][g][c] * mw.other;
      }
      rotated[index] = o;
      if (c == 0) {
        split.segment_m()[g] = total.m;
        split.segment_l()[g] = total.l;
      }
    }
    __syncthreads();
    split.merge_segment(rotated, basis, kept);
  };
  // Starts a segment (every thread; the query tiles are free): q' = scale x q B_k in the
  // segment's rotated channels, zero past `kept` (or q itself for the tail: `basis` null).
  const auto open_segment = [&](const float* basis) {
    if (basis == nullptr) {
      for (int index = tid; index < Group * HeadDim; index += threads) rotated[index] = q[index];
    } else {
      // q transposed ([HeadDim][Group]) into the free query tiles, then a thread per rotated
      // channel j for every head: each basis element is loaded once (coalesced along j) and
      // used Group times.
      float* q_t = reinterpret_cast<float*>(query_tiles);
      for (int index = tid; index < Group * HeadDim; index += threads) q_t[index % HeadDim * Group + index / HeadDim] = q[index];
      __syncthreads();
      for (int j = tid; j < HeadDim; j += threads) {
        float dot[Group];
#pragma unroll
        for (int g = 0; g < Group; ++g) dot[g] = 0.0f;
        if (j < kept) {
#pragma unroll 16
          for (int c = 0; c < HeadDim; ++c) {
            const float b = __ldg(basis + c * kept + j);
#pragma unroll
            for (int g = 0; g < Group; ++g) dot[g] = fmaf(q_t[c * Group + g], b, dot[g]);
          }
        }
#pragma unroll
        for (int g = 0; g < Group; ++g) rotated[g * HeadDim + j] = dot[g];
      }
    }
    __syncthreads();  // rotated is whole, and q_t read, before the query tiles are written
    attend::stage_queries(rotated, p.softmax_scale, query_tiles, threads);
    __syncthreads();
    state.start();
  };

  const int rows_first = warp * 16;  // the warp's rows of every 64
  int current = -1;
  packed_entry segment{};
  packed_page_rows<HeadDim> k_rows{}, v_rows{};
  for (int i = 0; i < num_pages; ++i) {
    const int slot = i % stages;
    detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((i / stages) & 1));
    const int page_segment = slot_segment[slot];
    if (page_segment != current) {  // every warp reaches this page before any leaves it
      if (current >= 0) close_segment(segment.v_basis_t);
      current = page_segment;
      segment = packed_entry::at(f, HeadDim, p.num_kv_heads, slot_index, current, head);
      const int k_shift = segment.group[0] == 1 ? 0 : segment.group[0] == 2 ? 1 : 2;
      const int v_shift = segment.group[1] == 1 ? 0 : segment.group[1] == 2 ? 1 : 2;
      k_rows = packed_page_rows<HeadDim>{nullptr, nullptr, f.words, f.retained, (kept / segment.group[0] + 31) / 32, k_shift, 0};
      v_rows = packed_page_rows<HeadDim>{nullptr, nullptr, f.words, f.retained, (kept / segment.group[1] + 31) / 32, v_shift, 0};
      open_segment(segment.k_basis);
    }
    const std::byte* k_page = slots + slot * pair_bytes;
    const std::byte* v_page = k_page + k_bytes;
    k_rows.bits = reinterpret_cast<const std::uint32_t*>(k_page);
    k_rows.page_values = reinterpret_cast<const std::uint16_t*>(k_page + f.bitmap_bytes);
    v_rows.bits = reinterpret_cast<const std::uint32_t*>(v_page);
    v_rows.page_values = reinterpret_cast<const std::uint16_t*>(v_page + f.bitmap_bytes);
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, range.begin + i);
    for (int first = 0; first < p.page_size; first += tokens) {
      const std::uint32_t rows = detail_decode::sixteen_rows_read(rows_read, first + rows_first) &
                                 attend::rows_before(first + rows_first, p.page_size);
      if (rows != 0) {
        k_rows.first = v_rows.first = first;
        state.fold_chunks(k_rows, v_rows, query_tiles, rows_first, rows);
      }
    }
    // Each warp releases the slot; thread 0 refills it once all four have, while warps 1-3 go on.
    __syncwarp();
    if (lane == 0) detail::barrier_arrive(&empty[slot]);
    if (tid == 0 && i + stages < num_pages) {
      detail::barrier_wait(&empty[slot], static_cast<std::uint32_t>((i / stages) & 1));
      issue(i + stages);
    }
  }
  if (current >= 0) close_segment(segment.v_basis_t);
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run, in head_dim space
    __syncthreads();  // the query tiles are free
    open_segment(nullptr);
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* tail = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    const std::byte* k_tail = tail + head * p.tail_head_bytes;
    const std::byte* v_tail = tail + (p.num_kv_heads + head) * p.tail_head_bytes;
    for (int first = 0; first < run.rows; first += tokens) {
      const std::uint32_t warp_rows = attend::rows_before(first + rows_first, run.rows);
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim * 2;
      if (warp_rows != 0)
        state.fold_chunks(global_dense_rows<HeadDim>{k_tail + skip, run.rows - first},
                          global_dense_rows<HeadDim>{v_tail + skip, run.rows - first}, query_tiles, rows_first, warp_rows);
    }
    close_segment(nullptr);
  }
  __syncthreads();
  split.write(p, work_index, head);
}


}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/packed_bitmap/decode.cuh> ----

// ---- begin <kvmosaic/cuda/format/packed_bitmap/encode.cuh> ----
/// \file
/// Device encode of `format::packed_bitmap` pages (MosaicKV section 5.1) in their segment's
/// basis, the host encoder's records: y = x B (fp32, channels summed in order), the r / g groups
/// of largest energy sum y_c^2 (NaN first, then energy, then the lower group), a bitmap of one
/// bit per group and the kept values rounded to the storage dtype. The host multiplies with
/// Eigen's blocked product, whose summation order differs: a y may differ in its last fp32 bits,
/// so a value may round to the neighbouring 16-bit number and a group whose energy ties the
/// r-th within that difference may be swapped (the GPU test bounds both).



namespace kvmosaic::cuda::kernel {

/// Pages to encode: dense rows in `rows` (slot i = [K: heads][V: heads] x rows_head_bytes, the
/// first page_size rows 16-bit), written packed to page `new_pages[i]` in the segment
/// `segment_entries[i]` (an index of the engine's segment arena, per sequence slot and segment).
struct packed_encode_params {
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* new_pages;
  const std::int32_t* segment_entries;
  int num_kv_heads;
  int page_size;
  packed_decode_params format;
};

constexpr int packed_encode_threads = 128;
/// Tokens whose rotated rows a CTA holds at once.
constexpr int packed_encode_tokens = 16;

/// Grid (pages, num_kv_heads, 2: K then V); static shared memory: the rotated rows and group
/// energies of 16 tokens at kept <= 192 (24 KB).
template <class T, int HeadDim>
__global__ void __launch_bounds__(packed_encode_threads) encode_packed_pages_kernel(const packed_encode_params e) {
  constexpr int max_kept = HeadDim;
  constexpr int tokens = packed_encode_tokens;
  __shared__ float y[tokens][max_kept];
  __shared__ float energy[tokens][max_kept];
  __shared__ std::uint8_t keep[tokens][max_kept];
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int which = static_cast<int>(blockIdx.z);  // 0: K, 1: V
  const int tid = static_cast<int>(threadIdx.x);
  const packed_decode_params& f = e.format;
  const int kept = f.kept;
  const std::int64_t head_at = (static_cast<std::int64_t>(which == 0 ? 0 : e.num_kv_heads) + head) * e.rows_head_bytes;
  const auto* rows = reinterpret_cast<const T*>(e.rows + page_index * e.rows_slot_bytes + head_at);
  std::byte* page = e.pages + static_cast<std::int64_t>(e.new_pages[page_index]) * e.page_slot_bytes +
                    (static_cast<std::int64_t>(which == 0 ? 0 : e.num_kv_heads) + head) * e.page_bytes;
  const std::byte* entry = f.segments + (static_cast<std::int64_t>(e.segment_entries[page_index]) * e.num_kv_heads + head) * f.entry_bytes;
  const std::int64_t basis_floats = static_cast<std::int64_t>(HeadDim) * kept;
  const auto* k_basis = reinterpret_cast<const float*>(entry);
  const auto* v_basis_t = k_basis + basis_floats;
  const auto* strategy = reinterpret_cast<const std::int32_t*>(entry + 2 * basis_floats * 4);
  const int retained = strategy[which * 2], group = strategy[which * 2 + 1];
  if (head == 0 && which == 0 && tid == 0) f.page_segments[e.new_pages[page_index]] = e.segment_entries[page_index] % f.segments_per_sequence;
  const int groups = kept / group, keep_groups = retained / group;

  // The page is zeroed first: a record shorter than the slot leaves the rest zero, as the host's.
  for (std::int64_t i = tid; i < e.page_bytes / 16; i += packed_encode_threads)
    reinterpret_cast<uint4*>(page)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  for (int first = 0; first < e.page_size; first += tokens) {
    const int n = min(tokens, e.page_size - first);
    // y[t][j] = sum_c x[t][c] B[c][j], in channel order.
    for (int index = tid; index < n * kept; index += packed_encode_threads) {
      const int t = index / kept, j = index % kept;
      const T* x = rows + static_cast<std::size_t>(first + t) * HeadDim;
      float acc = 0.0f;
      for (int c = 0; c < HeadDim; ++c) {
        const float b = which == 0 ? k_basis[c * kept + j] : v_basis_t[j * HeadDim + c];
        acc = fmaf(to_float(x[c]), b, acc);
      }
      y[t][j] = acc;
    }
    __syncthreads();
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      float sum = 0.0f;
      for (int i = 0; i < group; ++i) sum = __fadd_rn(sum, __fmul_rn(y[t][j * group + i], y[t][j * group + i]));
      energy[t][j] = sum;
    }
    __syncthreads();
    // A group is kept when fewer than keep_groups groups rank before it.
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      const float mine = energy[t][j];
      int before = 0;
      for (int o = 0; o < groups; ++o) {
        const float other = energy[t][o];
        const bool ranks_before = isnan(other) != isnan(mine) ? isnan(other) : (other > mine || (!(other < mine) && o < j));
        before += o != j && ranks_before ? 1 : 0;
      }
      keep[t][j] = before < keep_groups ? 1 : 0;
    }
    __syncthreads();
    const int words = (groups + 31) / 32;
    for (int index = tid; index < n * words; index += packed_encode_threads) {
      const int t = index / words, wd = index % words;
      std::uint32_t bits = 0;
      for (int b = 0; b < 32 && wd * 32 + b < groups; ++b) bits |= static_cast<std::uint32_t>(keep[t][wd * 32 + b]) << b;
      reinterpret_cast<std::uint32_t*>(page)[static_cast<std::size_t>(first + t) * f.words + wd] = bits;
    }
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      if (keep[t][j] == 0) continue;
      int at = 0;
      for (int o = 0; o < j; ++o) at += keep[t][o];
      auto* values = reinterpret_cast<std::uint16_t*>(page + f.bitmap_bytes) + static_cast<std::size_t>(first + t) * f.retained;
      for (int i = 0; i < group; ++i) values[at * group + i] = T(y[t][j * group + i]).bits;
    }
    __syncthreads();
  }
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/format/packed_bitmap/encode.cuh> ----

namespace kvmosaic::cuda {

template <>
struct device_format<format::packed_bitmap> {
  static constexpr bool encodes_pages = true;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  static constexpr std::int32_t split_page_multiple = 1;
  using params = kernel::packed_decode_params;
  using traits = format_traits<format::packed_bitmap>;

  struct state {
    int stages = 0;               ///< sm_90 kernel: page pairs in flight per CTA (0: the portable kernel)
    device_buffer page_segments;  ///< [max_pages] int32: the segment each page was sealed in (the encoder writes it)
  };

  static void validate(const format::packed_bitmap&, const kvmosaic::detail::engine_shape&) {}

  /// The sm_90 kernel's stages. Under `select::all`, as bitmap_tiles chooses them: as many CTAs
  /// per SM as its registers allow with at least one page pair each, then up to two pairs. Under
  /// a selector, three pairs first, then as many CTAs as fit: a selection's splits hold few,
  /// scattered pages whose copies the kernel waits for, which a third pair in flight hides, while
  /// `select::all` loses more to the fewer CTAs per SM than it would gain (benchmark/README.md,
  /// "format::packed_bitmap's split kernel: per-page and per-segment latency"). Without bulk
  /// copies, or where not one pair fits: the portable kernel (stages = 0).
  template <class Shapes>
  static void configure(state& s, const format::packed_bitmap& f, device_context& e) {
    if (s.page_segments.size() == 0) s.page_segments = device_buffer(static_cast<std::size_t>(e.shape->max_pages) * sizeof(std::int32_t));
    s.stages = 0;
    if (!e.bulk_copy) return;
    s.stages = 1;  // what with_decode_kernel picks the kernel by while its registers are read
    const int pair = static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);
    int registers = 0, slots_offset = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int shared_bytes) {
      registers = detail::registers_of(kernel);
      slots_offset = shared_bytes - pair;  // one stage
    });
    const auto shared_bytes = [&](int stages) { return slots_offset + stages * pair; };
    s.stages = e.selects_pages ? detail::stages_for(e.device, registers, 16, 3, shared_bytes, 3)
                               : detail::stages_for(e.device, registers, 16, 2, shared_bytes);
    if (s.stages == 0) e.bulk_copy = false;
  }

  template <class Shapes, bool /*Logits: its kernels branch on the step at run time*/ = false, class F>
  static void with_decode_kernel(const state& s, const format::packed_bitmap& f, const device_context& e, bool /*row_masks*/,
                                 F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape.page());
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      if (s.stages > 0) {
        const int pair = static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);
        call(kernel::decode_partial_packed_mma_kernel<T, head_dim, group_size>, 128,
             kernel::packed_mma_layout<head_dim, group_size>::bytes(pair, s.stages));
      } else {
        constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
        using collective = page_attend<format::dense, T, head_dim, group_size, t.threads, t.unroll>;
        call(kernel::decode_partial_packed_kernel<T, head_dim, group_size, t.threads, t.unroll>, t.threads,
             kernel::packed_decode_layout<head_dim, group_size, collective::rows>::bytes(g.words, g.retained));
      }
    });
  }

  static params params_for(const state& s, const format::packed_bitmap& f, const device_context& e) {
    const page_shape shape = e.shape->page();
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape);
    return params{e.segments,
                  s.page_segments.as<std::int32_t>(),
                  kernel::packed_entry::bytes(g.head_dim, g.kept),
                  e.segments_per_sequence,
                  traits::segment_pages(f, shape),
                  g.kept,
                  g.words,
                  g.retained,
                  static_cast<std::int64_t>(g.bitmap_bytes()),
                  s.stages};
  }

  static int max_pages_per_split(const state&, const decode_tuning&) { return 1 << 30; }

  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.stages > 0; }

  /// Bytes of one segment of one KV head in the engine's segment arena (`kernel::packed_entry`).
  static std::size_t segment_entry_bytes(const format::packed_bitmap& f, const page_shape& shape) {
    return static_cast<std::size_t>(kernel::packed_entry::bytes(shape.head_dim, traits::basis_dim(f, shape)));
  }
  /// Writes `s` as the device reads it (`kernel::packed_entry`): B_k as it is, B_v transposed,
  /// then r and g of K and of V.
  static void store_segment(const format::packed_bitmap&, const page_shape& shape, const traits::segment& s, std::byte* out) {
    const int d = shape.head_dim, kept = s.kept;
    auto* floats = reinterpret_cast<float*>(out);
    std::memcpy(floats, s.basis[0].data(), static_cast<std::size_t>(d) * kept * sizeof(float));
    float* v_t = floats + static_cast<std::size_t>(d) * kept;
    for (int c = 0; c < d; ++c)
      for (int j = 0; j < kept; ++j) v_t[static_cast<std::size_t>(j) * d + c] = s.basis[1][static_cast<std::size_t>(c) * kept + j];
    const std::int32_t strategy[4] = {s.strategy[0].retained, s.strategy[0].group, s.strategy[1].retained, s.strategy[1].group};
    std::memcpy(v_t + static_cast<std::size_t>(d) * kept, strategy, sizeof strategy);
  }

  /// Packs `n` completed pages (K and V of every KV head) in their segments: one CTA per (page,
  /// head, K or V).
  template <class Shapes>
  static void encode_pages(const state& s, const format::packed_bitmap& f, const encode_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    kernel::packed_encode_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.new_pages = c.page_ids;
    p.segment_entries = c.segment_entries;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.format = params_for(s, f, e);
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      kernel::encode_packed_pages_kernel<decltype(element), decltype(dim)::value><<<grid, kernel::packed_encode_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Compaction of a format with segments is not on the CUDA backend yet (cache.hpp rejects the
  /// combination at compile time); this is never reached.
  template <class Shapes>
  static void unpack_pages(const state&, const format::packed_bitmap&, const unpack_context&) {
    kvmosaic::detail::require(false, "cuda::device_format<packed_bitmap>::unpack_pages", "compactor", "a compactor that moves rows",
                              "compact::none (compaction of format::packed_bitmap runs on backend::host)");
  }
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/format/packed_bitmap/device.cuh> ----
// The selectors' device parts (cuda/select/selection_stage.cuh): one line per selector.

// ---- begin <kvmosaic/cuda/select/quest.cuh> ----
/// \file
/// `select::quest` on the CUDA backend (Quest, Tang et al., ICML 2024): the key bounds of every
/// block of each sealed page and the per-step scoring and top-k, `page_block_selection`'s.

// ---- begin <kvmosaic/cuda/select/page_blocks.cuh> ----
/// \file
/// The CUDA part every selector that scores fixed blocks of each page from a summary kept with the
/// page shares (`select::quest`: key bounds; `select::mean_keys`: mean keys; `block_summary`): the
/// summary of every block of each sealed page, written on the device when the page is sealed (from
/// its exact dense rows, before a format encodes them), and per step a scoring and top-k pass over
/// them (`span_selection`) that writes each KV head's page table, with row masks when blocks are
/// smaller than a page.
///
/// Cost: `summary_rows` x head_dim 16-bit values per block, KV head and page of device memory
/// (counted in `memory_stats`); per sealed page one pass over its K rows; per step the span
/// selection's.



// ---- begin <kvmosaic/cuda/kernel/select_pages.cuh> ----
/// \file
/// The page-selection kernels of a read-less step (`select::quest` with one block per page): they
/// run on the device between the step's metadata copy and the split kernel, with no host round
/// trip, so a selected step is captured in a CUDA graph like a dense one.
///   - `score_pages_kernel`: one warp per 4 or 8 spans of a (sequence, KV head): Quest's bound of
///     q . k from each span's key bounds, or q . mean key, for each query head of the group,
///     combined (select/span_score.hpp gives the fp32 order, which the host backend follows to the
///     bit).
///   - `select_pages_kernel`: one CTA per (sequence, KV head): the budget's top pages (higher
///     score first, ties to the earlier page) by a radix select on the scores' order-preserving
///     keys (4 passes of 8 bits, each a shared-memory histogram), then a block-scan compaction
///     that writes the chosen page ids in sequence order: the split kernel's per-head page table.

#include <cub/block/block_scan.cuh>



namespace kvmosaic::cuda::kernel {

/// What the selection kernels read and write. Tables and scores are rows of the step metadata.
///
/// The scoring kernel sees a sequence as `span_counts[b]` spans with key bounds: span i lies in
/// entry i / spans_per_entry of its span table, whose bounds are a block of `bounds_entry_bytes`:
/// [num_kv_heads][spans_per_entry][lo row, hi row] (or one mean row, `summary_rows` = 1, scored as
/// lo = hi). For `select::quest` and `select::mean_keys` the entries are the pages (spans_per_entry
/// = blocks per page); for `select::sentence_chunks`, blocks of chunk bounds.
struct select_params {
  const std::byte* bounds;            ///< bounds arena, in the storage dtype
  std::int64_t bounds_entry_bytes;    ///< one entry's bounds, every KV head
  int spans_per_entry;
  int summary_rows;                   ///< rows per span: 2 (lo, hi) or 1 (mean)
  const std::int32_t* span_tables;    ///< [batch][span_table_stride] entry ids
  int span_table_stride;
  const std::int32_t* span_counts;    ///< [batch] spans of each sequence
  int score_stride;                   ///< scores of (b, head) at (b * num_kv_heads + head) * score_stride
  const std::int32_t* step_header;    ///< [1] selected-table row stride, [2] its head stride, [3] block-table stride
  const std::int32_t* block_tables;   ///< [batch][header[3]] each sequence's page ids
  const std::int32_t* sealed_pages;   ///< [batch] pages each sequence has
  const std::int32_t* budget_pages;   ///< [batch] pages each KV head reads (at most sealed_pages; whole pages)
  const float* q;                     ///< [batch][num_kv_heads * group_size][head_dim], unscaled
  int num_kv_heads;
  int group_size;
  int combine_sum;                    ///< 1: group_combine::sum, 0: group_combine::max
  float* scores;                      ///< [batch][num_kv_heads][score_stride]
  std::int32_t* selected;             ///< [batch][header[1]]: per KV head, header[2] apart, the chosen page ids

  // Token-granular selection (`select_spans_kernel`) only.
  int span_tokens;                    ///< > 0: span i is tokens [i * span_tokens, (i + 1) * span_tokens)
  const int2* span_ranges;            ///< span_tokens == 0: {begin, end} per span slot (entry * spans_per_entry + k)
  const std::int32_t* budget_tokens;  ///< [batch] tokens each KV head's chosen spans may hold
  const std::int32_t* always_from;    ///< [batch] sealed tokens from here on are read whatever the selection
  int page_size;
  int mask_words;                     ///< 32-bit row-mask words per page
  std::uint32_t* marks;               ///< scratch: [batch][num_kv_heads][header[3]][mask_words]
  std::uint32_t* token_masks;         ///< [batch][header[1]] entries of `selected` (head h at h * header[2]) x mask_words
  std::int32_t* table_lengths;        ///< [batch][num_kv_heads] entries written to `selected`

  /// Evicted tokens (null: none): per (sequence, block-table entry), its live rows
  /// ([batch][header[3]][mask_words]). Both kernels then write each chosen page's row mask ANDed
  /// with its live rows to `token_masks` (page-granular steps too) and the entries to
  /// `table_lengths`, and drop a page left with no row.
  const std::uint32_t* live_masks;
};

/// Warps per CTA of the scoring kernel.
inline constexpr int score_warps = 8;
namespace detail_select {
/// `Count` consecutive 16-bit values as they are stored, with one vector load (Count = 2, 4 or 8).
template <int Count>
using raw_vector = std::conditional_t<Count == 8, uint4, std::conditional_t<Count == 4, uint2, unsigned>>;
template <class T, int Count>
__device__ __forceinline__ raw_vector<Count> load_raw(const T* source) {
  return *reinterpret_cast<const raw_vector<Count>*>(source);
}
/// The values of a `load_raw` as floats.
template <class T, int Count>
__device__ __forceinline__ void to_floats(const raw_vector<Count>& raw, float* out) {
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Count; ++i) out[i] = to_float(values[i]);
}

/// A warp's reduce-scatter of 32 values per lane, `value(i)` giving value i: afterwards lane l
/// holds the sum over the 32 lanes of value l, added in the butterfly order of the canonical
/// reduction (offsets 16, 8, 4, 2, 1: select/span_score.hpp), so each sum has the bits a
/// per-value butterfly would give (addition commutes), for 31 shuffles instead of 160. Values i
/// and i + 16 are asked for together and exchanged at once, so 16 are live at a time.
template <class Value>
__device__ __forceinline__ float reduce_scatter(const Value& value) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float v[16];
  const bool upper16 = (lane & 16) != 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float low = value(i), high = value(i + 16);
    v[i] = __fadd_rn(upper16 ? high : low, __shfl_xor_sync(0xffffffffu, upper16 ? low : high, 16));
  }
#pragma unroll
  for (int half = 8; half >= 1; half /= 2) {  // `half` values stay with the lane; offset = half
    const bool upper = (lane & half) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, half));
    }
  }
  return v[0];
}
}  // namespace detail_select

/// Quest bounds (`SummaryRows` 2: lo and hi rows) or mean-key scores (1: one row, scored as
/// lo = hi) of every span, for groups of up to `Heads` query heads (4 or 8). Each warp scores
/// 32 / Heads consecutive spans (the Heads heads of each: one reduction): their entry ids, then
/// their summaries, are loaded before anything waits on them, and only then are the group's
/// queries staged in shared memory (every warp of the CTA reads the same (sequence, KV head)), so
/// a CTA waits on two loads. Lane l holds channels [l w, (l + 1) w), w = head_dim / 32, and sums
/// them in order; the 32 lanes' partial sums of the warp's (span, head) pairs are then reduced at
/// once (`reduce_scatter`): the canonical order of select/span_score.hpp, which the host backend
/// follows to the bit. Grid: (num_kv_heads, ceil(spans / (score_warps x 32 / Heads)), batch): the
/// KV heads of the same entries side by side, so the CTAs in flight read each entry's summaries
/// (every head's, contiguous) together.
template <class T, int HeadDim, int SummaryRows, int Heads>
__global__ void __launch_bounds__(score_warps * 32) score_pages_kernel(const select_params p) {
  static_assert(SummaryRows == 1 || SummaryRows == 2, "a span's summary: a mean row, or lo and hi rows");
  static_assert(Heads == 4 || Heads == 8, "heads per reduction: 4 (groups of up to 4) or 8");
  constexpr int width = HeadDim / 32;  // contiguous channels per lane: the canonical order
  constexpr int per_warp = 32 / Heads;
  using raw = detail_select::raw_vector<width>;
  __shared__ float queries[8 * HeadDim];  // the group's queries (at most 8 heads)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.z);
  const int spans = p.span_counts[b];  // pages, page blocks or chunks
  const int cta_first = static_cast<int>(blockIdx.y) * score_warps * per_warp;
  if (cta_first >= spans) return;  // the whole CTA: before the barrier below
  const int first = cta_first + warp * per_warp, last = spans - 1;
  // Span first + k (the last span past the end) is block `slot` of entry `entry`: one division,
  // then a step per span.
  const int per_entry = p.spans_per_entry;
  int entry = min(first, last) / per_entry, slot = min(first, last) % per_entry;
  raw low[per_warp], high[per_warp];
#pragma unroll
  for (int k = 0; k < per_warp; ++k) {
    const std::int32_t id = p.span_tables[static_cast<std::size_t>(b) * p.span_table_stride + entry];
    const T* row = reinterpret_cast<const T*>(p.bounds + static_cast<std::size_t>(id) * p.bounds_entry_bytes) +
                   (static_cast<std::size_t>(head) * per_entry + slot) * SummaryRows * HeadDim + lane * width;
    low[k] = detail_select::load_raw<T, width>(row);
    high[k] = SummaryRows == 2 ? detail_select::load_raw<T, width>(row + HeadDim) : low[k];
    if (first + k < last && ++slot == per_entry) {
      slot = 0;
      ++entry;
    }
  }
  const float* q = p.q + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.group_size * HeadDim;
  const int group = p.group_size;
  for (int i = static_cast<int>(threadIdx.x); i < group * HeadDim; i += score_warps * 32) queries[i] = q[i];
  __syncthreads();  // the queries are staged
  if (first >= spans) return;
  float qc[Heads][width];  // this lane's channels of each head (zero past the group: never combined)
#pragma unroll
  for (int g = 0; g < Heads; ++g)
#pragma unroll
    for (int j = 0; j < width; ++j) qc[g][j] = g < group ? queries[g * HeadDim + lane * width + j] : 0.0f;
  float lo[per_warp][width], hi[per_warp][width];
#pragma unroll
  for (int k = 0; k < per_warp; ++k) {
    detail_select::to_floats<T, width>(low[k], lo[k]);
    detail_select::to_floats<T, width>(high[k], hi[k]);
  }
  // Value s x Heads + g: this lane's channels of span s of the warp, head g.
  const auto partial = [&](int index) {
    const int s = index / Heads, g = index % Heads;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < width; ++j)  // no fused multiply-add: the host's order, to the bit
      sum = __fadd_rn(sum, __fmul_rn(qc[g][j], qc[g][j] >= 0.0f ? hi[s][j] : lo[s][j]));
    return sum;
  };
  const float total = detail_select::reduce_scatter(partial);  // span lane / Heads, head lane % Heads
  // The group's heads combined in head order, from the span's first lane.
  const int span_lane = lane / Heads * Heads;
  float combined = __shfl_sync(0xffffffffu, total, span_lane);
  for (int g = 1; g < group; ++g) {
    const float s = __shfl_sync(0xffffffffu, total, span_lane + g);
    combined = p.combine_sum ? __fadd_rn(combined, s) : (s > combined ? s : combined);
  }
  const int span = first + lane / Heads;
  if (lane % Heads == 0 && span < spans)
    p.scores[(static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride + span] = combined;
}

namespace detail_select {
/// An unsigned key with the order of the scores: NaN as -infinity, -0 as +0 (equal scores tie).
__device__ __forceinline__ std::uint32_t order_key(float score) {
  std::uint32_t u = __float_as_uint(score);
  if (score != score) u = 0xff800000u;
  if (score == 0.0f) u = 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

/// Shared memory of `budget_threshold` (its block scan is free for the caller afterwards).
template <int Threads>
struct threshold_storage {
  typename cub::BlockScan<int, Threads>::TempStorage scan;
  int histogram[256];
  std::uint32_t digit;
  int remaining;
};

/// Where a budget runs out along the order of n keys (higher first), each item weighing
/// weight_of(i): the key T such that the items above T weigh at most `budget` and those at or
/// above T more. Found 8 bits at a time from the top: per pass a shared-memory histogram of the
/// weights of the items matching the digits so far, then the digit by a block scan over the bins
/// from the top (thread t < 256 holds bin 255 - t). Returns T; `remaining` is the budget left for
/// the items at T. Needs a total weight above the budget. Whole CTA (256 threads or a multiple:
/// the others scan zeros).
template <int Threads, class KeyAt, class WeightOf>
__device__ __forceinline__ std::uint32_t budget_threshold(int n, int budget, const KeyAt& key_at, const WeightOf& weight_of,
                                                          threshold_storage<Threads>& s, int& remaining) {
  static_assert(Threads % 256 == 0, "a thread per radix bin, and more threads over the items");
  const int tid = static_cast<int>(threadIdx.x);
  std::uint32_t prefix = 0, mask = 0;
  remaining = budget;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) s.histogram[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += Threads) {
      const std::uint32_t key = key_at(i);
      if ((key & mask) == prefix) atomicAdd(&s.histogram[(key >> shift) & 255u], weight_of(i));
    }
    __syncthreads();
    const int weight = tid < 256 ? s.histogram[255 - tid] : 0;
    int at_or_above = 0;
    cub::BlockScan<int, Threads>(s.scan).InclusiveSum(weight, at_or_above);
    if (tid < 256 && at_or_above > remaining && at_or_above - weight <= remaining) {
      s.digit = static_cast<std::uint32_t>(255 - tid);
      s.remaining = remaining - (at_or_above - weight);
    }
    __syncthreads();
    prefix |= s.digit << shift;
    remaining = s.remaining;
    mask |= 255u << shift;
    __syncthreads();  // the histogram and digit are rewritten by the next pass
  }
  return prefix;
}
}  // namespace detail_select

/// Threads per CTA of the selection kernels: four per radix bin, one CTA per (sequence, KV
/// head) walking its spans 1024 at a time.
inline constexpr int select_threads = 1024;

/// Dynamic shared memory of the selection kernel for sequences of up to `max_pages` pages: their
/// keys, while they and the kernel's `static_bytes` of static shared memory fit the 48 KB every
/// architecture allows without opting in (about 10,800 pages: 690K tokens at pages of 64). Longer
/// sequences re-read their scores from L2 at each pass.
inline int select_shared_bytes(int max_pages, int static_bytes) noexcept {
  return max_pages * 4 + static_bytes <= 48 * 1024 ? max_pages * 4 : 0;
}

/// The top budget_pages[b] pages of each (sequence b, KV head), in sequence order (with live masks,
/// each with its live rows as its row mask).
/// Grid: (batch, num_kv_heads); dynamic shared memory: select_shared_bytes(header[3], ...) (0: keys
/// recomputed from the scores in global memory at each pass).
template <int Threads>
__global__ void __launch_bounds__(Threads) select_pages_kernel(const select_params p, int keys_in_shared) {
  static_assert(Threads % 256 == 0, "a thread per radix bin, and more threads over the pages");
  using scan = cub::BlockScan<int, Threads>;
  __shared__ detail_select::threshold_storage<Threads> storage;
  extern __shared__ std::uint32_t shared_keys[];
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int n = p.sealed_pages[b];
  const int k = min(p.budget_pages[b], n);
  std::int32_t* length = p.live_masks != nullptr ? p.table_lengths + static_cast<std::size_t>(b) * p.num_kv_heads + head : nullptr;
  if (k <= 0) {
    if (length != nullptr && tid == 0) *length = 0;
    return;
  }
  const float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride;
  const std::int32_t* table = p.block_tables + static_cast<std::size_t>(b) * p.step_header[3];
  std::int32_t* out = p.selected + static_cast<std::size_t>(b) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2];
  if (keys_in_shared) {
    for (int i = tid; i < n; i += Threads) shared_keys[i] = detail_select::order_key(scores[i]);
    __syncthreads();
  }
  const auto key_at = [&](int i) { return keys_in_shared ? shared_keys[i] : detail_select::order_key(scores[i]); };

  // The key where a budget of k pages runs out; then how many keys equal to it the selection
  // takes (the first ones in sequence order).
  std::uint32_t threshold = 0;
  int ties_to_take = 0;
  if (k < n) threshold = detail_select::budget_threshold(n, k, key_at, [](int) { return 1; }, storage, ties_to_take);
  // Compaction in sequence order.
  int ties_before = 0, written = 0;
  for (int base = 0; base < n; base += Threads) {
    const int i = base + tid;
    const std::uint32_t key = i < n ? key_at(i) : 0u;
    const int is_tie = i < n && k < n && key == threshold;
    int tie_rank = 0, ties = 0;
    scan(storage.scan).ExclusiveSum(is_tie, tie_rank, ties);
    __syncthreads();
    const int chosen = i < n && (k >= n || key > threshold || (is_tie && ties_before + tie_rank < ties_to_take));
    int position = 0, count = 0;
    scan(storage.scan).ExclusiveSum(chosen, position, count);
    if (chosen) {
      out[written + position] = table[i];
      if (p.live_masks != nullptr) {  // every row of a chosen page that is still live
        const std::size_t entry = static_cast<std::size_t>(out - p.selected) + written + position;
        const std::uint32_t* live = p.live_masks + (static_cast<std::size_t>(b) * p.step_header[3] + i) * p.mask_words;
        for (int w = 0; w < p.mask_words; ++w) p.token_masks[entry * p.mask_words + w] = live[w];
      }
    }
    ties_before += ties;
    written += count;
    __syncthreads();
  }
  if (length != nullptr && tid == 0) *length = written;
}

namespace detail_select {
/// Sets the row-mask bits of tokens [from, to) of a sequence whose page p's mask is
/// marks[p * words .. (p + 1) * words): one atomicOr per word touched.
__device__ __forceinline__ void mark_rows(std::uint32_t* marks, int words, int page_size, int from, int to) {
  for (int t = from; t < to;) {
    const int page = t / page_size, row = t % page_size;
    const int word_end = min((row / 32 + 1) * 32, page_size);
    const int n = min(to - t, word_end - row);
    const std::uint32_t bits = (n == 32 ? ~0u : ((1u << n) - 1u)) << (row % 32);
    atomicOr(&marks[page * words + row / 32], bits);
    t += n;
  }
}
}  // namespace detail_select

/// Dynamic shared memory of `select_spans_kernel` to cache the keys and token counts of `spans`
/// spans (6 bytes each), and to hold the row marks of `pages` pages of `mask_words` words.
__host__ __device__ inline int span_select_shared_bytes(int spans) noexcept { return (spans * 6 + 15) / 16 * 16; }
__host__ __device__ inline int span_marks_shared_bytes(int pages, int mask_words) noexcept { return pages * mask_words * 4; }

/// The token-granular selection of each (sequence b, KV head): sub-page `select::quest` blocks or
/// `select::sentence_chunks` chunks. It takes the longest prefix of the spans' score order (higher
/// first, ties to the lower index) whose token counts fit budget_tokens[b] (the host's
/// `detail::budget_prefix`), by a radix select whose histograms count tokens rather than spans
/// (4 passes of 8 bits; the spans at the threshold key then go in index order by a block scan).
/// It marks the rows of the chosen spans and every sealed row from always_from[b] on, per page,
/// then writes the pages with a marked row, in sequence order, with their row masks: the split
/// kernels' table (`table_lengths` entries). Each span's key and token count are read from
/// global memory once, into shared memory, when `cached` (dynamic shared memory:
/// span_select_shared_bytes(spans)); else re-read at each pass. The marks are shared memory
/// after those when `shared_marks` (span_marks_shared_bytes(pages, mask_words) more), else
/// `p.marks`.
/// Grid: (batch, num_kv_heads).
template <int Threads>
__global__ void __launch_bounds__(Threads) select_spans_kernel(const select_params p, int cached, int shared_marks) {
  using scan = cub::BlockScan<int, Threads>;
  __shared__ detail_select::threshold_storage<Threads> storage;
  __shared__ int shared_total;
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int n = p.span_counts[b], sealed = p.sealed_pages[b], words = p.mask_words;
  const int sealed_tokens = sealed * p.page_size;
  const int budget = max(p.budget_tokens[b], 0);
  const float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride;
  const auto range = [&](int i) {
    if (p.span_tokens > 0) return make_int2(i * p.span_tokens, (i + 1) * p.span_tokens);
    const int entry = p.span_tables[static_cast<std::size_t>(b) * p.span_table_stride + i / p.spans_per_entry];
    return p.span_ranges[static_cast<std::size_t>(entry) * p.spans_per_entry + i % p.spans_per_entry];
  };
  // [n] keys, then [n] 16-bit token counts when cached; then the marks when shared.
  extern __shared__ __align__(16) std::uint32_t span_keys[];
  auto* span_tokens = reinterpret_cast<std::uint16_t*>(span_keys + (cached ? n : 0));
  std::uint32_t* marks = shared_marks ? span_keys + (cached ? span_select_shared_bytes(n) / 4 : 0)
                                      : p.marks + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.step_header[3] * words;
  for (int i = tid; i < sealed * words; i += Threads) marks[i] = 0u;
  if (tid == 0) shared_total = 0;
  int mine = 0;
  if (cached) {
#pragma unroll 16
    for (int i = tid; i < n; i += Threads) {  // independent loads: many in flight per thread
      const int2 r = range(i);
      span_keys[i] = detail_select::order_key(scores[i]);
      span_tokens[i] = static_cast<std::uint16_t>(r.y - r.x);
      mine += r.y - r.x;
    }
  } else {
    for (int i = tid; i < n; i += Threads) {
      const int2 r = range(i);
      mine += r.y - r.x;
    }
  }
  __syncthreads();  // marks are zero before anything is marked; the total starts at 0; keys cached
  atomicAdd(&shared_total, mine);
  __syncthreads();
  const bool take_all = shared_total <= budget;
  const auto key_at = [&](int i) { return cached ? span_keys[i] : detail_select::order_key(scores[i]); };
  const auto tokens_of = [&](int i) {
    if (cached) return static_cast<int>(span_tokens[i]);
    const int2 r = range(i);
    return r.y - r.x;
  };

  // The threshold key: the spans above it fit the budget, and adding all those at it would not.
  std::uint32_t threshold = 0;
  int remaining = budget;
  if (!take_all) threshold = detail_select::budget_threshold(n, budget, key_at, tokens_of, storage, remaining);
  // Mark the chosen spans: those above the threshold, and the longest run of those at it (in
  // index order) that fits what is left of the budget.
  int ties_before = 0;
  for (int base = 0; base < n; base += Threads) {
    const int i = base + tid;
    const std::uint32_t key = i < n ? key_at(i) : 0u;
    const int tokens = i < n ? tokens_of(i) : 0;
    const bool is_tie = !take_all && i < n && key == threshold;
    int tie_tokens_before = 0, tie_tokens = 0;
    scan(storage.scan).ExclusiveSum(is_tie ? tokens : 0, tie_tokens_before, tie_tokens);
    const bool chosen = i < n && (take_all || key > threshold ||
                                  (is_tie && ties_before + tie_tokens_before + tokens <= remaining));
    if (chosen) {
      const int2 r = range(i);
      detail_select::mark_rows(marks, words, p.page_size, r.x, min(r.y, sealed_tokens));
    }
    ties_before += tie_tokens;
    __syncthreads();  // the scan storage is reused
  }
  // The always-read rows, 32 tokens per thread and turn.
  const int always_from = max(p.always_from[b], 0);
  for (int t = always_from / 32 * 32 + tid * 32; t < sealed_tokens; t += Threads * 32)
    detail_select::mark_rows(marks, words, p.page_size, max(t, always_from), min(t + 32, sealed_tokens));
  __syncthreads();  // every mark is in

  // The pages with a marked row, in sequence order, with their masks.
  const std::size_t out_row = static_cast<std::size_t>(b) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2];
  int written = 0;
  for (int base = 0; base < sealed; base += Threads) {
    const int i = base + tid;
    std::uint32_t any = 0;
    if (i < sealed)
      for (int w = 0; w < words; ++w) {
        if (p.live_masks != nullptr)  // evicted rows are never read
          marks[i * words + w] &= p.live_masks[(static_cast<std::size_t>(b) * p.step_header[3] + i) * words + w];
        any |= marks[i * words + w];
      }
    int position = 0, count = 0;
    scan(storage.scan).ExclusiveSum(any != 0 ? 1 : 0, position, count);
    if (any != 0) {
      const std::size_t entry = out_row + written + position;
      p.selected[entry] = p.block_tables[static_cast<std::size_t>(b) * p.step_header[3] + i];
      for (int w = 0; w < words; ++w) p.token_masks[entry * words + w] = marks[i * words + w];
    }
    written += count;
    __syncthreads();
  }
  if (tid == 0) p.table_lengths[static_cast<std::size_t>(b) * p.num_kv_heads + head] = written;
}

}  // namespace kvmosaic::cuda::kernel

namespace kvmosaic::cuda::kernel {

/// Where the key bounds of newly sealed pages come from and go.
struct bounds_params {
  const std::byte* rows;              ///< dense rows of the new pages: their page slots, or scratch slots
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;       ///< K rows of KV head h start h * rows_head_bytes into a slot
  const std::int32_t* row_slots;      ///< [n] the slot of `rows` holding new page i
  const std::int32_t* new_pages;      ///< [n] page ids
  std::byte* bounds;                  ///< [max_pages][num_kv_heads][blocks per page][summary rows]
  std::int64_t bounds_page_bytes;
  int block_tokens;                   ///< tokens per block: the page size, or a multiple of 8 dividing it
};

/// The summary of the keys of each block of each new page, per KV head: with `Mean` the mean row
/// (`select::mean_keys`: an fp32 sum in token order divided by the count, the host's
/// `store_mean_key` to the bit), else the channel-wise min and max rows (`select::quest`, the
/// host's `store_key_bounds`). Grid: (n, num_kv_heads, blocks per page), one thread per channel.
template <class T, int HeadDim, bool Mean = false>
__global__ void __launch_bounds__(HeadDim) page_bounds_kernel(const bounds_params p) {
  const int i = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.z), blocks = static_cast<int>(gridDim.z);
  const T* rows = reinterpret_cast<const T*>(p.rows + static_cast<std::size_t>(p.row_slots[i]) * p.rows_slot_bytes +
                                             static_cast<std::size_t>(head) * p.rows_head_bytes) +
                  static_cast<std::size_t>(block) * p.block_tokens * HeadDim;
  if constexpr (Mean) {
    float sum = 0.0f;
    for (int t = 0; t < p.block_tokens; ++t) sum = __fadd_rn(sum, to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]));
    T* out = reinterpret_cast<T*>(p.bounds + static_cast<std::size_t>(p.new_pages[i]) * p.bounds_page_bytes) +
             (static_cast<std::size_t>(head) * blocks + block) * HeadDim;
    out[c] = T(__fdiv_rn(sum, static_cast<float>(p.block_tokens)));
    return;
  }
  float lo = to_float(rows[c]), hi = lo;
  for (int t = 1; t < p.block_tokens; ++t) {
    const float x = to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  T* out = reinterpret_cast<T*>(p.bounds + static_cast<std::size_t>(p.new_pages[i]) * p.bounds_page_bytes) +
           (static_cast<std::size_t>(head) * blocks + block) * 2 * HeadDim;
  out[c] = T(lo);  // exact: lo and hi are stored values
  out[HeadDim + c] = T(hi);
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/select_pages.cuh> ----

// ---- begin <kvmosaic/cuda/select/span_selection.cuh> ----
/// \file
/// The collective of every read-less selection stage that scores *spans* (runs of tokens with the
/// min and max of their keys, select/span_score.hpp) and picks some within a token budget:
/// `span_selection<Shapes>` owns the step's outputs (scores, the chosen page tables, row masks),
/// stages the per-sequence inputs (span counts, token budgets, the always-read region, and a span
/// table when the spans are not the pages) and launches the scoring and top-k kernels
/// (kernel/select_pages.cuh). A stage (`cuda/select/quest.cuh`, `cuda/select/sentence_chunks.cuh`)
/// derives from it, says where its spans' bounds live (`use_source`, once its storage exists) and
/// plans each step (`start`, `add`); the rest of the stage's interface (staging, outputs, launch,
/// read-back) is this class's, the same for both.
///
/// Cost per step: one scoring pass over every span's bounds (2 x head_dim 16-bit values per span
/// and KV head) and a radix top-k per (sequence, KV head); host: O(batch) staging, plus the span
/// tables when the stage has its own.




namespace kvmosaic::cuda {

/// Where a stage's spans and their key bounds live on the device.
struct span_source {
  const std::byte* bounds;          ///< [entries][num_kv_heads][spans_per_entry][summary_rows rows], storage dtype
  std::int64_t entry_bytes;         ///< one entry's bounds, every KV head
  int spans_per_entry;
  int span_tokens;                  ///< > 0: span i is tokens [i * span_tokens, (i + 1) * span_tokens) (entries: pages)
  const int2* ranges;               ///< span_tokens == 0: {begin, end} per span slot (entry * spans_per_entry + k)
  int longest_span;                 ///< tokens of the longest span
  bool own_tables;                  ///< entries from the stage's span tables (else the sequences' block tables)
  int summary_rows = 2;             ///< rows per span: 2 (lo, hi: key bounds) or 1 (a mean key, scored as lo = hi)
};

template <class Shapes>
class span_selection {
 public:
  static constexpr bool selects = true;

  /// `row_masks_possible`: whether any step may pick spans smaller than a page (sizes the
  /// row-mask outputs).
  span_selection(const kvmosaic::detail::engine_shape& shape, bool row_masks_possible)
      : shape_(shape), row_masks_possible_(row_masks_possible) {
    int device = 0, opt_in = 0;
    KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    spans_static_shared_ = detail::static_shared_of(kernel::select_spans_kernel<kernel::select_threads>);
    pages_static_shared_ = detail::static_shared_of(kernel::select_pages_kernel<kernel::select_threads>);
    max_dynamic_shared_ = opt_in - spans_static_shared_;
  }

  /// Row-mask words per page: ceil(page_size / 32).
  int mask_words() const noexcept { return (shape_.page_size + 31) / 32; }
  bool planned() const noexcept { return planned_; }
  /// Whether the planned step's split kernels read row masks: spans smaller than a page, or
  /// evicted tokens.
  bool row_masks() const noexcept { return planned_ && (row_masks_ || live_masks_ != nullptr); }
  /// The step's live-row masks (device, [batch][table stride][mask_words()]; null: no token of the
  /// batch is evicted), ANDed into every row mask the step writes. Set by the engine before each
  /// launch.
  void use_live_masks(const std::uint32_t* masks) noexcept { live_masks_ = masks; }
  /// Scores per (sequence, KV head): one per span of the longest sequence the layout holds.
  std::int32_t score_stride() const noexcept {
    return source_.own_tables ? std::max(span_table_stride_, 1) * source_.spans_per_entry
                              : table_stride_ * std::max(source_.spans_per_entry, 1);
  }

  /// Staged inputs: [span counts][token budgets][always-read starts][span tables], each
  /// `batch capacity` rows (fixed between growths, so a captured step stays valid).
  std::size_t staged_bytes() const noexcept {
    return 3 * align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t)) +
           align(static_cast<std::size_t>(batch_capacity_) * span_table_stride_ * sizeof(std::int32_t));
  }
  void stage(std::byte* host) const {
    if (!planned_) return;
    const std::size_t row = align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t));
    std::memcpy(host, span_counts_.data(), span_counts_.size() * sizeof(std::int32_t));
    std::memcpy(host + row, budget_tokens_.data(), budget_tokens_.size() * sizeof(std::int32_t));
    std::memcpy(host + 2 * row, always_from_.data(), always_from_.size() * sizeof(std::int32_t));
    std::memcpy(host + 3 * row, span_tables_.data(), span_tables_.size() * sizeof(std::int32_t));
  }

  /// Outputs for steps of up to `batch` sequences of up to `table_stride` pages, and scores for
  /// their spans.
  void reserve(std::int32_t batch, std::int32_t table_stride, bool live_masks = false) {
    live_masks_possible_ = live_masks_possible_ || live_masks;
    batch_capacity_ = std::max(batch_capacity_, batch);
    table_stride_ = std::max(table_stride_, table_stride);
    const std::size_t rows = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * table_stride_;
    const std::size_t score_bytes = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * score_stride() * sizeof(float);
    if (scores_.size() < score_bytes) scores_ = device_buffer(score_bytes);
    if (selected_.size() < rows * sizeof(std::int32_t)) selected_ = device_buffer(rows * sizeof(std::int32_t));
    if (row_masks_possible_ || live_masks_possible_) {  // and each chosen page's row mask
      const std::size_t words = rows * static_cast<std::size_t>(mask_words()) * sizeof(std::uint32_t);
      if (marks_.size() < words) {
        marks_ = device_buffer(words);
        token_masks_ = device_buffer(words);
      }
      const std::size_t lengths = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * sizeof(std::int32_t);
      if (table_lengths_.size() < lengths) table_lengths_ = device_buffer(lengths);
    }
  }
  /// The outputs the split kernels read in place of the sequences' block tables.
  void bind(kernel::decode_params& p) const noexcept {
    if (!planned_) return;
    p.block_tables = selected_.as<const std::int32_t>();
    if (row_masks()) {
      p.token_masks = token_masks_.as<const std::uint32_t>();
      p.mask_words = mask_words();
      p.table_lengths = table_lengths_.as<const std::int32_t>();
    }
  }

  /// Scores every span, then chooses each KV head's pages (and, with row masks, their rows).
  /// `p`: the step's parameters (its metadata on the device), `staged`: this step's staged inputs
  /// on the device.
  void launch(const kernel::decode_params& p, const std::byte* staged, const float* q, cudaStream_t stream) {
    if (!planned_) return;
    const std::size_t row = align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t));
    kernel::select_params s{};
    s.bounds = source_.bounds;
    s.bounds_entry_bytes = source_.entry_bytes;
    s.spans_per_entry = source_.spans_per_entry;
    s.summary_rows = source_.summary_rows;
    s.span_tables = source_.own_tables ? reinterpret_cast<const std::int32_t*>(staged + 3 * row) : p.sequence_tables;
    s.span_table_stride = source_.own_tables ? span_table_stride_ : table_stride_;
    s.span_tokens = source_.span_tokens;
    s.span_ranges = source_.ranges;
    s.span_counts = reinterpret_cast<const std::int32_t*>(staged);
    s.score_stride = score_stride();
    s.step_header = p.step_header;
    s.block_tables = p.sequence_tables;
    s.sealed_pages = p.sealed_pages;
    s.budget_pages = p.planned_pages;
    s.q = q;
    s.num_kv_heads = shape_.num_kv_heads;
    s.group_size = shape_.group_size;
    s.combine_sum = combine_sum_ ? 1 : 0;
    s.scores = scores_.as<float>();
    s.selected = selected_.as<std::int32_t>();
    // Instances by summary rows and heads per reduction (groups of up to 4, or of 5 to 8).
    const int heads = shape_.group_size <= 4 ? 4 : 8;
    const int spans_per_cta = kernel::score_warps * 32 / heads;  // a reduction of 32 (span, head) sums per warp
    const dim3 score_grid(static_cast<unsigned>(shape_.num_kv_heads),
                          static_cast<unsigned>(std::max((s.score_stride + spans_per_cta - 1) / spans_per_cta, 1)),
                          static_cast<unsigned>(planned_batch_));
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto dim, auto) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      using kernel::score_pages_kernel;
      const auto score = s.summary_rows == 1
                             ? (heads == 4 ? score_pages_kernel<T, head_dim, 1, 4> : score_pages_kernel<T, head_dim, 1, 8>)
                             : (heads == 4 ? score_pages_kernel<T, head_dim, 2, 4> : score_pages_kernel<T, head_dim, 2, 8>);
      score<<<score_grid, kernel::score_warps * 32, 0, stream>>>(s);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    const dim3 select_grid(static_cast<unsigned>(planned_batch_), static_cast<unsigned>(shape_.num_kv_heads));
    s.live_masks = live_masks_;
    s.mask_words = mask_words();
    s.token_masks = token_masks_.as<std::uint32_t>();
    s.table_lengths = table_lengths_.as<std::int32_t>();
    if (row_masks_) {
      s.budget_tokens = reinterpret_cast<const std::int32_t*>(staged + row);
      s.always_from = reinterpret_cast<const std::int32_t*>(staged + 2 * row);
      s.page_size = shape_.page_size;
      s.marks = marks_.as<std::uint32_t>();
      // Keys and token counts in shared memory when they fit beside its static shared memory,
      // then the row marks when they fit too.
      int keys = kernel::span_select_shared_bytes(s.score_stride);
      if (keys > max_dynamic_shared_ || source_.longest_span > 65535) keys = 0;
      const int marks = kernel::span_marks_shared_bytes(table_stride_, mask_words());
      const bool shared_marks = keys + marks <= max_dynamic_shared_;
      const int bytes = keys + (shared_marks ? marks : 0);
      const auto select = kernel::select_spans_kernel<kernel::select_threads>;
      select<<<select_grid, kernel::select_threads, detail::opted_in_shared(select, bytes, spans_static_shared_), stream>>>(
          s, keys > 0 ? 1 : 0, shared_marks ? 1 : 0);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      return;
    }
    const int keys_bytes = kernel::select_shared_bytes(table_stride_, pages_static_shared_);
    kernel::select_pages_kernel<kernel::select_threads><<<select_grid, kernel::select_threads, keys_bytes, stream>>>(
        s, keys_bytes > 0 ? 1 : 0);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  }

  /// The page ids the last step chose for (batch entry b, KV head h), in sequence order (copied
  /// from the device after synchronizing the device: the stream of the step may be gone). For
  /// tests and reports.
  std::vector<std::int32_t> selected_pages(std::int32_t b, int head) const {
    kvmosaic::detail::require(planned_ && b >= 0 && b < planned_batch_, "cuda::engine::selection().selected_pages", "b",
                              b, "a batch entry of the last step, which must have been a selected one");
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    std::int32_t count = selected_counts_[static_cast<std::size_t>(b)];
    if (row_masks())
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(&count, table_lengths_.as<const std::int32_t>() + b * shape_.num_kv_heads + head,
                                     sizeof count, cudaMemcpyDeviceToHost));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(count));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(ids.data(),
                                   selected_.as<const std::int32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * table_stride_,
                                   ids.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    return ids;
  }
  /// The row masks of `selected_pages(b, head)` after a step with row masks: per page,
  /// mask_words() words, bit r of word w for row 32 w + r (synchronizes).
  std::vector<std::uint32_t> selected_rows(std::int32_t b, int head) const {
    const std::size_t pages = selected_pages(b, head).size(), words = static_cast<std::size_t>(mask_words());
    kvmosaic::detail::require(row_masks(), "cuda::engine::selection().selected_rows", "the last step", "page-granular",
                              "a step with row masks (sub-page spans, or evicted tokens)");
    std::vector<std::uint32_t> masks(pages * words);
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(masks.data(),
                                   token_masks_.as<const std::uint32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * table_stride_ * words,
                                   masks.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
    return masks;
  }
  /// The scores of the last selected step for (b, head), one per span (`spans` of them;
  /// synchronizes).
  std::vector<float> span_scores(std::int32_t b, int head, std::int32_t spans) const {
    std::vector<float> scores(static_cast<std::size_t>(spans));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(scores.data(),
                                   scores_.as<const float>() + (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * score_stride(),
                                   scores.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return scores;
  }

 protected:
  /// Where the spans and their bounds live (fixed for the stage's life).
  void use_source(const span_source& source) noexcept { source_ = source; }

  /// Starts the host half of a step of `batch` sequences: `row_masks` when spans are smaller than
  /// a page; `table_entries`: the span-table entries the longest sequence lists when the spans
  /// are the stage's own (0 for the block tables' spans; scores are sized from either).
  void start(const kvmosaic::detail::selection_request& request, std::size_t batch, bool row_masks,
             std::int32_t table_entries) {
    planned_ = true;
    row_masks_ = row_masks;
    combine_sum_ = request.combine == group_combine::sum;
    planned_batch_ = static_cast<std::int32_t>(batch);
    span_table_stride_ = std::max(span_table_stride_, table_entries);
    batch_capacity_ = std::max(batch_capacity_, planned_batch_);
    span_counts_.assign(batch, 0);
    budget_tokens_.assign(batch, 0);
    always_from_.assign(batch, 0);
    span_tables_.assign(batch * static_cast<std::size_t>(span_table_stride_), 0);
    selected_counts_.assign(batch, 0);
  }
  /// A step that reads every page (no request).
  void start_unselected() noexcept { planned_ = false; }
  /// Sequence b of the started step: `spans` to score, the budget and always-read region from
  /// the request, `read_pages` pages its splits cover, and its span table (own tables only).
  /// Spans starting at or after the request's `candidates_before` (the format's recent window,
  /// read from its exact rows) are left out: the candidates are the first spans, in token order.
  void add(std::size_t b, std::int32_t spans, const kvmosaic::detail::selection_request& request, std::int32_t read_pages,
           const std::vector<std::int32_t>* table = nullptr) {
    if (b < request.candidates_before.size()) {
      const std::int64_t before = request.candidates_before[b];
      if (source_.span_tokens > 0) {
        // Spans starting before `before`: ceil(before / span_tokens), without overflow (no window: max).
        const std::int64_t fits = before <= 0 ? 0 : (before - 1) / source_.span_tokens + 1;
        spans = static_cast<std::int32_t>(std::min<std::int64_t>(spans, fits));
      } else if (b < request.chunks.size() && request.chunks[b].starts != nullptr) {
        std::int32_t fits = 0;
        while (fits < spans && fits < request.chunks[b].count && request.chunks[b].starts[fits] < before) ++fits;
        spans = fits;
      }
    }
    span_counts_[b] = spans;
    budget_tokens_[b] = static_cast<std::int32_t>(std::clamp<std::int64_t>(request.budget[b], 0, std::numeric_limits<std::int32_t>::max()));
    always_from_[b] = static_cast<std::int32_t>(std::min<std::int64_t>(request.always_from[b], std::numeric_limits<std::int32_t>::max()));
    selected_counts_[b] = read_pages;
    if (table != nullptr)
      std::copy(table->begin(), table->end(), span_tables_.begin() + static_cast<std::ptrdiff_t>(b * span_table_stride_));
  }

 private:
  static std::size_t align(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

  kvmosaic::detail::engine_shape shape_;
  span_source source_{};
  int max_dynamic_shared_ = 48 * 1024;  ///< the most dynamic shared memory select_spans_kernel may opt in to
  int spans_static_shared_ = 0, pages_static_shared_ = 0;  ///< the top-k kernels' static shared memory
  bool row_masks_possible_ = false;
  bool live_masks_possible_ = false;  ///< a step has had evicted tokens: row-mask outputs kept
  const std::uint32_t* live_masks_ = nullptr;  ///< the planned step's (device), or null
  std::int32_t batch_capacity_ = 0, table_stride_ = 0, span_table_stride_ = 0;
  // The planned step.
  bool planned_ = false, row_masks_ = false, combine_sum_ = false;
  std::int32_t planned_batch_ = 0;
  std::vector<std::int32_t> span_counts_, budget_tokens_, always_from_, span_tables_, selected_counts_;
  // Outputs.
  device_buffer scores_;         ///< [batch][num_kv_heads][score stride] span scores
  device_buffer selected_;       ///< [batch][num_kv_heads][table stride] the pages each KV head reads
  device_buffer marks_;          ///< row-mask scratch: [batch][num_kv_heads][table stride][mask words]
  device_buffer token_masks_;    ///< the row masks of selected_ (same shape)
  device_buffer table_lengths_;  ///< [batch][num_kv_heads] entries of selected_ a row-mask step wrote
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/span_selection.cuh> ----

namespace kvmosaic::cuda {

/// The spans are the blocks of the pages; staging, outputs, the launch and the read-back are
/// `span_selection`'s. `Selector` has `block_for(page_size)`; its traits' `summary` says what a
/// block keeps.
template <class Selector, class Shapes>
class page_block_selection : public span_selection<Shapes> {
  using spans = span_selection<Shapes>;
  static constexpr block_summary summary = kvmosaic::detail::block_summary_of<Selector>::value;

 public:
  /// Summaries for every page of the pool, `selector.block_for(page_size)` tokens per block.
  page_block_selection(const kvmosaic::detail::engine_shape& shape, const Selector& selector)
      : spans(shape, selector.block_for(shape.page_size) < shape.page_size),
        shape_(shape),
        geometry_(shape, selector.block_for(shape.page_size), summary),
        bounds_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_bytes) {
    kvmosaic::detail::require(geometry_.block_tokens % 8 == 0 && shape.page_size % geometry_.block_tokens == 0,
                              "cuda::engine", "block_tokens", geometry_.block_tokens,
                              "a multiple of 8 that divides the page size");
    span_source source{bounds_.as<const std::byte>(), static_cast<std::int64_t>(geometry_.page_bytes),
                       geometry_.blocks_per_page, geometry_.block_tokens, nullptr, geometry_.block_tokens, false};
    source.summary_rows = geometry_.rows_per_block;
    spans::use_source(source);
  }

  /// Device summaries of each page: [max_pages][num_kv_heads][blocks][summary rows], storage dtype.
  std::size_t page_bytes() const noexcept { return geometry_.page_bytes; }
  const std::byte* bounds_data() const noexcept { return bounds_.as<const std::byte>(); }

  /// The summary of every block of the sealed pages, from their dense rows. One CTA per page, KV
  /// head and block; one thread per channel.
  void seal(const sealed_pages& sealed, cudaStream_t stream) {
    if (sealed.n == 0) return;
    kernel::bounds_params b{};
    b.rows = sealed.rows;
    b.rows_slot_bytes = sealed.rows_slot_bytes;
    b.rows_head_bytes = sealed.rows_head_bytes;
    b.row_slots = sealed.row_slots;
    b.new_pages = sealed.page_ids;
    b.bounds = bounds_.as<std::byte>();
    b.bounds_page_bytes = static_cast<std::int64_t>(geometry_.page_bytes);
    b.block_tokens = geometry_.block_tokens;
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto dim, auto) {
      constexpr int head_dim = decltype(dim)::value;
      kernel::page_bounds_kernel<decltype(element), head_dim, summary == block_summary::mean>
          <<<dim3(static_cast<unsigned>(sealed.n), static_cast<unsigned>(shape_.num_kv_heads),
                  static_cast<unsigned>(geometry_.blocks_per_page)),
             head_dim, 0, stream>>>(b);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
  // Bounds are written only to pages not yet committed: nothing to undo or apply.
  void commit() noexcept {}
  void rollback() noexcept {}

  /// Pages each sequence's splits cover: whole pages, min(budget / page_size, sealed pages); with
  /// sub-page blocks at most min(budget / block, sealed pages), which the splits share as the
  /// device marks them.
  void plan(const kvmosaic::detail::selection_request* request, const std::vector<step_sequence>& batch,
            std::vector<std::int32_t>& read_pages) {
    if (request == nullptr) {
      for (std::size_t b = 0; b < batch.size(); ++b) read_pages[b] = batch[b].sealed_pages;
      spans::start_unselected();
      return;
    }
    const bool masks = geometry_.block_tokens < shape_.page_size;
    spans::start(*request, batch.size(), masks, 0);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t spans_read = std::max<std::int64_t>(request->budget[b], 0) / (masks ? geometry_.block_tokens : shape_.page_size);
      read_pages[b] = static_cast<std::int32_t>(std::min<std::int64_t>(spans_read, batch[b].sealed_pages));
      spans::add(b, batch[b].sealed_pages * geometry_.blocks_per_page, *request, read_pages[b]);
    }
  }

 private:
  kvmosaic::detail::engine_shape shape_;
  kvmosaic::detail::bounds_geometry geometry_;
  device_buffer bounds_;  ///< [max_pages][num_kv_heads][blocks][summary rows]
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/page_blocks.cuh> ----

namespace kvmosaic::cuda {

template <class Shapes>
class selection_stage<select::quest, Shapes> : public page_block_selection<select::quest, Shapes> {
 public:
  using page_block_selection<select::quest, Shapes>::page_block_selection;
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/quest.cuh> ----

// ---- begin <kvmosaic/cuda/select/mean_keys.cuh> ----
/// \file
/// `select::mean_keys` on the CUDA backend (MosaicKV's stage 2): the mean key of every block of
/// each sealed page and the per-step scoring (q . mean) and top-k, `page_block_selection`'s.


namespace kvmosaic::cuda {

template <class Shapes>
class selection_stage<select::mean_keys, Shapes> : public page_block_selection<select::mean_keys, Shapes> {
 public:
  using page_block_selection<select::mean_keys, Shapes>::page_block_selection;
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/mean_keys.cuh> ----

// ---- begin <kvmosaic/cuda/select/sentence_chunks.cuh> ----
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



// ---- begin <kvmosaic/cuda/kernel/chunk_bounds.cuh> ----
/// \file
/// The device side of `select::sentence_chunks`' chunks. The host cuts the token stream (Algorithm
/// 2 needs only the ids); the keys never leave the device. Per sequence the engine keeps the K rows
/// of its open chunk (at most L + Delta rows: a chunk is final once its window exists), so a chunk
/// that began in an earlier call, whose rows may since have been sealed into a compressed page,
/// still has its exact keys. A call's rows extend that stream:
///   - `chunk_bounds_kernel`: the channel-wise min and max key of each chunk the call finalized
///     (the same values as the host's), written to the chunk arena with the chunk's token range;
///   - `keep_open_rows_kernel`: the rows still open, to the sequence's other open-row buffer.



namespace kvmosaic::cuda::kernel {

/// One call's chunk work for one sequence. The stream is the open rows then the call's rows:
/// row r is open row r for r < open_rows, else the call's row r - open_rows.
struct chunk_params {
  const std::byte* open;              ///< [open_rows][num_kv_heads][head_dim] storage dtype
  std::byte* next_open;               ///< stream row r >= copy_from goes to its row r - keep_from
  const void* rows;                   ///< the call's K rows, [new_rows][num_kv_heads][head_dim] (input type)
  int open_rows;
  int new_rows;
  int keep_from;                      ///< the first stream row still open after the call
  int copy_from;                      ///< keep_from, or open_rows when no chunk closed (next_open == open)
  const int4* chunks;                 ///< [finalized] {stream begin, stream end, arena slot, first token}
  std::byte* bounds;                  ///< arena: [block][num_kv_heads][chunks_per_block][lo row, hi row]
  int2* ranges;                       ///< arena: [slot] {first token, end token}
  int chunks_per_block;
  int num_kv_heads;
};

namespace detail_chunks {
/// Channel c of KV head h of stream row r, as the stored value.
template <class S, class In, int HeadDim>
__device__ __forceinline__ float stream_value(const chunk_params& p, int r, int head, int c) {
  if (r < p.open_rows)
    return to_float(reinterpret_cast<const S*>(p.open)[(static_cast<std::size_t>(r) * p.num_kv_heads + head) * HeadDim + c]);
  const In x = static_cast<const In*>(p.rows)[(static_cast<std::size_t>(r - p.open_rows) * p.num_kv_heads + head) * HeadDim + c];
  return to_float(S(to_float(x)));  // rounded to storage, as the row kernels store it
}
}  // namespace detail_chunks

/// The key bounds of each finalized chunk, per KV head. Grid: (finalized chunks, num_kv_heads),
/// one thread per channel.
template <class S, class In, int HeadDim>
__global__ void __launch_bounds__(HeadDim) chunk_bounds_kernel(const chunk_params p) {
  const int4 chunk = p.chunks[blockIdx.x];
  const int head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  float lo = detail_chunks::stream_value<S, In, HeadDim>(p, chunk.x, head, c), hi = lo;
  for (int r = chunk.x + 1; r < chunk.y; ++r) {
    const float x = detail_chunks::stream_value<S, In, HeadDim>(p, r, head, c);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  const int block = chunk.z / p.chunks_per_block, in_block = chunk.z % p.chunks_per_block;
  S* out = reinterpret_cast<S*>(p.bounds) +
           ((static_cast<std::size_t>(block) * p.num_kv_heads + head) * p.chunks_per_block + in_block) * 2 * HeadDim;
  out[c] = S(lo);  // exact: stored values
  out[HeadDim + c] = S(hi);
  if (head == 0 && c == 0) p.ranges[chunk.z] = make_int2(chunk.w, chunk.w + (chunk.y - chunk.x));
}

/// Stores the rows still open: stream rows [copy_from, open_rows + new_rows) to `next_open` (the
/// other buffer when chunks closed, else the call's rows after the open ones, in place).
/// Grid: (rows copied, num_kv_heads), one thread per channel.
template <class S, class In, int HeadDim>
__global__ void __launch_bounds__(HeadDim) keep_open_rows_kernel(const chunk_params p) {
  const int r = p.copy_from + static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  reinterpret_cast<S*>(p.next_open)[(static_cast<std::size_t>(r - p.keep_from) * p.num_kv_heads + head) * HeadDim + c] =
      S(detail_chunks::stream_value<S, In, HeadDim>(p, r, head, c));
}

}  // namespace kvmosaic::cuda::kernel
// ---- end <kvmosaic/cuda/kernel/chunk_bounds.cuh> ----

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
// ---- end <kvmosaic/cuda/select/sentence_chunks.cuh> ----

// ---- begin <kvmosaic/cuda/select/streaming.cuh> ----
/// \file
/// `select::streaming` on the CUDA backend: no selection stage. Its evictions are the cache's
/// (host bookkeeping, live-row masks staged with each step, compaction passes on the device), so
/// every step reads every live row of every page, as `select::all` does.


namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::streaming, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::streaming&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/streaming.cuh> ----

// ---- begin <kvmosaic/cuda/select/snapkv.cuh> ----
/// \file
/// `select::snapkv` on the CUDA backend: no selection stage. Its snapshot is the cache's
/// (`cache::snapshot`: the window's votes, `cache::window_votes`, computed by the decode kernels
/// and `kernel/window_votes.cuh` where the format writes logits, ranked on the host, then the
/// cache's eviction and a compaction pass on the device), so every step reads every live row of
/// every page, as `select::all` does.


namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the cache's snapshot, eviction and compaction.
template <class Shapes>
class selection_stage<select::snapkv, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::snapkv&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/snapkv.cuh> ----

// ---- begin <kvmosaic/cuda/select/scored_eviction.cuh> ----
/// \file
/// `select::tova` and `select::h2o` on the CUDA backend: no selection stage. Every step reads
/// every live row, as `select::all` does; the step's token scores come from the split kernels'
/// logits (`cuda::engine::plan` with score_settings, kernel/token_scores.cuh), and the evictions
/// they drive are the cache's (host bookkeeping, live-row masks, compaction on the device).


namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the scores and the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::tova, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::tova&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

/// Reads every live row. Cost: none beyond the scores and the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::h2o, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::h2o&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
// ---- end <kvmosaic/cuda/select/scored_eviction.cuh> ----
// Compiling a cache type's kernels in one unit (KVMOSAIC_CUDA_EXTERN_CACHE / _INSTANTIATE_CACHE).

// ---- begin <kvmosaic/cuda/instantiate.cuh> ----
/// \file
/// Compiling a cache type's kernels once. A `kvmosaic::cache<Format, Selector, Compactor,
/// Backend>` on a CUDA backend compiles its kernels in every translation unit that uses it (the
/// engine's members that launch them are templates). An inference engine whose files share one
/// cache type compiles them in one `.cu` instead:
///
/// ```cpp
/// // my_cache.cuh, included by every file that uses the cache
/// #include <kvmosaic/kvmosaic.cuh>
/// using my_shapes = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
/// using my_cache = kvmosaic::cache<kvmosaic::format::quant2, kvmosaic::select::quest, kvmosaic::compact::none, my_shapes>;
/// KVMOSAIC_CUDA_EXTERN_CACHE(kvmosaic::format::quant2, kvmosaic::select::quest, my_shapes)
///
/// // my_cache.cu, the one file that compiles the kernels
/// #include "my_cache.cuh"
/// KVMOSAIC_CUDA_INSTANTIATE_CACHE(kvmosaic::format::quant2, kvmosaic::select::quest, my_shapes)
/// ```
///
/// The arguments are the cache's format, selector and backend types (aliases welcome: a macro
/// argument cannot hold an unparenthesized comma). EXTERN is an explicit instantiation
/// declaration of the cache's CUDA engine and selection stage: the engine's members that launch
/// kernels are defined out of line, so a unit that sees it compiles no kernel and no device code
/// for the cache (its host code is inline and cheap). INSTANTIATE, in exactly one unit of the
/// program, is the matching explicit instantiation definition: every kernel of that format,
/// selector and shape list, for every input and output type (float, half, bfloat16) the public
/// API accepts. docs/architecture.md ("What a cache type compiles") gives the costs.


/// In every unit that uses the cache type: its kernels are compiled elsewhere.
#define KVMOSAIC_CUDA_EXTERN_CACHE(FORMAT, SELECTOR, BACKEND)                                            \
  extern template class kvmosaic::cuda::selection_stage<SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>; \
  extern template class kvmosaic::cuda::engine<FORMAT, SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;

/// In exactly one unit: compiles the cache type's kernels (its selection stage and its engine).
#define KVMOSAIC_CUDA_INSTANTIATE_CACHE(FORMAT, SELECTOR, BACKEND) \
  KVMOSAIC_CUDA_INSTANTIATE_SELECTION(SELECTOR, BACKEND)           \
  KVMOSAIC_CUDA_INSTANTIATE_ENGINE(FORMAT, SELECTOR, BACKEND)

/// The two halves of KVMOSAIC_CUDA_INSTANTIATE_CACHE, for a program whose cache types share a
/// selector and backend (say quant2 and dense, both with `select::quest`): the selection stage
/// depends on the selector and backend alone, so it is instantiated in one unit, and each engine
/// in one unit (its own, so that they compile in parallel); KVMOSAIC_CUDA_EXTERN_CACHE as before.
#define KVMOSAIC_CUDA_INSTANTIATE_SELECTION(SELECTOR, BACKEND) \
  template class kvmosaic::cuda::selection_stage<SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;
/// See KVMOSAIC_CUDA_INSTANTIATE_SELECTION.
#define KVMOSAIC_CUDA_INSTANTIATE_ENGINE(FORMAT, SELECTOR, BACKEND) \
  template class kvmosaic::cuda::engine<FORMAT, SELECTOR, kvmosaic::cuda::detail::shapes_of_t<BACKEND>>;
// ---- end <kvmosaic/cuda/instantiate.cuh> ----
// ---- end <kvmosaic/kvmosaic.cuh> ----

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
