// SPDX-License-Identifier: Apache-2.0
// format::packed_bitmap (MosaicKV stage 1) on the host: the segment basis is orthonormal and
// ordered by variance; a hand-computed case (a diagonal covariance: the basis is a permutation,
// so the kept channels are known by hand) for g = 1 and g = 2; every record keeps exactly the
// top-r groups of its rotated vector (checked against an fp64 brute force); exact byte
// accounting; the strategy search against a brute-force evaluation of every candidate; attention
// through the cache, in the rotated spaces, equal to fp64 attention over the decoded vectors
// within a derived bound (one segment, several, appends, a fork, a compaction); fidelity against
// exact attention improving with the retained fraction; and clear rejections.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../support/oracle.hpp"
#include "../support/packed_bound.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using traits = format_traits<format::packed_bitmap>;
using test::decoded;
using test::rotate;
using test::rotated_bound;

format::packed_bitmap make(float retained, int group, float truncated = 0.25f, int segment_tokens = 65536) {
  format::packed_bitmap f;
  f.retained = retained;
  f.group = group;
  f.truncated = truncated;
  f.segment_tokens = segment_tokens;
  f.sink_tokens = 0;  // the paper's setting: every token in the pages
  return f;
}

/// Rows [n][d] of one head of a synthetic K (or V) matrix, rounded to bf16 as the cache stores them.
std::vector<float> head_rows(const synthetic::kv_data& kv, int head, bool is_v) {
  std::vector<float> rows(static_cast<std::size_t>(kv.num_tokens) * kv.head_dim);
  for (int t = 0; t < kv.num_tokens; ++t)
    for (int c = 0; c < kv.head_dim; ++c) {
      const float x = is_v ? kv.v_at(t, head, c) : kv.k_at(t, head, c);
      rows[static_cast<std::size_t>(t) * kv.head_dim + c] = to_float(bfloat16(x));
    }
  return rows;
}

/// Brute force, fp64: the groups of the largest energy of y (ties: the lower group), sorted.
std::vector<int> top_groups(const std::vector<double>& y, int group, int keep) {
  const int groups = static_cast<int>(y.size()) / group;
  std::vector<std::pair<double, int>> energy;
  for (int j = 0; j < groups; ++j) {
    double e = 0;
    for (int i = 0; i < group; ++i) e += y[static_cast<std::size_t>(j * group + i)] * y[static_cast<std::size_t>(j * group + i)];
    energy.emplace_back(-e, j);
  }
  std::sort(energy.begin(), energy.end());
  std::vector<int> chosen;
  for (int i = 0; i < keep; ++i) chosen.push_back(energy[static_cast<std::size_t>(i)].second);
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

/// Attends q over `seq` and checks every element against fp64 attention over the decoded
/// vectors within `rotated_bound` (for caches whose sequence has one segment), or returns the
/// largest relative L2 error (several segments: the same math, checked by the caller).
template <class Cache>
double check_against_decoded(Cache& kv, sequence_id seq, const cache_config& c, const std::vector<float>& q, bool bounded) {
  const int heads = c.num_kv_heads, d = c.head_dim, qh = c.num_q_heads();
  synthetic::kv_data dec = decoded(kv, seq, heads, d);
  if constexpr (compactor_traits<typename Cache::compactor_type>::frees_memory) {  // live slots only
    std::vector<std::int64_t> live;
    const std::vector<std::int64_t> positions = kv.positions(seq);
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (positions[i] >= 0) live.push_back(static_cast<std::int64_t>(i));
    dec = test::tokens_of(dec, live);
  }
  std::vector<float> out(q.size());
  kv.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, qh, d), tensor_view<float, 3>(out.data(), 1, qh, d));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<double> exact = host::exact_attention(tensor_view<const float, 2>(q.data(), qh, d), test::k_view(dec), test::v_view(dec), scale);
  if (bounded) {
    const std::vector<double> per_head =  // each KV head's rows against its own segment
        rotated_bound(q, dec, c.group_size, scale, [&](int h) { return kv.engine().segment(kv.slot(seq), 0, h); }, c.page_size);
    for (std::size_t i = 0; i < out.size(); ++i) {
      INFO("element " << i);
      CHECK(std::abs(out[i] - exact[i]) <= per_head[i]);
    }
  }
  return host::compare(out.data(), exact.data(), out.size()).rel_l2_error;
}

cache_config small_config(int d = 128, int group = 4) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = group;
  c.head_dim = d;
  c.page_size = 64;
  c.max_pages = 512;
  c.max_sequences = 4;
  return c;
}

synthetic::kv_config synthetic_config(const cache_config& c) {
  synthetic::kv_config s;
  s.num_kv_heads = c.num_kv_heads;
  s.group_size = c.group_size;
  s.head_dim = c.head_dim;
  return s;
}

}  // namespace

TEST_CASE("packed_bitmap: the basis is orthonormal and ordered by decreasing variance", "[packed_bitmap]") {
  const cache_config c = small_config();
  const synthetic::kv_data kv = synthetic::generate_kv(synthetic_config(c), 0, 1024);
  const page_shape shape{64, 128, dtype::bf16};
  for (const bool is_v : {false, true}) {
    const std::vector<float> rows = head_rows(kv, 1, is_v);
    const traits::segment seg = traits::plan_segment(make(0.25f, 1), shape, rows.data(), rows.data(), kv.num_tokens);
    REQUIRE(seg.kept == 96);
    const std::vector<float>& b = seg.basis[0];
    double worst = 0, previous = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 96; ++i) {
      for (int j = 0; j < 96; ++j) {
        double dot = 0;
        for (int ch = 0; ch < 128; ++ch) dot += static_cast<double>(b[static_cast<std::size_t>(ch) * 96 + i]) * b[static_cast<std::size_t>(ch) * 96 + j];
        worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
      }
      double variance = 0;  // sum_t y_ti^2: the eigenvalue of column i
      for (int t = 0; t < kv.num_tokens; ++t) {
        const double y = rotate(rows.data() + static_cast<std::size_t>(t) * 128, b, 128, 96)[static_cast<std::size_t>(i)];
        variance += y * y;
      }
      CHECK(variance <= previous * (1 + 1e-6));
      previous = variance;
    }
    CHECK(worst < 1e-6);  // fp64 eigenvectors stored in fp32
  }
}

