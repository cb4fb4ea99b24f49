// SPDX-License-Identifier: Apache-2.0
// core: 16-bit types, views, the online-softmax state and its merge, errors.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvmosaic/core/fast_divisor.hpp"
#include "kvmosaic/kvmosaic.hpp"

using namespace kvmosaic;

namespace {
float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Reference rounding: the representable value nearest to x (ties to the even significand),
// found by comparing exact double distances to the two neighbours.
template <class T>
std::uint16_t nearest_bits(float x, std::uint16_t below_bits) {
  const double lo = to_float(T::from_bits(below_bits));
  const double hi = to_float(T::from_bits(static_cast<std::uint16_t>(below_bits + 1)));
  const double dl = static_cast<double>(x) - lo, dh = hi - static_cast<double>(x);
  if (dl < dh) return below_bits;
  if (dh < dl) return static_cast<std::uint16_t>(below_bits + 1);
  return (below_bits & 1u) ? static_cast<std::uint16_t>(below_bits + 1) : below_bits;
}
}  // namespace

TEST_CASE("half and bfloat16 widen every finite bit pattern exactly and round-trip", "[core][dtype]") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float h = to_float(half::from_bits(bits));
    if (!std::isnan(h)) REQUIRE(half(h).bits == bits);
    const float bf = to_float(bfloat16::from_bits(bits));
    if (!std::isnan(bf)) REQUIRE(bfloat16(bf).bits == bits);
    else REQUIRE(std::isnan(to_float(bfloat16(bf))));
  }
}

TEST_CASE("the host's vectorizable f16 widening gives to_float's bits for every pattern", "[core][dtype]") {
  // detail::half_bits_to_float_select (f16 pages and tails on the host) against the scalar
  // conversion: normals, subnormals, zeros, infinities and NaN payloads, bit for bit; and the
  // bulk row loader that uses it.
  std::vector<std::uint16_t> all(0x10000u);
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    all[b] = bits;
    const float scalar = to_float(half::from_bits(bits)), select = detail::half_bits_to_float_select(bits);
    REQUIRE(std::memcmp(&scalar, &select, 4) == 0);
  }
  std::vector<float> rows(all.size());
  detail::load_dense_rows(dtype::f16, reinterpret_cast<const std::byte*>(all.data()), all.size(), rows.data());
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float scalar = to_float(half::from_bits(static_cast<std::uint16_t>(b)));
    REQUIRE(std::memcmp(&scalar, &rows[b], 4) == 0);
  }
}

TEST_CASE("float to half rounds to nearest even, with hand-checked cases", "[core][dtype]") {
  CHECK(half(1.0f).bits == 0x3c00);
  CHECK(half(-2.0f).bits == 0xc000);
  CHECK(half(65504.0f).bits == 0x7bff);                  // max finite
  CHECK(half(65519.0f).bits == 0x7bff);                  // below the rounding boundary
  CHECK(half(65520.0f).bits == 0x7bff);                  // would round to infinity: saturates
  CHECK(half(std::ldexp(1.0f, -24)).bits == 0x0001);     // smallest subnormal
  CHECK(half(std::ldexp(1.0f, -25)).bits == 0x0000);     // tie to even: zero
  CHECK(half(std::ldexp(3.0f, -26)).bits == 0x0001);     // 0.75 ulp rounds up
  CHECK(half(std::ldexp(3.0f, -25)).bits == 0x0002);     // tie 1.5 ulp goes to even 2
  CHECK(half(1.0f + std::ldexp(1.0f, -11)).bits == 0x3c00);  // tie between 1 and 1+2^-10: even
  CHECK(half(1.0f + std::ldexp(3.0f, -11)).bits == 0x3c02);  // tie between 1+2^-10 and 1+2^-9: even
  CHECK(std::isnan(to_float(half(NAN))));
  CHECK(std::isinf(to_float(half(INFINITY))));
}

