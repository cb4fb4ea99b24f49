// SPDX-License-Identifier: Apache-2.0
// format::quant2 (HACK) on the host: stochastic rounding unbiased over seeds, nearest rounding
// within half a step, the byte accounting, sinks, the code layout, ranges, NaN, and bad
// parameters. What holds for every code width and V axis (values on the grid exact, Eq. 4 equal to
// dequantize-then-multiply, attention within the bound of the 8-bit steps) is tested for quant2
// with the others in test_quant_widths.cpp.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../support/oracle.hpp"
#include "../support/quant_bound.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;
using traits = format_traits<format::quant2>;

namespace {

std::vector<float> random_rows(int n, int d, std::uint32_t seed, float spread = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> rows(static_cast<std::size_t>(n) * d);
  for (float& x : rows) x = to_float(bfloat16(normal(rng)));
  return rows;
}

}  // namespace

TEST_CASE("quant2: stochastic rounding is unbiased over seeds, nearest within half a step", "[quant2]") {
  const page_shape shape{64, 64, dtype::bf16};
  const std::vector<float> rows = random_rows(64, 64, 3);
  const int pi = GENERATE(32, 64);
  const auto axis = GENERATE(format::key_axis::head_dim, format::key_axis::tokens);
  CAPTURE(pi, axis == format::key_axis::tokens);
  // The partition holding K element (t, c).
  const auto partition_of = [&](int t, int c) {
    return axis == format::key_axis::head_dim ? t * (64 / pi) + c / pi : c * (64 / pi) + t / pi;
  };
  std::vector<double> mean_error(rows.size(), 0.0);
  std::vector<float> decoded(rows.size());
  const int seeds = 2000;
  double max_step = 0;
  for (int seed = 0; seed < seeds; ++seed) {
    const format::quant2 f{pi, format::rounding::stochastic, static_cast<std::uint64_t>(seed), axis};
    std::vector<std::byte> page(traits::k_page_bytes(f, shape));
    traits::encode_k(f, shape, rows.data(), page.data());
    traits::decode_k(f, shape, page.data(), 64, decoded.data());
    for (std::size_t i = 0; i < rows.size(); ++i) mean_error[i] += (decoded[i] - rows[i]) / seeds;
    if (seed == 0) {
      const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), page.data()};
      for (int part = 0; part < view.layout.partitions; ++part) max_step = std::max<double>(max_step, view.scale(part));
    }
  }
  // Each draw errs by less than one step s, so its standard deviation is at most s / 2; the mean
  // of 2000 draws lies within 5 standard errors of 0 (the clamped extremes of a partition aside,
  // where f16 rounding of min and scale may push a value just past the grid).
  int outside = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) outside += std::abs(mean_error[i]) > 5 * (max_step / 2) / std::sqrt(seeds);
  CHECK(outside <= static_cast<int>(rows.size() / 200));

  const format::quant2 f{pi, format::rounding::nearest, 0, axis};
  std::vector<std::byte> page(traits::k_page_bytes(f, shape));
  traits::encode_k(f, shape, rows.data(), page.data());
  traits::decode_k(f, shape, page.data(), 64, decoded.data());
  const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), page.data()};
  for (int t = 0; t < 64; ++t)
    for (int c = 0; c < 64; ++c) {
      const std::size_t i = static_cast<std::size_t>(t) * 64 + c;
      const float s = view.scale(partition_of(t, c));
      // half a step, plus the f16 rounding of min and scale (relative 2^-11 each, times 3 steps)
      REQUIRE(std::abs(decoded[i] - rows[i]) <= s / 2 + 4 * std::ldexp(std::abs(rows[i]) + 3 * s, -11) + 1e-6f);
    }
}