TEST_CASE("packed_bitmap: a segment's sums follow their documented order, which the CUDA engine follows to the bit",
          "[packed_bitmap]") {
  // An independent transcription of the order detail::packed_segment_sums documents: tiles of
  // 2048 rows from the segment's first row, each entry's sum from zero in token order, the tiles
  // added in order. 4999 rows: two whole tiles and one of 903 rows (not a multiple of 4 or 16).
  cache_config c = small_config(64, 1);
  const synthetic::kv_data kv = synthetic::generate_kv(synthetic_config(c), 7, 4999);
  const page_shape shape{64, 64, dtype::bf16};
  const std::vector<float> k = head_rows(kv, 1, false), v = head_rows(kv, 1, true);
  const int d = 64, n = 4999, tile = traits::segment_sum_tile_rows;
  REQUIRE(tile == 2048);
  const format::packed_bitmap f = make(0.25f, 1);
  std::vector<double> sums(traits::segment_sum_count(f, shape));
  REQUIRE(sums.size() == static_cast<std::size_t>(2 * d * d + 4 * d));
  traits::segment_sums(f, shape, k.data(), v.data(), n, sums.data());
  std::vector<double> expect(sums.size(), 0.0);
  for (int first = 0; first < n; first += tile) {
    const int rows = std::min(tile, n - first);
    for (int which = 0; which < 2; ++which) {
      const std::vector<float>& x = which == 0 ? k : v;
      for (int i = 0; i < d; ++i)
        for (int j = 0; j <= i; ++j) {
          double partial = 0;
          for (int t = first; t < first + rows; ++t)
            partial += static_cast<double>(x[static_cast<std::size_t>(t) * d + i]) * x[static_cast<std::size_t>(t) * d + j];
          expect[static_cast<std::size_t>(which * d * d + i * d + j)] += partial;
        }
    }
    for (int ch = 0; ch < d; ++ch) {
      double partial = 0;
      for (int t = first; t < first + rows; ++t) partial += static_cast<double>(k[static_cast<std::size_t>(t) * d + ch]) * k[static_cast<std::size_t>(t) * d + ch];
      expect[static_cast<std::size_t>(2 * d * d + ch)] += partial;
      const int sizes[3] = {16, 8, 4};
      for (int s = 0; s < 3; ++s) {
        double deviations = 0;
        for (int block = first; block + sizes[s] <= first + rows; block += sizes[s]) {
          double mean = 0;
          for (int t = block; t < block + sizes[s]; ++t) mean += k[static_cast<std::size_t>(t) * d + ch];
          mean /= sizes[s];
          for (int t = block; t < block + sizes[s]; ++t) {
            const double e = k[static_cast<std::size_t>(t) * d + ch] - mean;
            deviations = std::fma(e, e, deviations);
          }
        }
        expect[static_cast<std::size_t>(2 * d * d + (1 + s) * d + ch)] += deviations;
      }
    }
  }
  std::size_t differing = 0;
  for (std::size_t e = 0; e < sums.size(); ++e) differing += sums[e] != expect[e] ? 1 : 0;
  CHECK(differing == 0);
  // And they are the covariance: against a long-double sum over all rows at once.
  double worst = 0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j <= i; ++j) {
      long double exact = 0;
      for (int t = 0; t < n; ++t) exact += static_cast<long double>(k[static_cast<std::size_t>(t) * d + i]) * k[static_cast<std::size_t>(t) * d + j];
      const long double scale = std::sqrt(static_cast<long double>(sums[static_cast<std::size_t>(i * d + i)]) * sums[static_cast<std::size_t>(j * d + j)]);
      worst = std::max(worst, static_cast<double>(std::abs(sums[static_cast<std::size_t>(i * d + j)] - exact) / scale));
    }
  CHECK(worst < 1e-13);
  // A plan from the sums is the plan from the rows.
  const traits::segment a = traits::plan_segment(f, shape, k.data(), v.data(), n);
  const traits::segment b = traits::plan_segment_from_sums<float>(f, shape, sums.data(), n, nullptr, nullptr);
  CHECK(a.basis[0] == b.basis[0]);
  CHECK(a.basis[1] == b.basis[1]);
  CHECK(a.block_tokens == b.block_tokens);
}