TEST_CASE("finite values beyond the 16-bit range saturate; infinities and NaN stay", "[core][dtype]") {
  // The documented contract (core/dtype.hpp): the largest finite value of each type, with the sign.
  const float beyond_half[] = {65520.0f, 1e5f, 1e30f, 3.4028234663852886e38f};
  for (const float x : beyond_half) {
    CHECK(half(x).bits == 0x7bff);
    CHECK(half(-x).bits == 0xfbff);
    CHECK(to_float(half(x)) == 65504.0f);
  }
  // Just below the boundary still rounds to nearest (65519.996 -> 65504).
  CHECK(half(std::nextafter(65520.0f, 0.0f)).bits == 0x7bff);
  CHECK(half(INFINITY).bits == 0x7c00);
  CHECK(half(-INFINITY).bits == 0xfc00);
  CHECK(std::isnan(to_float(half(NAN))));
  // bfloat16: above 0x7f7f (3.3895e38) a float rounds to infinity unless saturated.
  const float bf_max = bits_to_float(0x7f7f0000u);
  CHECK(bfloat16(bits_to_float(0x7f7f8000u)).bits == 0x7f7f);  // tie, would go to even 0x7f80
  CHECK(bfloat16(3.4028234663852886e38f).bits == 0x7f7f);
  CHECK(bfloat16(-3.4028234663852886e38f).bits == 0xff7f);
  CHECK(bfloat16(bf_max).bits == 0x7f7f);
  CHECK(bfloat16(INFINITY).bits == 0x7f80);
  CHECK(bfloat16(-INFINITY).bits == 0xff80);
  CHECK(std::isnan(to_float(bfloat16(NAN))));
  CHECK(to_float(bfloat16(bits_to_float(0x7f7fffffu))) == bf_max);
}

TEST_CASE("storage rounding toward -infinity and +infinity picks the neighbours of x", "[core][dtype]") {
  // Reference: every finite value of the type, sorted; floor and ceiling by binary search.
  for (const dtype t : {dtype::f16, dtype::bf16}) {
    std::vector<double> values;
    for (std::uint32_t b = 0; b < 0x10000u; ++b) {
      const double v = t == dtype::f16 ? to_float(half::from_bits(static_cast<std::uint16_t>(b)))
                                       : to_float(bfloat16::from_bits(static_cast<std::uint16_t>(b)));
      if (std::isfinite(v)) values.push_back(v);
    }
    std::sort(values.begin(), values.end());
    const double top = values.back();
    std::mt19937 rng(11);
    std::uniform_int_distribution<std::uint32_t> any(0, 0xffffffffu);
    int checked = 0;
    for (int i = 0; i < 100000; ++i) {
      const float x = bits_to_float(any(rng));
      if (!std::isfinite(x) || std::abs(static_cast<double>(x)) > top) continue;
      const double down = *(std::upper_bound(values.begin(), values.end(), static_cast<double>(x)) - 1);
      const double up = *std::lower_bound(values.begin(), values.end(), static_cast<double>(x));
      CAPTURE(to_string(t), x);
      REQUIRE(detail::storage_value(detail::storage_bits_down(x, t), t) == down);
      REQUIRE(detail::storage_value(detail::storage_bits_up(x, t), t) == up);
      ++checked;
    }
    CHECK(checked > 10000);
    CHECK(detail::storage_value(detail::storage_bits_up(1e-30f, t), t) > 0.0f);  // +0 steps to the smallest subnormal
    CHECK(detail::storage_value(detail::storage_bits_down(-1e-30f, t), t) < 0.0f);
    CHECK(detail::storage_max(t) == top);
  }
}

TEST_CASE("float to bfloat16 rounds to nearest even, with hand-checked cases", "[core][dtype]") {
  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(bfloat16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3f80);  // tie: even
  CHECK(bfloat16(1.0f + std::ldexp(3.0f, -8)).bits == 0x3f82);  // tie: even
  CHECK(bfloat16(-3.0f).bits == 0xc040);
  CHECK(std::isnan(to_float(bfloat16(NAN))));
}