TEST_CASE("quant2 accounting: at Pi = 64, head_dim 128, long context, at most 20% of dense", "[quant2][accounting]") {
  const page_shape shape{64, 128, dtype::bf16};
  // 128 partitions x (2 + 2 + 1 bytes) + 64 x 128 codes / 4
  CHECK(traits::k_page_bytes(format::quant2{}, shape) == 128 * 5 + 64 * 128 / 4);
  CHECK(traits::k_page_bytes(format::quant2{128}, page_shape{128, 128, dtype::bf16}) == 128 * 6 + 128 * 128 / 4);
  cache_config c;
  c.max_pages = 200;
  cache<format::quant2> q2(c);
  synthetic::kv_config cfg;
  const auto kv = synthetic::generate_kv(cfg, 0, 8192 + 10);
  const sequence_id id = q2.add_sequence();
  q2.prefill(id, test::k_view(kv), test::v_view(kv));
  const memory_stats m = q2.sequence_memory(id);
  // pages, plus the 10 tail rows and the default's 4 sink rows (16-bit)
  CHECK(m.compression_ratio() ==
        Approx((128.0 * 8 * 2 * 2688 + (10.0 + 4) * 8 * 128 * 2 * 2) / ((8192 + 10) * 8 * 128 * 2 * 2.0)));
  CHECK(m.compression_ratio() <= 0.20);
}

TEST_CASE("quant2 rejects bad partitions and shapes, naming the parameter", "[quant2][errors]") {
  const auto message = [](int partition, int head_dim, int page_size) {
    cache_config c;
    c.head_dim = head_dim;
    c.page_size = page_size;
    try {
      cache<format::quant2> bad(c, format::quant2{partition});
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(message(48, 128, 64) == "kvmosaic: format::quant2: partition = 48; allowed: 32, 64 or 128");
  CHECK(message(128, 64, 128) ==
        "kvmosaic: format::quant2: partition = 128; allowed: 32 or 64 at head_dim = 64 (a divisor of head_dim with "
        "either k_axis: q.k sums channels in groups of partition; K per channel stores per-token code sums of "
        "partition channels)");
  CHECK(message(128, 128, 64) ==
        "kvmosaic: format::quant2: page_size = 64; allowed: a multiple of partition (a sealed page holds whole V partitions)");
  CHECK(message(64, 128, 64) == "accepted");
  for (const int sinks : {-1, 17}) {
    cache_config c;
    try {
      cache<format::quant2> bad(c, format::quant2{64, format::rounding::stochastic, 0, format::key_axis::tokens, sinks});
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()) ==
            "kvmosaic: format::quant2: sink_tokens = " + std::to_string(sinks) + "; allowed: 0 to 16");
    }
  }
}

TEST_CASE("quant2 needs a partition dividing head_dim with either key axis, and says so", "[quant2][errors]") {
  // K per channel (the default) partitions K along tokens, but q.k still runs over channels in
  // groups of Pi: q' = q s is quantized to 8 bits per Pi channels and each token's code sums of Pi
  // channels fill the partitions' sum slots. Pi = 128 at head_dim 64 is rejected for both axes,
  // naming partition and the values allowed at that head_dim; the CUDA engine compiles Pi <=
  // head_dim only and rejects the same (cuda/format/quant/device.cuh).
  const std::string expected =
      "kvmosaic: format::quant2: partition = 128; allowed: 32 or 64 at head_dim = 64 (a divisor of head_dim with "
      "either k_axis: q.k sums channels in groups of partition; K per channel stores per-token code sums of "
      "partition channels)";
  for (const auto axis : {format::key_axis::tokens, format::key_axis::head_dim}) {
    CAPTURE(axis == format::key_axis::tokens);
    cache_config c;
    c.num_kv_heads = 3;
    c.group_size = 3;
    c.head_dim = 64;
    c.page_size = 128;
    try {
      cache<format::quant2> bad(c, format::quant2{128, format::rounding::nearest, 0, axis});
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()) == expected);
      CHECK(std::string(e.parameter()) == "partition");
    }
    // the values it names are accepted at that shape
    for (const int pi : {32, 64}) CHECK_NOTHROW(cache<format::quant2>(c, format::quant2{pi, format::rounding::nearest, 0, axis}));
  }
  // Pi = 128 is accepted where it divides head_dim (256 here), with pages of 128
  cache_config wide;
  wide.head_dim = 256;
  wide.page_size = 128;
  CHECK_NOTHROW(cache<format::quant2>(wide, format::quant2{128}));
  const page_shape narrow{64, 32, dtype::bf16};  // below every cache_config head_dim: the traits alone
  try {
    format_traits<format::quant2>::validate(format::quant2{64}, narrow);
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).rfind("kvmosaic: format::quant2: partition = 64; allowed: 32 at head_dim = 32 (", 0) == 0);
  }
}