TEST_CASE("packed_bitmap: hand-computed records (a diagonal covariance makes the basis a permutation)", "[packed_bitmap]") {
  // 16 rows of 8 channels: x_t[c] = w_c h_t[c], h the +-1 columns of a 16 x 16 Hadamard matrix
  // (orthogonal, so the covariance is diag(16 w_c^2)). By variance: channels 3 (w 8), 1 (5), 7 (4),
  // 5 (3), 2 (2), 0 (1), 4 (0.5), 6 (0.25). truncated 0.25 keeps 6: rotated channel j is
  // original channel {3, 1, 7, 5, 2, 0}[j], sign +.
  const float w[8] = {1, 5, 2, 8, 0.5f, 3, 0.25f, 4};
  const int order[6] = {3, 1, 7, 5, 2, 0};
  const page_shape shape{16, 8, dtype::bf16};
  std::vector<float> rows(16 * 8);
  for (int t = 0; t < 16; ++t)
    for (int ch = 0; ch < 8; ++ch) {
      const int bits = t & (ch + 1);  // Sylvester Hadamard entry (t, ch + 1): (-1)^popcount(t & (ch + 1))
      rows[static_cast<std::size_t>(t) * 8 + ch] = (__builtin_popcount(static_cast<unsigned>(bits)) % 2 ? -1.0f : 1.0f) * w[ch];
    }
  for (const int group : {1, 2}) {
    // g = 1, r = 2: every row keeps rotated channels 0 and 1 (|x| = 8 and 5 everywhere).
    // g = 2, r = 4: groups (0,1) energy 89, (2,3) 25, (4,5) 5: keeps rotated channels 0-3.
    const format::packed_bitmap f = make(group == 1 ? 0.25f : 0.5f, group);
    const traits::segment seg = traits::plan_segment(f, shape, rows.data(), rows.data(), 16);
    REQUIRE(seg.kept == 6);
    for (int j = 0; j < 6; ++j)
      for (int ch = 0; ch < 8; ++ch)
        CHECK(seg.basis[0][static_cast<std::size_t>(ch) * 6 + j] == Approx(ch == order[j] ? 1.0 : 0.0).margin(1e-6));
    std::vector<std::byte> page(traits::k_page_bytes(f, shape));
    traits::encode_k(f, shape, seg, rows.data(), page.data());
    const std::uint32_t* bitmap = reinterpret_cast<const std::uint32_t*>(page.data());
    for (int t = 0; t < 16; ++t) CHECK(bitmap[t] == (group == 1 ? 0x3u : 0x3u));  // bits 0, 1: channels 0-1, or groups 0-1
    std::vector<float> back(rows.size());
    traits::decode_k(f, shape, seg, page.data(), 16, back.data());
    const int kept_channels = group == 1 ? 2 : 4;
    for (int t = 0; t < 16; ++t)
      for (int ch = 0; ch < 8; ++ch) {
        const bool kept = std::find(order, order + kept_channels, ch) != order + kept_channels;
        CHECK(back[static_cast<std::size_t>(t) * 8 + ch] == Approx(kept ? rows[static_cast<std::size_t>(t) * 8 + ch] : 0.0f).margin(1e-5));
      }
  }
}

TEST_CASE("packed_bitmap: every record keeps exactly the top-r groups of its rotated vector", "[packed_bitmap]") {
  const cache_config c = small_config();
  const synthetic::kv_data kv = synthetic::generate_kv(synthetic_config(c), 3, 64);
  const page_shape shape{64, 128, dtype::bf16};
  for (const int group : {1, 2, 4})
    for (const float retained : {0.125f, 0.25f, 0.5f}) {
      const format::packed_bitmap f = make(retained, group);
      const std::vector<float> k = head_rows(kv, 0, false), v = head_rows(kv, 0, true);
      const traits::segment seg = traits::plan_segment(f, shape, k.data(), v.data(), 64);
      const int r = static_cast<int>(retained * 128), words = (96 / group + 31) / 32;
      std::vector<std::byte> page(traits::k_page_bytes(f, shape));
      traits::encode_v(f, shape, seg, v.data(), page.data());
      for (int t = 0; t < 64; ++t) {
        const std::vector<double> y = rotate(v.data() + static_cast<std::size_t>(t) * 128, seg.basis[1], 128, 96);
        const std::vector<int> expect = top_groups(y, group, r / group);
        const std::uint32_t* bits = reinterpret_cast<const std::uint32_t*>(page.data()) + static_cast<std::size_t>(t) * words;
        std::vector<int> got;
        for (int j = 0; j < 96 / group; ++j)
          if ((bits[j / 32] >> (j % 32)) & 1u) got.push_back(j);
        INFO("g " << group << " retained " << retained << " token " << t);
        CHECK(got == expect);
        // The values: the rotated channels of those groups, rounded to bf16 (y from fp32 rows
        // and fp32 B: within a few fp32 ulps of y in fp64, before the bf16 rounding).
        const std::uint16_t* values = reinterpret_cast<const std::uint16_t*>(page.data() + static_cast<std::size_t>(64) * words * 4) +
                                      static_cast<std::size_t>(t) * r;
        std::size_t at = 0;
        for (const int j : expect)
          for (int i = 0; i < group; ++i) {
            const double exact = y[static_cast<std::size_t>(j * group + i)];
            const double stored = detail::bfloat16_bits_to_float(values[at++]);
            CHECK(std::abs(stored - exact) <= std::abs(exact) * (1.0 / 256) + 1e-6);
          }
      }
    }
}

