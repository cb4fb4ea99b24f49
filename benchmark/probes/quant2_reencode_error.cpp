// SPDX-License-Identifier: Apache-2.0
// Probe (docs/eviction.md, "quant2 and re-encoding"): what a compaction's re-encode adds to
// quant2's error. A quant2 cache (2 KV heads x group 4, head_dim 128, pages of 64, Pi = 64) of
// 4,096 synthetic tokens loses `evicted` of its sealed tokens at random, then runs `passes`
// rounds of (repack; evict a further 10% of the live sealed tokens). After each pass, the
// relative L2 error of one query's attention against fp64 exact attention over the survivors is
// compared with the error of a fresh cache holding the same survivors (their first encode), and
// the pages it holds with the pages the fresh cache holds; at max_reencodes = 1 (the default) and
// 255 (practically no limit). Mean over 8 seeds. Host only, not part of the build:
//   g++ -std=c++17 -O2 -I include -I test -isystem /usr/include/eigen3 benchmark/probes/quant2_reencode_error.cpp -o /tmp/q2_probe && /tmp/q2_probe
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"
#include "support/feed.hpp"
#include "support/oracle.hpp"

using namespace kvmosaic;

namespace {

template <class Cache>
std::vector<float> attend_one(Cache& kv, sequence_id seq, const std::vector<float>& q) {
  const cache_config& c = kv.config();
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> out(q.size());
  const sequence_id one[] = {seq};
  kv.attend(span<const sequence_id>(one, 1), tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d));
  return out;
}

double relative_error(const std::vector<float>& out, const std::vector<double>& exact) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    num += (out[i] - exact[i]) * (out[i] - exact[i]);
    den += exact[i] * exact[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main() {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = 64;
  c.max_pages = 256;
  c.max_sequences = 2;
  const int tokens = 4096, trials = 8, passes = 4;
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  std::printf("| seal rounding | max_reencodes | evicted | pass | error: fresh encode of the survivors | error: after the passes | ratio | pages: fresh | pages: held |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto rounding : {format::rounding::stochastic, format::rounding::nearest})
    for (const int limit : {1, 255})
    for (const double fraction : {0.5, 0.9}) {
      std::vector<double> fresh_error(passes + 1, 0.0), error(passes + 1, 0.0), fresh_pages(passes + 1, 0.0), pages(passes + 1, 0.0);
      for (int trial = 0; trial < trials; ++trial) {
        const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 100 + trial), 0, tokens);
        format::quant2 f;
        f.partition = 64;
        f.mode = rounding;
        f.sink_tokens = 0;
        f.max_reencodes = limit;
        cache<format::quant2, select::all, compact::repack> kv(c, f);
        const sequence_id seq = kv.add_sequence();
        kv.prefill(seq, test::k_view(data), test::v_view(data));
        std::mt19937_64 rng(static_cast<std::uint64_t>(trial));
        std::vector<std::int64_t> dead;
        for (std::int64_t t = 0; t < tokens - 64; ++t)
          if (std::bernoulli_distribution(fraction)(rng)) dead.push_back(t);
        kv.evict(seq, span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())));
        std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
        for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3f * static_cast<float>(i)) * 2;
        for (int pass = 0; pass <= passes; ++pass) {
          if (pass > 0) kv.compact(seq);
          std::vector<std::int64_t> live;
          for (const std::int64_t p : kv.positions(seq))
            if (p >= 0) live.push_back(p);
          std::sort(live.begin(), live.end());
          synthetic::kv_data kept = data;
          kept.k.clear();
          kept.v.clear();
          for (const std::int64_t t : live) {
            kept.k.insert(kept.k.end(), data.k.begin() + t * static_cast<std::int64_t>(row), data.k.begin() + (t + 1) * static_cast<std::int64_t>(row));
            kept.v.insert(kept.v.end(), data.v.begin() + t * static_cast<std::int64_t>(row), data.v.begin() + (t + 1) * static_cast<std::int64_t>(row));
          }
          kept.num_tokens = static_cast<int>(live.size());
          const std::vector<double> exact = test::exact(q, kept, 1.0 / std::sqrt(128.0));
          error[static_cast<std::size_t>(pass)] += relative_error(attend_one(kv, seq, q), exact) / trials;
          cache<format::quant2> fresh(c, f);
          const sequence_id s = fresh.add_sequence();
          fresh.prefill(s, test::k_view(kept), test::v_view(kept));
          fresh_error[static_cast<std::size_t>(pass)] += relative_error(attend_one(fresh, s, q), exact) / trials;
          pages[static_cast<std::size_t>(pass)] += static_cast<double>(kv.pool().used_pages()) / trials;
          fresh_pages[static_cast<std::size_t>(pass)] += static_cast<double>(fresh.pool().used_pages()) / trials;
          if (pass < passes) {  // a further 10% of the live sealed tokens
            const std::int64_t sealed_to = kv.length(seq) - 64;
            std::vector<std::int64_t> more;
            for (const std::int64_t t : live)
              if (t < sealed_to && std::bernoulli_distribution(0.1)(rng)) more.push_back(t);
            kv.evict(seq, span<const std::int64_t>(more.data(), static_cast<std::int64_t>(more.size())));
          }
        }
      }
      for (int pass = 0; pass <= passes; ++pass)
        std::printf("| %s | %d | %.0f%% | %d | %.4f | %.4f | %.2f | %.1f | %.1f |\n",
                    rounding == format::rounding::stochastic ? "stochastic" : "nearest", limit, 100 * fraction, pass,
                    fresh_error[static_cast<std::size_t>(pass)], error[static_cast<std::size_t>(pass)],
                    error[static_cast<std::size_t>(pass)] / fresh_error[static_cast<std::size_t>(pass)],
                    fresh_pages[static_cast<std::size_t>(pass)], pages[static_cast<std::size_t>(pass)]);
    }
}