TEST_CASE("quant2 sink tokens stay 16-bit: masked in the first page, attended exactly, counted", "[quant2][sinks]") {
  // Sinks as StreamingLLM sees them: the first tokens carry activations far larger than the rest.
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 16;
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  const int length = 150;  // two pages and a tail
  synthetic::kv_data kv = synthetic::generate_kv(cfg, 4, length);
  for (std::size_t i = 0; i < static_cast<std::size_t>(4 * 2 * 64); ++i) {
    kv.v[i] *= 8.0f;  // V outliers: K stays as generated, so attention is not all on the sinks
  }
  const auto q = synthetic::generate_query(cfg, 4, length);
  const float scale = 1.0f / 8.0f;
  const synthetic::kv_data stored = test::rounded(kv, dtype::bf16);
  const auto exact_stored = test::exact(q, stored, scale);

  const auto run = [&](int sinks) {
    cache<format::quant2> q2(c, format::quant2{64, format::rounding::nearest, 0, format::key_axis::tokens, sinks});
    const sequence_id id = q2.add_sequence();
    q2.prefill(id, test::k_view(kv), test::v_view(kv));
    std::vector<float> out(q.size());
    q2.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
              tensor_view<float, 3>(out.data(), 1, 4, 64));
    // Against exact attention on what the cache keeps: decoded pages, dense sinks and tail.
    const synthetic::kv_data decoded = test::quant_decoded(q2, id, stored);
    const auto exact = test::exact(q, decoded, scale);
    const test::quant_bounds bounds = test::quant_attention_bounds(q2, id, q, decoded, scale);
    for (std::size_t i = 0; i < out.size(); ++i) {
      INFO("sinks " << sinks << ", element " << i);
      REQUIRE(std::abs(out[i] - exact[i]) <= bounds.vs_exact[i]);
    }
    if (sinks > 0) {
      // The first page is the encoding of its rows with the sinks replaced by row `sinks`.
      const page_shape shape{64, 64, dtype::bf16};
      for (int h = 0; h < 2; ++h)
        for (const bool is_v : {false, true}) {
          std::vector<float> rows(64 * 64);
          for (int t = 0; t < 64; ++t)
            for (int ch = 0; ch < 64; ++ch)
              rows[static_cast<std::size_t>(t) * 64 + ch] =
                  (is_v ? stored.v : stored.k)[(static_cast<std::size_t>(std::max(t, sinks)) * 2 + h) * 64 + ch];
          std::vector<std::byte> page(traits::k_page_bytes(q2.format(), shape));
          if (is_v) traits::encode_v(q2.format(), shape, rows.data(), page.data());
          else traits::encode_k(q2.format(), shape, rows.data(), page.data());
          const std::byte* held = is_v ? q2.engine().v_page(q2.pages(id)[0], h) : q2.engine().k_page(q2.pages(id)[0], h);
          REQUIRE(std::memcmp(page.data(), held, page.size()) == 0);
        }
      // Accounting: two pages, the 22-row tail and the sink rows, all 16-bit rows at 2 x 2 x 64 x 2 bytes.
      const memory_stats m = q2.sequence_memory(id);
      CHECK(m.stored_bytes == 2 * static_cast<std::int64_t>(q2.engine().page_slot_bytes()) + (22 + sinks) * 512);
      // A fork keeps them.
      const sequence_id child = q2.fork_sequence(id);
      std::vector<float> forked(q.size());
      q2.attend(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
                tensor_view<float, 3>(forked.data(), 1, 4, 64));
      CHECK(forked == out);
    }
    double error = 0, norm = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      error += (out[i] - exact_stored[i]) * (out[i] - exact_stored[i]);
      norm += exact_stored[i] * exact_stored[i];
    }
    return std::sqrt(error / norm);
  };
  const double without = run(0), with = run(4);
  CAPTURE(without, with);
  // Outliers no longer set the first page's ranges, and the sinks themselves are exact.
  CHECK(with < without);

  // Before the first page is sealed, sinks are tail rows like any other, and not counted twice.
  cache<format::quant2> short_cache(c, format::quant2{64, format::rounding::nearest, 0, format::key_axis::tokens, 4});
  const sequence_id s = short_cache.add_sequence();
  const auto few = synthetic::generate_kv(cfg, 5, 10);
  short_cache.prefill(s, test::k_view(few), test::v_view(few));
  CHECK(short_cache.sequence_memory(s).stored_bytes == 10 * 512);
}