TEST_CASE("packed_bitmap: a block key is the block's mean key channel-compressed as a key is, and scores in fp32 within "
          "a derived bound of fp64",
          "[packed_bitmap][mean_keys]") {
  const cache_config c = small_config();
  const synthetic::kv_data kv = synthetic::generate_kv(synthetic_config(c), 5, 64);
  const page_shape shape{64, 128, dtype::bf16};
  const std::vector<float> q = synthetic::generate_query(synthetic_config(c), 5, 64);  // [8][128]
  for (const int group : {1, 2, 4})
    for (const float retained : {0.125f, 0.25f, 0.5f}) {
      const format::packed_bitmap f = make(retained, group);
      const std::vector<float> k = head_rows(kv, 0, false), v = head_rows(kv, 0, true);
      const traits::segment seg = traits::plan_segment(f, shape, k.data(), v.data(), 64);
      const int r = static_cast<int>(retained * 128);
      // r 8-bit channels padded to 16 bytes, then r 16-bit values padded to 16 bytes.
      const int values_offset = (r + 15) / 16 * 16;
      CHECK(traits::block_key_bytes(f, shape) == static_cast<std::size_t>(values_offset + (2 * r + 15) / 16 * 16));
      std::vector<std::byte> key(traits::block_key_bytes(f, shape));
      std::vector<float> q_key(4 * 96);
      traits::block_key_query(f, shape, seg, q.data(), 4, q_key.data());
      for (int block = 0; block < 4; ++block) {
        float mean[128];
        detail::mean_key(k.data() + static_cast<std::size_t>(block) * 16 * 128, 16, 128, mean);
        traits::encode_block_key(f, shape, seg, mean, key.data());
        const std::vector<double> y = rotate(mean, seg.basis[0], 128, 96);
        const std::vector<int> expect = top_groups(y, group, r / group);
        INFO("g " << group << " retained " << retained << " block " << block);
        const auto* channels = reinterpret_cast<const std::uint8_t*>(key.data());
        const auto* values = reinterpret_cast<const std::uint16_t*>(key.data() + values_offset);
        std::vector<double> stored(96, 0.0);  // y^: the kept channels' values as stored
        std::size_t at = 0;
        for (const int j : expect)
          for (int i = 0; i < group; ++i, ++at) {
            CHECK(channels[at] == j * group + i);
            const double exact = y[static_cast<std::size_t>(j * group + i)];
            stored[static_cast<std::size_t>(j * group + i)] = detail::bfloat16_bits_to_float(values[at]);
            CHECK(std::abs(stored[static_cast<std::size_t>(j * group + i)] - exact) <= std::abs(exact) * (1.0 / 256) + 1e-6);
          }
        // The score: q' (fp32 chains of 128 fused multiply-adds) . y^ (one chain of r fused
        // multiply-adds), against fp64 q' . y^: at most r u sum |q'_c y^_c| from the dot product
        // and sum_c |y^_c| 128 u sum_c' |q_c' B_c'c| from q', u = 2^-24.
        const double u = std::ldexp(1.0, -24);
        for (int g = 0; g < 4; ++g) {
          const std::vector<double> q_exact = rotate(q.data() + static_cast<std::size_t>(g) * 128, seg.basis[0], 128, 96);
          double exact = 0, magnitude = 0, rotation = 0;
          for (int ch = 0; ch < 96; ++ch) {
            exact += q_exact[static_cast<std::size_t>(ch)] * stored[static_cast<std::size_t>(ch)];
            magnitude += std::abs(q_exact[static_cast<std::size_t>(ch)] * stored[static_cast<std::size_t>(ch)]);
            double q_abs = 0;
            for (int c0 = 0; c0 < 128; ++c0)
              q_abs += std::abs(static_cast<double>(q[static_cast<std::size_t>(g) * 128 + c0]) * seg.basis[0][static_cast<std::size_t>(c0) * 96 + ch]);
            rotation += std::abs(stored[static_cast<std::size_t>(ch)]) * 128 * u * q_abs;
          }
          const double got = traits::score_block_key(f, shape, q_key.data() + static_cast<std::size_t>(g) * 96, key.data());
          CHECK(std::abs(got - exact) <= r * u * magnitude + rotation + 1e-30);
        }
      }
    }
}

