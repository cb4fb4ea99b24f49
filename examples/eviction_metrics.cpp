// SPDX-License-Identifier: Apache-2.0
// kvmosaic_eviction_metrics: how well the keep-less selectors keep, on the synthetic workload
// (host backend, dense pages of 64, compact::repack). select::streaming (4 sinks), select::tova,
// select::h2o and select::snapkv (window 32, its queries those of the prompt's last 32 positions),
// and the last three per KV head (select::per_kv_head), at budgets 1/8 and 1/4 of the context: each sequence is prefilled with `--context` tokens (snapkv
// then snapshots), then decodes `--steps` tokens, each step an attend then an append (TOVA and H2O
// evict after a write, by the scores of the steps before it). Every 8th step from the first,
// averaged over the batch and those steps:
//   - the output's relative L2 error and cosine against fp64 exact attention over every token the
//     sequence was given (evicted ones included);
//   - recall of the exact top-k attention tokens (k = the budget; per query head, fp64 weights over
//     every token) among the tokens the cache still holds for that query head's KV head, and the
//     exact attention mass they carry;
//   - the live tokens and the pool pages held (x 64 tokens) at the end, as fractions of the length
//     (per KV head, averaged over the heads, for the per-head rows).
//
//   kvmosaic_eviction_metrics [--context 8192] [--batch 2] [--steps 136] [--json FILE]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

#include "exact_weights.hpp"

using namespace kvmosaic;
using kvmosaic_examples::exact_weights;