TEST_CASE("quant2 codes are stored as int8 m16n8k32 A fragments", "[quant2][layout]") {
  // Hand-computed positions (PTX ISA, mma.m16n8k32 A fragment: lane 4g + q holds rows g and g + 8,
  // columns 4q .. 4q + 3 and 16 + 4q ..; register s = row half s % 2, column half s / 2).
  CHECK(detail::quant_code_bit(2, 128, 0, 0) == 0);
  CHECK(detail::quant_code_bit(2, 128, 8, 0) == 2);         // s = 1
  CHECK(detail::quant_code_bit(2, 128, 0, 16) == 4);        // s = 2
  CHECK(detail::quant_code_bit(2, 128, 8, 16) == 6);        // s = 3
  CHECK(detail::quant_code_bit(2, 128, 0, 1) == 8);         // byte 1 of lane 0
  CHECK(detail::quant_code_bit(2, 128, 0, 4) == 32);        // lane 1 (q = 1)
  CHECK(detail::quant_code_bit(2, 128, 1, 0) == 4 * 32);    // lane 4 (g = 1)
  CHECK(detail::quant_code_bit(2, 128, 0, 32) == 1024);     // the next tile along columns
  CHECK(detail::quant_code_bit(2, 128, 16, 0) == 4 * 1024); // the next tile row: 128 / 32 tiles on
  // Every code of an encoded V page read back through the fragment rule: register s of lane
  // 4g + q, byte b, is (word >> 2s) & 3 in byte b, and stands for row g + 8(s % 2), column
  // 16(s / 2) + 4q + b of the [channels][tokens] matrix.
  const page_shape shape{64, 64, dtype::bf16};
  const format::quant2 f{32, format::rounding::nearest};
  const std::vector<float> v = random_rows(64, 64, 9);
  std::vector<std::byte> page(traits::v_page_bytes(f, shape));
  traits::encode_v(f, shape, v.data(), page.data());
  const detail::quant_layout layout = detail::quant_layout_of(f, shape, false);
  const detail::quant_page_view view{layout, page.data()};
  for (int tile = 0; tile < 64 * 64 / 512; ++tile)
    for (int lane = 0; lane < 32; ++lane) {
      std::uint32_t word = 0;
      std::memcpy(&word, page.data() + layout.codes_at() + static_cast<std::size_t>(tile) * 128 + lane * 4, 4);
      for (int s = 0; s < 4; ++s) {
        const std::uint32_t reg = (word >> (2 * s)) & 0x03030303u;
        for (int b = 0; b < 4; ++b) {
          const int channel = tile / 2 * 16 + lane / 4 + 8 * (s % 2);       // 64 tokens = 2 tiles a row
          const int token = tile % 2 * 32 + 16 * (s / 2) + 4 * (lane % 4) + b;
          REQUIRE(static_cast<int>((reg >> (8 * b)) & 0xffu) == view.code_at(token, channel));
        }
      }
    }
}