TEST_CASE("packed_bitmap with select::mean_keys keeps block keys, selects by them and attends what it selects",
          "[packed_bitmap][mean_keys]") {
  cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_config(c);
  const int n = 1100;  // segments of 512 tokens: pages 0-7, 8-15, 16 (a third, of one page)
  const synthetic::kv_data kv = synthetic::generate_kv(syn, 7, n);
  const std::vector<float> q = synthetic::generate_query(syn, 7, n);
  format::packed_bitmap f = make(0.25f, 2, 0.25f, 512);
  select::mean_keys s;
  s.budget.ratio = 1.0 / 8;
  cache<format::packed_bitmap, select::mean_keys> kv_cache(c, f, s);
  cache<format::packed_bitmap> plain(c, f);
  const sequence_id seq = kv_cache.add_sequence(), other = plain.add_sequence();
  kv_cache.prefill(seq, test::k_view(kv), test::v_view(kv));
  plain.prefill(other, test::k_view(kv), test::v_view(kv));
  REQUIRE(kv_cache.engine().format_block_keys());
  // Memory: one block key per block of 16 and KV head on top of each page, not a dense row.
  const page_shape shape = page_shape{c.page_size, c.head_dim, c.storage};
  CHECK(kv_cache.memory().stored_bytes - plain.memory().stored_bytes ==
        static_cast<std::int64_t>(kv_cache.memory().pages_used) * (c.page_size / 16) * c.num_kv_heads *
            static_cast<std::int64_t>(traits::block_key_bytes(f, shape)));
  std::vector<float> out(q.size());
  kv_cache.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, c.num_q_heads(), c.head_dim),
                  tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim));
  // Brute force in fp64 from the stored keys and the engine's segments: per block the fp32 mean
  // (the engine's), rotated, its top groups by energy, the values rounded to bf16, scored by the
  // rotated query, the group combined by max; the budget's best blocks.
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const std::int64_t sealed = n / c.page_size * c.page_size, budget = n / 8;
  int compared = 0;
  for (int h = 0; h < c.num_kv_heads; ++h) {
    std::vector<std::pair<double, std::int64_t>> scored;
    for (std::int64_t first = 0; first < sealed; first += 16) {
      const traits::segment& seg = kv_cache.engine().segment(kv_cache.slot(seq), first / c.page_size, h);
      std::vector<float> rows(16 * 128);
      for (int t = 0; t < 16; ++t)
        for (int ch = 0; ch < 128; ++ch) rows[static_cast<std::size_t>(t) * 128 + ch] = stored.k_at(static_cast<int>(first + t), h, ch);
      float mean[128];
      detail::mean_key(rows.data(), 16, 128, mean);
      const std::vector<double> y = rotate(mean, seg.basis[0], 128, 96);
      std::vector<double> kept(96, 0.0);
      for (const int j : top_groups(y, 2, 16))
        for (int i = 0; i < 2; ++i) kept[static_cast<std::size_t>(j * 2 + i)] = to_float(bfloat16(static_cast<float>(y[static_cast<std::size_t>(j * 2 + i)])));
      double best = -INFINITY;
      for (int g = 0; g < c.group_size; ++g) {
        const std::vector<double> qr = rotate(q.data() + static_cast<std::size_t>(h * c.group_size + g) * 128, seg.basis[0], 128, 96);
        double score = 0;
        for (int ch = 0; ch < 96; ++ch) score += qr[static_cast<std::size_t>(ch)] * kept[static_cast<std::size_t>(ch)];
        best = std::max(best, score);
      }
      scored.emplace_back(-best, first);
    }
    std::sort(scored.begin(), scored.end());
    const std::size_t k = static_cast<std::size_t>(budget / 16);
    const double gap = (scored[k].first - scored[k - 1].first) / std::max(1.0, std::abs(scored[k - 1].first));
    if (gap < 1e-3) continue;  // a cut that close may fall either way in fp32
    ++compared;
    std::vector<std::int64_t> firsts;
    for (std::size_t i = 0; i < k; ++i) firsts.push_back(scored[i].second);
    std::sort(firsts.begin(), firsts.end());
    std::vector<std::pair<std::int64_t, std::int64_t>> expected;
    for (const std::int64_t first : firsts) {
      if (!expected.empty() && expected.back().second == first) expected.back().second = first + 16;
      else expected.emplace_back(first, first + 16);
    }
    INFO("KV head " << h);
    CHECK(kv_cache.selected_ranges(seq, h) == expected);
  }
  CHECK(compared >= 1);
  for (const float x : out) CHECK(std::isfinite(x));
}

TEST_CASE("packed_bitmap: exact byte accounting", "[packed_bitmap]") {
  const page_shape shape{64, 128, dtype::bf16};
  // kept 96: g = 1 3 words (12 bytes), g = 2 48 bits in 2 words, g = 4 24 bits in 1 word.
  CHECK(traits::k_page_bytes(make(0.25f, 1), shape) == 64 * (12 + 32 * 2));
  CHECK(traits::k_page_bytes(make(0.25f, 2), shape) == 64 * (8 + 32 * 2));
  CHECK(traits::k_page_bytes(make(0.25f, 4), shape) == 64 * (4 + 32 * 2));
  CHECK(traits::v_page_bytes(make(0.5f, 1), shape) == 64 * (12 + 64 * 2));
  format::packed_bitmap searched = make(0.375f, 4);
  searched.mode = format::strategy::search;  // slot for r = 48 at g = 1
  CHECK(traits::k_page_bytes(searched, shape) == 64 * (12 + 48 * 2));
  CHECK(traits::k_page_bytes(make(0.25f, 1, 0.0f), shape) == 64 * (16 + 32 * 2));
  // head_dim 64, page 16: kept 48 -> 2 words; r 16: 16 * (8 + 32) = 640, a multiple of 16.
  CHECK(traits::k_page_bytes(make(0.25f, 1), page_shape{16, 64, dtype::f16}) == 640);
  CHECK(traits::segment_bytes(make(0.25f, 1), shape) == 2 * 128 * 96 * 4 + 24);

  // The cache's gauge: pages, tail rows and the segments' bases, nothing else.
  const cache_config c = small_config();
  const format::packed_bitmap f = make(0.25f, 1, 0.25f, 256);
  cache<format::packed_bitmap> kv(c, f);
  const sequence_id seq = kv.add_sequence();
  const synthetic::kv_data data = synthetic::generate_kv(synthetic_config(c), 1, 600);
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  const memory_stats m = kv.memory();
  // 9 pages (3 segments of 4, 4, 1 pages), 24 tail rows; 2 heads.
  CHECK(kv.pages(seq).size() == 9);
  CHECK(m.stored_bytes == 9 * 2 * 2 * 64 * 76 + 24 * 2 * 2 * 128 * 2 + 3 * 2 * static_cast<std::int64_t>(traits::segment_bytes(f, shape)));
  CHECK(m.dense_bytes == 600 * 2 * 2 * 128 * 2);
}