TEST_CASE("float to 16-bit conversion picks the nearest value for random floats", "[core][dtype]") {
  std::mt19937 rng(7);  // the data only; the check does not depend on the sequence
  std::uniform_int_distribution<std::uint32_t> mantissa(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> exponent(-28, 16);  // half's subnormals up to beyond its max
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t sign = (i & 1) ? 0x80000000u : 0u;
    const std::uint32_t bits = sign | (static_cast<std::uint32_t>(exponent(rng) + 127) << 23) | mantissa(rng);
    const float x = bits_to_float(bits);
    if (!std::isfinite(x) || std::abs(x) >= 65504.0f) continue;
    const std::uint16_t hb = half(x).bits;
    // the neighbour below in magnitude: truncate toward zero
    std::uint16_t below = hb;
    if (std::abs(to_float(half::from_bits(hb))) > std::abs(x)) below = static_cast<std::uint16_t>(hb - 1);
    REQUIRE(hb == nearest_bits<half>(std::abs(x), static_cast<std::uint16_t>(below & 0x7fffu)) + (hb & 0x8000u));
    const std::uint16_t bb = bfloat16(x).bits;
    std::uint16_t bbelow = bb;
    if (std::abs(to_float(bfloat16::from_bits(bb))) > std::abs(x)) bbelow = static_cast<std::uint16_t>(bb - 1);
    REQUIRE(bb == nearest_bits<bfloat16>(std::abs(x), static_cast<std::uint16_t>(bbelow & 0x7fffu)) + (bb & 0x8000u));
    ++checked;
  }
  CHECK(checked > 100000);
}

TEST_CASE("unit roundoff bounds the relative rounding error", "[core][dtype]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    if (std::abs(x) < 1e-3f) continue;
    CHECK(std::abs(to_float(half(x)) - x) <= dtype_traits<half>::unit_roundoff * std::abs(x));
    CHECK(std::abs(to_float(bfloat16(x)) - x) <= dtype_traits<bfloat16>::unit_roundoff * std::abs(x));
  }
}

TEST_CASE("tensor_view indexes row-major and strided memory", "[core][view]") {
  std::vector<int> data(2 * 3 * 4);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<int>(i);
  tensor_view<int, 3> v(data.data(), 2, 3, 4);
  CHECK(v(1, 2, 3) == 23);
  CHECK(v(0, 1, 0) == 4);
  CHECK(v.size() == 24);
  CHECK(v.is_contiguous());
  const tensor_view<const int, 3> cv = v;
  CHECK(cv(1, 0, 1) == 13);
  // every other row of a [6][4] matrix
  auto rows = tensor_view<const int, 2>::strided(data.data(), {3, 4}, {8, 1});
  CHECK(rows(2, 1) == 17);
  CHECK_FALSE(rows.is_contiguous());
}

TEST_CASE("online softmax merged over any split equals the one-pass softmax", "[core][softmax]") {
  std::mt19937 rng(3);
  std::normal_distribution<double> dist(0.0, 4.0);
  const int n = 97, d = 5;
  std::vector<double> s(n), v(n * d);
  for (auto& x : s) x = dist(rng);
  for (auto& x : v) x = dist(rng);
  // exact
  double m = s[0];
  for (double x : s) m = std::max(m, x);
  double l = 0;
  std::vector<double> o(d, 0.0);
  for (int t = 0; t < n; ++t) {
    const double p = std::exp(s[t] - m);
    l += p;
    for (int c = 0; c < d; ++c) o[c] += p * v[t * d + c];
  }
  for (int split : {1, 2, 7, 16, 97}) {
    softmax_state<double> total;
    std::vector<double> o_total(d, 0.0);
    for (int begin = 0; begin < n; begin += split) {
      softmax_state<double> part;
      std::vector<double> o_part(d, 0.0);
      for (int t = begin; t < std::min(n, begin + split); ++t) {
        const merge_weights<double> w = part.push(s[t]);
        for (int c = 0; c < d; ++c) o_part[c] = o_part[c] * w.self + v[t * d + c] * w.other;
      }
      merge_into(total, o_total, part, o_part, d);
    }
    CHECK(total.m == Approx(m).epsilon(1e-15));
    CHECK(total.l == Approx(l).epsilon(1e-13));
    for (int c = 0; c < d; ++c) CHECK(o_total[c] / total.l == Approx(o[c] / l).epsilon(1e-12));
    CHECK(total.log_sum_exp() == Approx(m + std::log(l)).epsilon(1e-14));
  }
}

TEST_CASE("the empty softmax state is the identity of merge", "[core][softmax]") {
  softmax_state<float> a, empty;
  CHECK(a.empty());
  a.push(2.0f);
  std::vector<float> o_a{3.0f}, o_e{0.0f};
  merge_into(a, o_a, empty, o_e, 1);
  CHECK(a.m == 2.0f);
  CHECK(a.l == 1.0f);
  CHECK(o_a[0] == 3.0f);
  softmax_state<float> e2;
  merge_into(e2, o_e, a, o_a, 1);
  CHECK(e2.m == 2.0f);
  CHECK(o_e[0] == 3.0f);
  softmax_state<float> both;
  std::vector<float> z{0.0f};
  merge_into(both, z, softmax_state<float>{}, o_e, 1);
  CHECK(both.empty());
  CHECK(z[0] == 0.0f);  // no NaN from exp(-inf - -inf)
}