TEMPLATE_TEST_CASE("quant keeps each partition's min and scale in the storage dtype, rounded outward", "[quant2][range]",
                   format::quant2, format::quant4) {
  using traits = format_traits<TestType>;
  constexpr double L = TestType::levels;  // 3 or 15
  // For every partition: min is a storage value <= every value, scale the smallest storage value
  // with min + L scale >= every value (fp64, against all storage values as the reference), and
  // nearest rounding within half a step. bf16 data spans up to +-3e38 (beyond f16's 65504).
  const auto axis = GENERATE(format::key_axis::head_dim, format::key_axis::tokens);
  const dtype storage = GENERATE(dtype::f16, dtype::bf16);
  const double spread = GENERATE(1.0, 1e6, 1e30, 1e38);
  if (storage == dtype::f16 && spread > 1e4) return;  // f16 values saturate at 65504: one case below
  CAPTURE(axis == format::key_axis::tokens, to_string(storage), spread);
  const auto round = [&](double x) {
    return storage == dtype::f16 ? to_float(half(static_cast<float>(x))) : to_float(bfloat16(static_cast<float>(x)));
  };
  std::vector<double> values;  // every finite storage value, sorted
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const double v = storage == dtype::f16 ? to_float(half::from_bits(static_cast<std::uint16_t>(b)))
                                           : to_float(bfloat16::from_bits(static_cast<std::uint16_t>(b)));
    if (std::isfinite(v)) values.push_back(v);
  }
  std::sort(values.begin(), values.end());
  const page_shape shape{64, 64, storage};
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::vector<float> rows(64 * 64);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = round(spread * uniform(rng) - (i % 3 == 0 ? spread * 0.5 : 0.0));
  rows[7] = round(-spread);
  TestType f;
  f.partition = 32;
  f.k_axis = axis;
  f.sink_tokens = 0;
  std::vector<std::byte> page(traits::k_page_bytes(f, shape));
  traits::encode_k(f, shape, rows.data(), page.data());
  std::vector<float> decoded(rows.size());
  traits::decode_k(f, shape, page.data(), 64, decoded.data());
  const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), page.data()};
  for (int part = 0; part < view.layout.partitions; ++part) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < 32; ++i) {
      int t = 0, c = 0;
      view.layout.element(part, i, t, c);
      lo = std::min<double>(lo, rows[static_cast<std::size_t>(t) * 64 + c]);
      hi = std::max<double>(hi, rows[static_cast<std::size_t>(t) * 64 + c]);
    }
    const double m = view.min(part), s = view.scale(part);
    CAPTURE(part, lo, hi, m, s);
    REQUIRE(m == lo);  // lo is a storage value: rounding toward -infinity keeps it
    // The smallest storage value v with L v >= hi - m (L v is exact in fp64).
    const double smallest = *std::partition_point(values.begin(), values.end(), [&](double x) { return L * x < hi - m; });
    REQUIRE(s == smallest);
    REQUIRE(m + L * s >= hi);
    for (int i = 0; i < 32; ++i) {
      int t = 0, c = 0;
      view.layout.element(part, i, t, c);
      const std::size_t at = static_cast<std::size_t>(t) * 64 + c;
      REQUIRE(std::isfinite(decoded[at]));
      REQUIRE(std::abs(static_cast<double>(decoded[at]) - rows[at]) <= s / 2 + std::ldexp(std::abs(m) + L * s, -22));
    }
  }
}