TEST_CASE("packed_bitmap: the strategy search picks what a brute-force evaluation of the candidates picks", "[packed_bitmap]") {
  const cache_config c = small_config();
  synthetic::kv_config sc = synthetic_config(c);
  const synthetic::kv_data kv = synthetic::generate_kv(sc, 5, 512);
  const page_shape shape{64, 128, dtype::bf16};
  const std::vector<float> k = head_rows(kv, 0, false), v = head_rows(kv, 0, true);
  format::packed_bitmap f = make(0.375f, 1);
  f.mode = format::strategy::search;
  const traits::segment reference = traits::plan_segment(f, shape, k.data(), v.data(), 512);
  for (int which = 0; which < 2; ++which) {
    const std::vector<float>& rows = which == 0 ? k : v;
    // Brute force: every candidate's relative squared error in fp64.
    double total = 0;
    for (const float x : rows) total += static_cast<double>(x) * x;
    std::vector<std::pair<int, int>> candidates;
    for (const int r : {16, 32, 48})
      for (const int g : {4, 2, 1}) candidates.emplace_back(r, g);
    std::vector<double> loss;
    for (const auto& [r, g] : candidates) {
      double stored = 0;
      for (int t = 0; t < 512; ++t) {
        const std::vector<double> y = rotate(rows.data() + static_cast<std::size_t>(t) * 128, reference.basis[which], 128, 96);
        for (const int j : top_groups(y, g, r / g))
          for (int i = 0; i < g; ++i) stored += y[static_cast<std::size_t>(j * g + i)] * y[static_cast<std::size_t>(j * g + i)];
      }
      loss.push_back((total - stored) / total);
    }
    // Thresholds around each candidate's loss: the search must take the first candidate at or
    // below it (fp32 vs fp64 sums: thresholds 1e-4 away from every loss).
    std::vector<double> thresholds = {0.0, 1.0};
    for (const double l : loss) thresholds.push_back(l + 1e-3);
    for (const double threshold : thresholds) {
      bool clear = true;
      for (const double l : loss) clear = clear && std::abs(l - threshold) > 1e-4;
      if (!clear) continue;
      f.loss_threshold = static_cast<float>(threshold);
      const traits::segment seg = traits::plan_segment(f, shape, k.data(), v.data(), 512);
      std::pair<int, int> expect{48, 1};
      for (std::size_t i = 0; i < candidates.size(); ++i)
        if (loss[i] <= threshold) {
          expect = candidates[i];
          break;
        }
      INFO("K/V " << which << " threshold " << threshold);
      CHECK(seg.strategy[which].retained == expect.first);
      CHECK(seg.strategy[which].group == expect.second);
    }
  }
  // Block size: the largest of 16, 8, 4 whose relative intra-block variance is under the threshold.
  double norm = 0;
  for (const float x : k) norm += static_cast<double>(x) * x;
  norm /= 512;
  std::vector<double> variance;
  for (const int b : {16, 8, 4}) {
    double sum = 0;
    for (int first = 0; first < 512; first += b)
      for (int ch = 0; ch < 128; ++ch) {
        double mean = 0;
        for (int t = first; t < first + b; ++t) mean += k[static_cast<std::size_t>(t) * 128 + ch];
        mean /= b;
        for (int t = first; t < first + b; ++t) sum += (k[static_cast<std::size_t>(t) * 128 + ch] - mean) * (k[static_cast<std::size_t>(t) * 128 + ch] - mean);
      }
    variance.push_back(sum / 512 / norm);
  }
  CHECK(variance[0] >= variance[1]);
  CHECK(variance[1] >= variance[2]);
  for (const double threshold : {variance[0] + 1e-3, variance[1] + 1e-3, variance[2] + 1e-3, 0.0}) {
    f.block_variance_threshold = static_cast<float>(threshold);
    const int expect = threshold >= variance[0] ? 16 : threshold >= variance[1] ? 8 : 4;
    CHECK(traits::plan_segment(f, shape, k.data(), v.data(), 512).block_tokens == expect);
  }
}

TEST_CASE("packed_bitmap: the search's sums equal a brute force's, bit for bit, with ties, by ranks and by selections",
          "[packed_bitmap]") {
  // detail::packed_chunk_stored against the definition: per row, each group's fp32 energy (its
  // squares added in order), the first keep groups by (energy descending, group ascending), their
  // energies added in increasing group order from zero; the chunk's rows added in order from
  // zero. Values from a small set make exact ties common; kept = 96 (24 to 96 groups: the ranks)
  // and 256 at g = 1 (256 groups: the selections). Values of continuous mantissas over 40
  // binades make the double sums round, so that another order of the additions gives other bits.
  std::mt19937 random(46);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  for (const bool ties : {true, false})
    for (const int kept : {96, 256}) {
      const int n = 64;
      std::vector<float> y(static_cast<std::size_t>(n) * kept);
      for (float& x : y)
        x = ties ? static_cast<float>(static_cast<int>(random() % 5) - 2) * (random() % 7 == 0 ? 0.5f : 1.0f)
                 : std::ldexp(uniform(random), static_cast<int>(random() % 40) - 20);
      for (const int group : {4, 2, 1}) {
        std::vector<detail::packed_strategy> candidates;
        for (const int r : {kept / 8, kept / 4, kept * 3 / 8}) candidates.push_back({r / group * group, group});
        candidates.push_back({kept / 4, group == 1 ? 2 : 1});  // another group size: left alone
        std::vector<double> stored(candidates.size(), -1.0);
        detail::packed_chunk_stored(y.data(), n, kept, candidates, group, stored.data());
        CHECK(stored.back() == -1.0);
        for (std::size_t c = 0; c + 1 < candidates.size(); ++c) {
          const int keep = candidates[c].retained / group, groups = kept / group;
          double expected = 0;
          for (int t = 0; t < n; ++t) {
            std::vector<std::pair<float, int>> ranked;
            std::vector<float> energy(static_cast<std::size_t>(groups), 0.0f);
            for (int j = 0; j < groups; ++j) {
              for (int i = 0; i < group; ++i) {
                const float x = y[static_cast<std::size_t>(t * kept + j * group + i)];
                energy[static_cast<std::size_t>(j)] += x * x;
              }
              ranked.emplace_back(-energy[static_cast<std::size_t>(j)], j);
            }
            std::sort(ranked.begin(), ranked.end());
            std::vector<int> chosen;
            for (int k = 0; k < keep; ++k) chosen.push_back(ranked[static_cast<std::size_t>(k)].second);
            std::sort(chosen.begin(), chosen.end());
            double row = 0;
            for (const int j : chosen) row += energy[static_cast<std::size_t>(j)];
            expected += row;
          }
          INFO("ties " << ties << " kept " << kept << " g " << group << " r " << candidates[c].retained);
          CHECK(stored[c] == expected);
        }
      }
    }
}