namespace {

struct options {
  int context = 8192;
  int batch = 2;
  int steps = 136;
  std::string json;
};

struct eviction_row {
  std::string selector;
  double budget = 0, recall = 0, mass = 0, rel_l2 = 0, cosine = 0, live = 0, pages = 0;
};

struct workload {
  cache_config config;
  synthetic::kv_config generator;
  int context = 0, steps = 0;
  std::vector<synthetic::kv_data> kv;  // context + steps tokens per sequence
};

using kvmosaic::detail::policy_of;

/// The positions KV head `head` of `seq` holds (every head's, unless the selector decides per head).
template <class Cache>
std::vector<std::int64_t> positions_of(const Cache& kv, sequence_id seq, int head) {
  if constexpr (detail::is_per_kv_head<typename Cache::selector_type>::value) return kv.positions(seq, head);
  else return (void)head, kv.positions(seq);
}

template <class Cache>
void snapshot_if_snapkv(Cache& kv, const workload& w, sequence_id seq, std::size_t b) {
  using selector_type = typename Cache::selector_type;
  if constexpr (std::is_same_v<typename policy_of<selector_type>::type, select::snapkv>) {
    const cache_config& c = w.config;
    selector_type s = kv.selector();
    const int window = policy_of<selector_type>::get(s).window;
    std::vector<float> q;  // the queries of positions context - window ... context - 1
    for (int t = w.context - window; t < w.context; ++t) {
      const auto one = synthetic::generate_query(w.generator, b, t + 1);
      q.insert(q.end(), one.begin(), one.end());
    }
    kv.snapshot(seq, tensor_view<const float, 3>(q.data(), window, c.num_q_heads(), c.head_dim));
  } else {
    (void)kv, (void)w, (void)seq, (void)b;
  }
}

/// Runs one selector at one budget over the workload; appends a row.
template <class Selector>
void measure(const workload& w, Selector selector, int inverse, std::vector<eviction_row>& rows) {
  const cache_config& c = w.config;
  auto& policy = policy_of<Selector>::get(selector);
  policy.budget = select::token_budget{1.0 / inverse, -1};
  cache<format::dense, Selector, compact::repack> kv(c, {}, selector);
  const int hq = c.num_q_heads(), d = c.head_dim, g = c.group_size;
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * d;
  std::vector<sequence_id> seqs;
  for (std::size_t b = 0; b < w.kv.size(); ++b) {
    seqs.push_back(kv.add_sequence());
    kv.prefill(seqs.back(), tensor_view<const float, 3>(w.kv[b].k.data(), w.context, c.num_kv_heads, d),
               tensor_view<const float, 3>(w.kv[b].v.data(), w.context, c.num_kv_heads, d));
    snapshot_if_snapkv(kv, w, seqs.back(), b);
  }
  const auto batch = static_cast<std::int64_t>(seqs.size());
  eviction_row r;
  r.selector = selector_traits<Selector>::describe(kv.selector());
  r.budget = 1.0 / inverse;
  int measured = 0;
  for (int step = 0; step < w.steps; ++step) {
    const int n = w.context + step;
    std::vector<float> q;
    for (std::size_t b = 0; b < w.kv.size(); ++b) {
      const auto one = synthetic::generate_query(w.generator, b, n);
      q.insert(q.end(), one.begin(), one.end());
    }
    std::vector<float> out(q.size());
    kv.attend(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
              tensor_view<float, 3>(out.data(), batch, hq, d));
    if (step % 8 == 1) {  // after the first write, when TOVA and H2O have evicted
      ++measured;
      for (std::size_t b = 0; b < w.kv.size(); ++b) {
        const float* qb = q.data() + b * static_cast<std::size_t>(hq) * d;
        const auto exact = host::exact_attention(tensor_view<const float, 2>(qb, hq, d),
                                                 tensor_view<const float, 3>(w.kv[b].k.data(), n, c.num_kv_heads, d),
                                                 tensor_view<const float, 3>(w.kv[b].v.data(), n, c.num_kv_heads, d),
                                                 1.0 / std::sqrt(static_cast<double>(d)));
        const host::fidelity f = host::compare(out.data() + b * static_cast<std::size_t>(hq) * d, exact.data(), exact.size());
        r.rel_l2 += f.rel_l2_error / static_cast<double>(batch);
        r.cosine += f.cosine / static_cast<double>(batch);
        const auto k = static_cast<std::size_t>(policy.budget.resolve(n));
        for (int j = 0; j < hq; ++j) {
          std::vector<char> held(static_cast<std::size_t>(n), 0);  // what query head j's KV head holds
          for (const std::int64_t p : positions_of(kv, seqs[b], j / g))
            if (p >= 0) held[static_cast<std::size_t>(p)] = 1;
          const kvmosaic_examples::held_share share = kvmosaic_examples::share_held(exact_weights(qb, j, w.kv[b], n, g), held, k);
          r.recall += share.topk_recall / static_cast<double>(batch * hq);
          r.mass += share.mass / static_cast<double>(batch * hq);
        }
      }
    }
    std::vector<float> k, v;  // the next token of every sequence
    for (std::size_t b = 0; b < w.kv.size(); ++b) {
      k.insert(k.end(), w.kv[b].k.begin() + static_cast<std::ptrdiff_t>(n * row), w.kv[b].k.begin() + static_cast<std::ptrdiff_t>((n + 1) * row));
      v.insert(v.end(), w.kv[b].v.begin() + static_cast<std::ptrdiff_t>(n * row), w.kv[b].v.begin() + static_cast<std::ptrdiff_t>((n + 1) * row));
    }
    kv.append(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(k.data(), batch, c.num_kv_heads, d),
              tensor_view<const float, 3>(v.data(), batch, c.num_kv_heads, d));
  }
  for (double* x : {&r.recall, &r.mass, &r.rel_l2, &r.cosine}) *x /= std::max(measured, 1);
  const double length = static_cast<double>(w.context + w.steps);
  constexpr bool per_head = detail::is_per_kv_head<Selector>::value;
  const int heads = per_head ? c.num_kv_heads : 1;  // live tokens and pages: the heads' mean
  for (const sequence_id seq : seqs)
    for (int h = 0; h < heads; ++h) {
      std::int64_t live = 0;
      for (const std::int64_t p : positions_of(kv, seq, h)) live += p >= 0;
      std::size_t pages = 0;
      if constexpr (per_head) pages = kv.lanes().pages(kv.lanes(seq)[static_cast<std::size_t>(h)]).size();
      else pages = kv.pages(seq).size();
      r.live += static_cast<double>(live) / length / static_cast<double>(batch * heads);
      r.pages += static_cast<double>(pages) * c.page_size / length / static_cast<double>(batch * heads);
    }
  std::printf("%-58s 1/%-2d recall %.3f  mass %.3f  relL2 %.3f  cos %.4f  live %.3f  pages %.3f\n", r.selector.c_str(), inverse,
              r.recall, r.mass, r.rel_l2, r.cosine, r.live, r.pages);
  std::fflush(stdout);
  rows.push_back(r);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i], value = argv[i + 1];
    if (arg == "--context") o.context = std::atoi(value.c_str());
    else if (arg == "--batch") o.batch = std::atoi(value.c_str());
    else if (arg == "--steps") o.steps = std::atoi(value.c_str());
    else if (arg == "--json") o.json = value;
    else {
      std::fprintf(stderr, "usage: kvmosaic_eviction_metrics [--context N] [--batch N] [--steps N] [--json FILE]\n");
      return 2;
    }
  }
  if (o.context < 256 || o.batch < 1 || o.steps < 2) {
    std::fprintf(stderr, "kvmosaic_eviction_metrics: --context >= 256, --batch >= 1, --steps >= 2\n");
    return 2;
  }
  try {
    workload w;
    w.config.num_kv_heads = 8;
    w.config.group_size = 4;
    w.config.head_dim = 128;
    w.config.page_size = 64;
    w.config.max_sequences = o.batch;
    w.config.max_pages = o.batch * ((o.context + o.steps) / 64 + 2);
    w.generator.num_kv_heads = 8;
    w.generator.group_size = 4;
    w.generator.head_dim = 128;
    w.context = o.context;
    w.steps = o.steps;
    for (int b = 0; b < o.batch; ++b)
      w.kv.push_back(synthetic::generate_kv(w.generator, static_cast<std::uint64_t>(b), o.context + o.steps));
    std::printf("eviction metrics: context %d, batch %d, %d steps, 8 KV heads x 4, head_dim 128, bf16, pages of 64, "
                "compact::repack (host backend)\n", o.context, o.batch, o.steps);
    std::vector<eviction_row> rows;
    for (const int inverse : {8, 4}) {
      select::streaming streaming;  // 4 sinks and the most recent tokens
      measure(w, streaming, inverse, rows);
      measure(w, select::tova{}, inverse, rows);
      measure(w, select::h2o{}, inverse, rows);
      measure(w, select::snapkv{}, inverse, rows);
      measure(w, select::per_kv_head<select::tova>{}, inverse, rows);  // one decision per KV head
      measure(w, select::per_kv_head<select::h2o>{}, inverse, rows);
      measure(w, select::per_kv_head<select::snapkv>{}, inverse, rows);
      select::per_kv_head<select::snapkv> ada;  // Ada-KV: the heads' budgets allocated by the votes
      ada.adaptive = true;
      measure(w, ada, inverse, rows);
    }
    if (!o.json.empty()) {
      std::ofstream f(o.json);
      f.precision(6);
      f << "{\"context\": " << o.context << ", \"batch\": " << o.batch << ", \"steps\": " << o.steps << ", \"rows\": [\n";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const eviction_row& r = rows[i];
        f << "  {\"selector\": \"" << r.selector << "\", \"budget\": " << r.budget << ", \"topk_recall\": " << r.recall
          << ", \"mass_recall\": " << r.mass << ", \"rel_l2_error\": " << r.rel_l2 << ", \"cosine\": " << r.cosine
          << ", \"live_tokens\": " << r.live << ", \"pages_held\": " << r.pages << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      f << "]}\n";
      std::printf("wrote %s\n", o.json.c_str());
    }
  } catch (const kvmosaic::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