TEST_CASE("quant2 with bf16 storage attends over values beyond f16's range within its bound", "[quant2][range]") {
  // Values below -65504 and partition ranges above 1.9e5: f16 mins and scales would be infinite
  // (and the output NaN). Against exact fp64 attention on what the pages decode to.
  const int pi = GENERATE(32, 64);
  const auto axis = GENERATE(format::key_axis::head_dim, format::key_axis::tokens);
  CAPTURE(pi, axis == format::key_axis::tokens);
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 16;
  c.storage = dtype::bf16;
  cache<format::quant2> q2(c, format::quant2{pi, format::rounding::stochastic, 5, axis});
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  const int length = 150;
  synthetic::kv_data kv = synthetic::generate_kv(cfg, 7, length);
  for (float& x : kv.k) x = x * 1e5f - 2e5f;  // logits stay moderate: q is scaled down below
  for (float& x : kv.v) x = x * 1e6f - 1e6f;
  std::vector<float> q = synthetic::generate_query(cfg, 7, length);
  for (float& x : q) x *= 1e-5f;
  const sequence_id id = q2.add_sequence();
  q2.prefill(id, test::k_view(kv), test::v_view(kv));
  std::vector<float> out(q.size());
  q2.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
            tensor_view<float, 3>(out.data(), 1, 4, 64));
  const synthetic::kv_data decoded = test::quant_decoded(q2, id, test::rounded(kv, dtype::bf16));
  for (const float x : decoded.k) REQUIRE(std::isfinite(x));
  for (const float x : decoded.v) REQUIRE(std::isfinite(x));
  const float scale = 1.0f / 8.0f;
  const auto exact = test::exact(q, decoded, scale);
  const test::quant_bounds bounds = test::quant_attention_bounds(q2, id, q, decoded, scale);
  for (std::size_t i = 0; i < out.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::isfinite(out[i]));
    REQUIRE(std::abs(out[i] - exact[i]) <= bounds.vs_exact[i]);
  }
}

TEST_CASE("quant2 with f16 storage saturates values beyond 65504 and stays finite", "[quant2][range]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 1;
  c.head_dim = 64;
  c.max_pages = 4;
  c.storage = dtype::f16;
  cache<format::quant2> q2(c, format::quant2{32, format::rounding::nearest, 0, format::key_axis::tokens, /*sink_tokens=*/0});
  const int n = 64;
  std::vector<float> k(static_cast<std::size_t>(n) * 64), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i % 7) * 0.1f;
    v[i] = (i / 64 % 2 ? 1e5f : -1e5f) * static_cast<float>(i % 5);  // sign alternating along tokens
  }
  const sequence_id id = q2.add_sequence();
  q2.prefill(id, tensor_view<const float, 3>(k.data(), n, 1, 64), tensor_view<const float, 3>(v.data(), n, 1, 64));
  std::vector<float> decoded(v.size());
  traits::decode_v(q2.format(), page_shape{64, 64, dtype::f16}, q2.engine().v_page(q2.pages(id)[0], 0), n, decoded.data());
  // Stored values are within [-65504, 65504] (saturated); V channels alternate signs along tokens,
  // so every partition spans the whole range: min -65504, 3 scale >= 131008.
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double stored = std::max(-65504.0, std::min(65504.0, static_cast<double>(v[i])));
    REQUIRE(std::abs(decoded[i] - stored) <= 131008.0 / 6 * 1.001);
  }
  std::vector<float> q(64, 0.01f), out(64);
  q2.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(q.data(), 1, 1, 64),
            tensor_view<float, 3>(out.data(), 1, 1, 64));
  for (const float x : out) REQUIRE(std::isfinite(x));
}