TEST_CASE("packed_bitmap: the search from its sums, as a device computes them, chooses what the search from the rows does",
          "[packed_bitmap]") {
  // format_traits::search_segment_from_sums over sums laid out as the CUDA engine copies them
  // back ([chunks][K's 10, V's 10]) against plan_segment on the same rows, at thresholds around
  // every candidate's loss; 300 rows end in a partial chunk.
  const cache_config c = small_config();
  const synthetic::kv_data kv = synthetic::generate_kv(synthetic_config(c), 11, 300);
  const page_shape shape{64, 128, dtype::bf16};
  const std::vector<float> k = head_rows(kv, 1, false), v = head_rows(kv, 1, true);
  format::packed_bitmap f = make(0.375f, 1);
  f.mode = format::strategy::search;
  const auto g = detail::packed_geometry::of(f, shape);
  const std::int64_t n = 300, chunks = (n + 63) / 64;
  std::vector<double> sums(static_cast<std::size_t>(chunks) * traits::segment_search_sum_count(f, shape), -1.0);
  REQUIRE(traits::segment_search_sum_count(f, shape) == 2 * detail::packed_search_sum_count);
  std::vector<double> segment_sums(traits::segment_sum_count(f, shape));
  traits::segment_sums(f, shape, k.data(), v.data(), n, segment_sums.data());
  const traits::segment unsearched = traits::plan_segment_from_sums<float>(f, shape, segment_sums.data(), n, nullptr, nullptr);
  for (int which = 0; which < 2; ++which)
    detail::packed_search_sums(g, which == 0 ? k.data() : v.data(), n, unsearched.basis[which],
                               sums.data() + which * detail::packed_search_sum_count, traits::segment_search_sum_count(f, shape));
  std::vector<float> thresholds = {0.0f, 1.0f};
  for (int which = 0; which < 2; ++which) {
    double total = 0;
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk) total += sums[static_cast<std::size_t>(chunk) * 20 + which * 10];
    for (int i = 0; i < 9; ++i) {
      double kept = 0;
      for (std::int64_t chunk = 0; chunk < chunks; ++chunk) kept += sums[static_cast<std::size_t>(chunk) * 20 + which * 10 + 1 + i];
      const float loss = static_cast<float>(detail::packed_loss(total, kept));
      thresholds.push_back(std::nextafter(loss, 0.0f));
      thresholds.push_back(std::nextafter(loss, 1.0f));
    }
  }
  std::set<std::pair<int, int>> seen;
  for (const float threshold : thresholds) {
    f.loss_threshold = threshold;
    traits::segment searched = unsearched;
    traits::search_segment_from_sums(f, shape, searched, n, sums.data());
    const traits::segment reference = traits::plan_segment(f, shape, k.data(), v.data(), n);
    INFO("threshold " << threshold);
    for (int which = 0; which < 2; ++which) {
      CHECK(searched.strategy[which].retained == reference.strategy[which].retained);
      CHECK(searched.strategy[which].group == reference.strategy[which].group);
      seen.emplace(searched.strategy[which].retained, searched.strategy[which].group);
    }
  }
  CHECK(seen.size() >= 4);  // the thresholds reach several candidates
}

TEST_CASE("packed_bitmap: the search skips a group that does not divide the slot's r", "[packed_bitmap]") {
  // r_slot = 38 at head_dim 128 (kept 96): r of 16 and 32 fit under it; g = 4 divides both and
  // kept but not 38, so records of groups of 4 would not start on a whole group.
  const page_shape shape{64, 128, dtype::bf16};
  format::packed_bitmap f = make(38.0f / 128.0f, 1);
  f.mode = format::strategy::search;
  const auto g = kvmosaic::detail::packed_geometry::of(f, shape);
  REQUIRE(g.retained == 38);
  std::vector<std::pair<int, int>> got;
  for (const auto& c : kvmosaic::detail::packed_candidates(g)) got.emplace_back(c.retained, c.group);
  CHECK(got == std::vector<std::pair<int, int>>{{16, 2}, {16, 1}, {32, 2}, {32, 1}});
  // r_slot = 48: g = 4 is tried first at each rate.
  f.retained = 0.375f;
  got.clear();
  for (const auto& c : kvmosaic::detail::packed_candidates(kvmosaic::detail::packed_geometry::of(f, shape)))
    got.emplace_back(c.retained, c.group);
  CHECK(got == std::vector<std::pair<int, int>>{{16, 4}, {16, 2}, {16, 1}, {32, 4}, {32, 2}, {32, 1}, {48, 4}, {48, 2}, {48, 1}});
}

TEST_CASE("packed_bitmap: attention in the rotated spaces equals fp64 attention over the decoded vectors", "[packed_bitmap]") {
  for (const int d : {64, 128, 256})
    for (const int group : {1, 4, 8}) {
      const cache_config c = small_config(d, group);
      const synthetic::kv_config sc = synthetic_config(c);
      for (const int g : {1, 2, 4}) {
        for (const int n : {1, 64, 300}) {
          cache<format::packed_bitmap> kv(c, make(0.25f, g));
          const sequence_id seq = kv.add_sequence();
          const synthetic::kv_data data = synthetic::generate_kv(sc, 7, n);
          kv.prefill(seq, test::k_view(data), test::v_view(data));
          const std::vector<float> q = synthetic::generate_query(sc, 7, n);
          INFO("head_dim " << d << " group " << group << " g " << g << " tokens " << n);
          if (n < 64) {  // all in the tail: dense
            (void)check_against_decoded(kv, seq, c, q, false);
            continue;
          }
          CHECK(check_against_decoded(kv, seq, c, q, true) < 1e-5);
        }
      }
    }
}

