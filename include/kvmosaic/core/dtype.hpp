// SPDX-License-Identifier: Apache-2.0
#pragma once

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

#include "kvmosaic/core/config.hpp"

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