TEST_CASE("quant2 NaN inputs give NaN outputs and defined codes; subnormal weights stay defined", "[quant2][nan]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.max_pages = 16;
  synthetic::kv_config cfg;
  cfg.num_kv_heads = 2;
  cfg.group_size = 2;
  cfg.head_dim = 64;
  const int length = 150;
  const auto kv = synthetic::generate_kv(cfg, 9, length);
  const auto q = synthetic::generate_query(cfg, 9, length);
  const auto attend = [&](const format::quant2& f, const synthetic::kv_data& data, const std::vector<float>& query) {
    cache<format::quant2> q2(c, f);
    const sequence_id id = q2.add_sequence();
    q2.prefill(id, test::k_view(data), test::v_view(data));
    std::vector<float> out(query.size());
    q2.attend(span<const sequence_id>(&id, 1), tensor_view<const float, 3>(query.data(), 1, 4, 64),
              tensor_view<float, 3>(out.data(), 1, 4, 64));
    return out;
  };
  const auto axis = GENERATE(format::key_axis::head_dim, format::key_axis::tokens);
  const auto mode = GENERATE(format::rounding::nearest, format::rounding::stochastic);
  const format::quant2 f{32, mode, 1, axis};
  CAPTURE(axis == format::key_axis::tokens, mode == format::rounding::nearest);
  const auto head_of = [](std::size_t i) { return static_cast<int>(i / 64) / 2; };  // the KV head of output i
  {  // a NaN K value (token 70, KV head 1, channel 5: a sealed page, not the first of its partition)
    synthetic::kv_data bad = kv;
    bad.k[(70 * 2 + 1) * 64 + 5] = NAN;
    const auto out = attend(f, bad, q);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::isnan(out[i]) == (head_of(i) == 1));
  }
  {  // a NaN V value (token 3, KV head 0, channel 9): that channel of KV head 0's query heads
    synthetic::kv_data bad = kv;
    bad.v[(3 * 2 + 0) * 64 + 9] = NAN;
    const auto out = attend(f, bad, q);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::isnan(out[i]) == (head_of(i) == 0 && i % 64 == 9));
  }
  {  // an infinite K value: the partition's range is NaN, the KV head's outputs NaN
    synthetic::kv_data bad = kv;
    bad.k[(10 * 2 + 0) * 64 + 40] = INFINITY;
    const auto out = attend(f, bad, q);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::isnan(out[i]) == (head_of(i) == 0));
  }
  {  // a NaN in query head 3 (not its first channel): that head's output
    std::vector<float> bad = q;
    bad[3 * 64 + 17] = NAN;
    const auto out = attend(f, kv, bad);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::isnan(out[i]) == (i / 64 == 3));
  }
  {  // the page codes of a NaN partition: NaN min and scale, every code 0
    const page_shape shape{64, 64, dtype::bf16};
    std::vector<float> rows = random_rows(64, 64, 4);
    rows[3 * 64 + 1] = NAN;
    std::vector<std::byte> page(traits::v_page_bytes(f, shape));
    traits::encode_v(f, shape, rows.data(), page.data());
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, false), page.data()};
    const int part = 1 * 2 + 0;  // channel 1, tokens 0..31
    CHECK(std::isnan(view.min(part)));
    CHECK(std::isnan(view.scale(part)));
    CHECK(view.code_sum(part) == 0u);
    for (int i = 0; i < 32; ++i) CHECK(view.code(part, i) == 0);
    CHECK(std::isfinite(view.min(part + 1)));
  }
}