TEST_CASE("packed_bitmap: several segments, appends, a fork and a compaction", "[packed_bitmap]") {
  const cache_config c = small_config();
  const synthetic::kv_config sc = synthetic_config(c);
  const synthetic::kv_data data = synthetic::generate_kv(sc, 9, 1400);
  format::packed_bitmap f = make(0.25f, 2, 0.25f, 256);
  f.sink_tokens = 4;
  cache<format::packed_bitmap, select::all, compact::repack> kv(c, f);
  const sequence_id seq = kv.add_sequence();
  const synthetic::kv_data prompt = test::tokens_of(data, [] {
    std::vector<std::int64_t> t(1000);
    std::iota(t.begin(), t.end(), 0);
    return t;
  }());
  kv.prefill(seq, test::k_view(prompt), test::v_view(prompt));
  // Appends: 400 tokens, one at a time (pages 16-21 start segment 4 from its first page).
  for (int t = 1000; t < 1400; ++t) {
    const synthetic::kv_data one = test::tokens_of(data, {t});
    kv.append(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(one.k.data(), 1, 2, 128),
              tensor_view<const float, 3>(one.v.data(), 1, 2, 128));
  }
  REQUIRE(kv.pages(seq).size() == 21);
  const std::vector<float> q = synthetic::generate_query(sc, 9, 1400);
  const double before = check_against_decoded(kv, seq, c, q, false);
  CHECK(before < 1e-5);
  // Each segment has its own basis: segments 0 and 1 differ.
  CHECK(kv.engine().segment(kv.slot(seq), 0, 0).basis[0] != kv.engine().segment(kv.slot(seq), 4, 0).basis[0]);
  // A fork shares the pages and the segments: the same outputs.
  const sequence_id child = kv.fork_sequence(seq);
  std::vector<float> a(q.size()), b(q.size());
  kv.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, 8, 128), tensor_view<float, 3>(a.data(), 1, 8, 128));
  kv.attend(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(q.data(), 1, 8, 128), tensor_view<float, 3>(b.data(), 1, 8, 128));
  CHECK(a == b);
  kv.remove_sequence(child);
  // Evict every third token of the first 900 and compact: moved tokens are re-encoded in their
  // new page's segment; attention still equals attention over what the cache holds.
  std::vector<std::int64_t> evicted;
  for (std::int64_t t = 5; t < 900; t += 3) evicted.push_back(t);
  kv.evict(seq, span<const std::int64_t>(evicted.data(), evicted.size()));
  const compaction_report report = kv.compact(seq);
  CHECK(report.pages_freed >= 4);
  CHECK(check_against_decoded(kv, seq, c, q, false) < 1e-5);
}

TEST_CASE("packed_bitmap: fidelity against exact attention improves with the retained fraction", "[packed_bitmap]") {
  const cache_config c = small_config();
  const synthetic::kv_config sc = synthetic_config(c);
  const synthetic::kv_data data = synthetic::generate_kv(sc, 11, 2048);
  const std::vector<float> q = synthetic::generate_query(sc, 11, 2048);
  const double scale = 1.0 / std::sqrt(128.0);
  const std::vector<double> exact = host::exact_attention(tensor_view<const float, 2>(q.data(), 8, 128), test::k_view(data), test::v_view(data), scale);
  double previous = 1e9;
  for (const float retained : {0.25f, 0.375f, 0.5f}) {
    cache<format::packed_bitmap> kv(c, make(retained, 1));
    const sequence_id seq = kv.add_sequence();
    kv.prefill(seq, test::k_view(data), test::v_view(data));
    std::vector<float> out(q.size());
    kv.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, 8, 128), tensor_view<float, 3>(out.data(), 1, 8, 128));
    const host::fidelity fid = host::compare(out.data(), exact.data(), out.size());
    INFO("retained " << retained << ": rel L2 " << fid.rel_l2_error << ", cosine " << fid.cosine);
    CHECK(fid.rel_l2_error < previous);
    previous = fid.rel_l2_error;
  }
  CHECK(previous < 0.5);  // half the channels after the rotation: well short of a random output
}

TEST_CASE("packed_bitmap: bad parameters are rejected naming them", "[packed_bitmap]") {
  const cache_config c = small_config();
  const auto rejects = [&](const format::packed_bitmap& f, const std::string& parameter) {
    try {
      cache<format::packed_bitmap> kv(c, f);
      FAIL("accepted " << format_traits<format::packed_bitmap>::describe(f));
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find("format::packed_bitmap") != std::string::npos);
      CHECK(std::string(e.what()).find(parameter + " =") != std::string::npos);
    }
  };
  rejects(make(0.25f, 3), "group");
  rejects(make(0.8f, 1), "retained");           // more than the 96 kept channels
  rejects(make(0.3f, 1), "retained");           // 38.4 channels
  rejects(make(0.0f, 1), "retained");
  rejects(make(0.25f, 1, 1.0f), "truncated");   // nothing left
  rejects(make(0.25f, 1, 0.1f), "truncated");   // 115.2 channels
  rejects(make(0.046875f, 4), "retained");      // 6 channels: not whole groups of 4
  rejects(make(0.25f, 1, 0.25f, 100), "segment_tokens");
}