TEST_CASE("errors name the parameter and the allowed values", "[core][error]") {
  try {
    detail::require(false, "where", "head_dim", 96, "64, 128 or 256");
    FAIL("no throw");
  } catch (const invalid_argument& e) {
    CHECK(e.parameter() == "head_dim");
    CHECK(std::string(e.what()) == "kvmosaic: where: head_dim = 96; allowed: 64, 128 or 256");
  }
}

TEST_CASE("an f16 cache stores values beyond its range as +-65504 and attends to them finitely", "[core][dtype]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 1;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 4;
  c.max_sequences = 1;
  c.storage = dtype::f16;
  cache<format::dense> dense(c);
  const int n = 20;  // one sealed page and a tail of 4
  std::vector<float> k(static_cast<std::size_t>(n) * 64, 0.25f), v(k.size(), 1.0f);
  for (int t = 0; t < n; ++t) {
    v[static_cast<std::size_t>(t) * 64 + 0] = 1e5f;
    v[static_cast<std::size_t>(t) * 64 + 1] = -1e6f;
    k[static_cast<std::size_t>(t) * 64 + 2] = 7e4f * static_cast<float>(t % 2 ? 1 : -1);
  }
  const sequence_id id = dense.add_sequence();
  dense.prefill(id, tensor_view<const float, 3>(k.data(), n, 1, 64), tensor_view<const float, 3>(v.data(), n, 1, 64));
  std::uint16_t stored[3];
  std::memcpy(stored, dense.engine().v_page(dense.pages(id)[0], 0), 4);
  std::memcpy(stored + 2, dense.engine().k_page(dense.pages(id)[0], 0) + 64 * 2 + 2 * 2, 2);  // token 1, channel 2
  CHECK(stored[0] == 0x7bff);  // 65504
  CHECK(stored[1] == 0xfbff);  // -65504
  CHECK(stored[2] == 0x7bff);
  // q = 0 but channel 2: every weight is finite, the output is the weighted mean of the stored V.
  std::vector<float> q(64, 0.0f), out(64);
  q[2] = 1e-4f;
  dense.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, 1, 64),
               tensor_view<float, 3>(out.data(), 1, 1, 64));
  CHECK(out[0] == Approx(65504.0).epsilon(1e-5));
  CHECK(out[1] == Approx(-65504.0).epsilon(1e-5));
  CHECK(out[5] == Approx(1.0).epsilon(1e-5));
}

TEST_CASE("fast_divisor divides every 31-bit numerator as integer division does", "[core][fast_divisor]") {
  std::mt19937 rng(7);
  std::vector<int> divisors;
  for (int d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (int e = 11; e < 31; ++e)
    for (const int delta : {-1, 0, 1}) divisors.push_back((1 << e) + delta);
  divisors.push_back(2147483647);
  for (int i = 0; i < 200; ++i) divisors.push_back(static_cast<int>(rng() % 2147483647u) + 1);
  for (const int d : divisors) {
    const detail::fast_divisor f(d);
    const auto check = [&](std::uint32_t n) {
      const std::uint32_t q = f.divide(n);
      if (q != n / static_cast<std::uint32_t>(d) || f.remainder(n, q) != n % static_cast<std::uint32_t>(d)) {
        CAPTURE(d, n, q);
        FAIL("fast_divisor disagrees with integer division");
      }
    };
    // Around every multiple of d below 2^20 and near 2^31, and random numerators.
    for (std::uint32_t m = 0; m < (1u << 20); m += static_cast<std::uint32_t>(d))
      for (const std::uint32_t n : {m, m + 1, m > 0 ? m - 1 : 0u}) check(n);
    for (std::uint32_t n = 2147483647u; n > 2147483647u - 3u * static_cast<std::uint32_t>(std::min(d, 4096)); --n) check(n);
    for (int i = 0; i < 2000; ++i) check(rng() % 2147483648u);
  }
  REQUIRE_THROWS_WITH(detail::fast_divisor(0), Catch::Contains("d") && Catch::Contains("[1, 2^31)"));
}