TEST_CASE("quant2's 8-bit quantization of subnormal or NaN operands is defined", "[quant2][nan]") {
  std::vector<int> a(32);
  float m = 0, s = 0;
  // Subnormal softmax weights: the step's reciprocal would overflow; every code is 0, and the
  // dequantized values m + s a are within the (subnormal) range of the true ones.
  std::vector<float> p(32);
  for (int i = 0; i < 32; ++i) p[static_cast<std::size_t>(i)] = std::ldexp(1.0f, -149) * static_cast<float>(1 + i * 800);
  const unsigned sum = detail::quantize8(p.data(), 32, 1, m, s, a.data());
  CHECK(m == p[0]);
  for (int i = 0; i < 32; ++i) {
    REQUIRE(a[static_cast<std::size_t>(i)] >= 0);
    REQUIRE(a[static_cast<std::size_t>(i)] <= 255);
    REQUIRE(std::abs(static_cast<double>(m) + static_cast<double>(s) * a[static_cast<std::size_t>(i)] - p[static_cast<std::size_t>(i)]) <=
            static_cast<double>(p[31]) - p[0]);
  }
  CHECK(sum <= 255u * 32);
  // Normal but tiny: the reciprocal is finite, codes as usual (the largest is 255).
  for (int i = 0; i < 32; ++i) p[static_cast<std::size_t>(i)] = 1e-30f * static_cast<float>(1 + i);
  detail::quantize8(p.data(), 32, 1, m, s, a.data());
  CHECK(a[0] == 0);
  CHECK(a[31] == 255);
  // NaN anywhere: m and s NaN, codes 0.
  for (const int at : {0, 13}) {
    for (int i = 0; i < 32; ++i) p[static_cast<std::size_t>(i)] = static_cast<float>(i);
    p[static_cast<std::size_t>(at)] = NAN;
    CHECK(detail::quantize8(p.data(), 32, 1, m, s, a.data()) == 0u);
    CHECK(std::isnan(m));
    CHECK(std::isnan(s));
    for (const int x : a) CHECK(x == 0);
  }
  // The accumulate path with a partition of subnormal weights: finite, within the weights' range.
  const page_shape shape{64, 64, dtype::bf16};
  const format::quant2 f{32, format::rounding::nearest};
  const std::vector<float> v = random_rows(64, 64, 12, 0.5f);
  std::vector<std::byte> page(traits::v_page_bytes(f, shape));
  traits::encode_v(f, shape, v.data(), page.data());
  std::vector<float> v_hat(v.size());
  traits::decode_v(f, shape, page.data(), 64, v_hat.data());
  std::vector<float> weights(64);
  for (int t = 0; t < 64; ++t) weights[static_cast<std::size_t>(t)] = t < 32 ? 1.0f - 0.01f * t : std::ldexp(1.0f, -140) * static_cast<float>(t - 31);
  std::vector<float> o(64, 0.0f);
  traits::accumulate(f, shape, page.data(), 64, weights.data(), 1, o.data());
  for (int ch = 0; ch < 64; ++ch) {
    double exact = 0, magnitude = 0;
    for (int t = 0; t < 64; ++t) {
      exact += static_cast<double>(weights[static_cast<std::size_t>(t)]) * v_hat[static_cast<std::size_t>(t) * 64 + ch];
      magnitude += std::abs(v_hat[static_cast<std::size_t>(t) * 64 + ch]);
    }
    REQUIRE(std::isfinite(o[static_cast<std::size_t>(ch)]));
    // 8-bit p over the first partition: half a step of 0.31 / 255 per weight, plus fp32 slack.
    REQUIRE(std::abs(o[static_cast<std::size_t>(ch)] - exact) <= 0.31 / 510 * magnitude + 1e-5 * magnitude);
  }
}

TEST_CASE("quant2 rejects out-of-range enumerations, naming the field", "[quant2][errors]") {
  const auto message = [](const format::quant2& f) {
    try {
      cache<format::quant2> bad(cache_config{}, f);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  format::quant2 f;
  f.k_axis = static_cast<format::key_axis>(5);
  CHECK(message(f) == "kvmosaic: format::quant2: k_axis = 5; allowed: key_axis::head_dim (0) or key_axis::tokens (1)");
  f = format::quant2{};
  f.mode = static_cast<format::rounding>(9);
  CHECK(message(f) == "kvmosaic: format::quant2: mode = 9; allowed: rounding::stochastic (0) or rounding::nearest (1)");
  f = format::quant2{};
  f.mode = format::rounding::nearest;
  f.k_axis = format::key_axis::head_dim;
  CHECK(message(f) == "accepted");
}
