// SPDX-License-Identifier: Apache-2.0
// kvmosaic_selector_metrics: how well the read-less selectors read, on the synthetic workload with
// sentence structure (host backend). For select::quest and select::sentence_chunks over dense,
// bitmap_tiles (s = 0.7) and quant2 (Pi = 64, 4 sinks) (and quest with blocks of 16 tokens, the
// Quest paper's page size, over dense), select::mean_keys (whole pages and blocks of 16) over
// dense and quant2, and quest and mean_keys (blocks of 16) over packed_bitmap (25% retained, 4
// sinks), at budgets 1/16, 1/8 and 1/4 of the
// context, per decode step:
//   - recall of the exact top-k attention tokens (k = the budget; per query head, fp64 weights over
//     every token), and the exact attention mass of the tokens read;
//   - the output's relative L2 error and cosine against fp64 exact attention over every token;
//   - tokens and bytes read per step as fractions of a dense full read (pages touched, tail, sinks,
//     and the selector's bounds);
//   - reuse: of one step's selected tokens, the fraction the next step reads again (over --steps
//     appended tokens).
// And, for quest, how the GQA group's combined selection (max, sum) recalls each query head's own
// top-k blocks.
//
//   kvmosaic_selector_metrics [--context 32768] [--batch 2] [--steps 4] [--json FILE]

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
  int context = 32768;
  int batch = 2;
  int steps = 4;
  std::string json;
};

struct metrics_row {
  std::string format, selector;
  double budget = 0, recall = 0, mass = 0, rel_l2 = 0, cosine = 0, tokens_read = 0, bytes_read = 0, reuse = 0;
};

struct combine_row {
  std::string combine;
  double budget = 0, recall = 0;
};

struct workload {
  cache_config config;
  synthetic::kv_config generator;
  int context = 0, steps = 0;
  std::vector<synthetic::kv_data> kv;          // context + steps tokens per sequence
  std::vector<synthetic::token_stream> tokens;
};

std::vector<select::boundary> boundaries() {
  std::vector<select::boundary> b;
  for (const auto& t : synthetic::boundary_tokens) b.push_back(select::boundary{t.id, t.weight});
  return b;
}

/// Runs one selector over one format at every budget; appends rows.
template <class Format, class Selector>
void measure(const workload& w, const Format& format, Selector selector, std::vector<metrics_row>& rows) {
  const cache_config& c = w.config;
  cache<Format, Selector> kv(c, format, selector);
  std::vector<sequence_id> seqs;
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  for (std::size_t b = 0; b < w.kv.size(); ++b) {
    seqs.push_back(kv.add_sequence());
    const tensor_view<const float, 3> k(w.kv[b].k.data(), w.context, c.num_kv_heads, c.head_dim);
    const tensor_view<const float, 3> v(w.kv[b].v.data(), w.context, c.num_kv_heads, c.head_dim);
    kv.prefill(seqs.back(), k, v, span<const std::int32_t>(w.tokens[b].ids.data(), w.context));
  }
  const int hq = c.num_q_heads(), d = c.head_dim, g = c.group_size;
  const auto batch = static_cast<std::int64_t>(seqs.size());
  const double dense_row_bytes = 2.0 * c.num_kv_heads * d * 2;  // K and V of one token, 16-bit
  for (const int inverse : {16, 8, 4}) {
    kv.set_budget(select::token_budget{1.0 / inverse, -1});
    metrics_row r;
    r.format = format_traits<Format>::describe(format);
    r.selector = selector_traits<Selector>::describe(kv.selector());
    r.budget = 1.0 / inverse;
    double reuse_sum = 0;
    int reuse_count = 0;
    for (int step = 0; step <= (inverse == 16 ? w.steps : 0); ++step) {
      const int n = w.context + step;
      if (step > 0) {  // one more token per sequence, with its id
        std::vector<float> k, v;
        std::vector<std::int32_t> ids;
        for (std::size_t b = 0; b < w.kv.size(); ++b) {
          k.insert(k.end(), w.kv[b].k.begin() + static_cast<std::ptrdiff_t>((n - 1) * row), w.kv[b].k.begin() + static_cast<std::ptrdiff_t>(n * row));
          v.insert(v.end(), w.kv[b].v.begin() + static_cast<std::ptrdiff_t>((n - 1) * row), w.kv[b].v.begin() + static_cast<std::ptrdiff_t>(n * row));
          ids.push_back(w.tokens[b].ids[static_cast<std::size_t>(n - 1)]);
        }
        kv.append(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(k.data(), batch, c.num_kv_heads, d),
                  tensor_view<const float, 3>(v.data(), batch, c.num_kv_heads, d), span<const std::int32_t>(ids.data(), batch));
      }
      std::vector<float> q;
      for (std::size_t b = 0; b < w.kv.size(); ++b) {
        const auto one = synthetic::generate_query(w.generator, b, n);
        q.insert(q.end(), one.begin(), one.end());
      }
      std::vector<float> out(q.size());
      kv.attend(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
                tensor_view<float, 3>(out.data(), batch, hq, d));
      for (std::size_t b = 0; b < w.kv.size(); ++b) {
        const selection_stats stats = kv.selection(seqs[b]);
        if (step > 0) {
          reuse_sum += stats.reuse;
          ++reuse_count;
          continue;
        }
        // Fidelity against exact attention over every token.
        const std::vector<float> qb(q.begin() + static_cast<std::ptrdiff_t>(b) * hq * d, q.begin() + static_cast<std::ptrdiff_t>(b + 1) * hq * d);
        const auto exact = host::exact_attention(tensor_view<const float, 2>(qb.data(), hq, d),
                                                 tensor_view<const float, 3>(w.kv[b].k.data(), n, c.num_kv_heads, d),
                                                 tensor_view<const float, 3>(w.kv[b].v.data(), n, c.num_kv_heads, d),
                                                 1.0 / std::sqrt(static_cast<double>(d)));
        const host::fidelity f = host::compare(out.data() + b * static_cast<std::size_t>(hq) * d, exact.data(), exact.size());
        r.rel_l2 += f.rel_l2_error / static_cast<double>(batch);
        r.cosine += f.cosine / static_cast<double>(batch);
        // What was read, per KV head: the selection, then everything from the open chunk or the tail on, and sinks.
        const std::int64_t sealed = static_cast<std::int64_t>(kv.pages(seqs[b]).size()) * c.page_size;
        std::int64_t always_from = sealed;
        if constexpr (selector_traits<Selector>::needs_token_ids) {
          const auto chunks = kv.chunks(seqs[b]);
          always_from = std::min(always_from, chunks.empty() ? std::int64_t{0} : chunks.back().end);
        }
        const std::int64_t budget = static_cast<std::int64_t>(std::floor(static_cast<double>(n) / inverse));
        for (int h = 0; h < c.num_kv_heads; ++h) {
          std::vector<char> read(static_cast<std::size_t>(n), 0);
          for (const auto& [from, to] : kv.selected_ranges(seqs[b], h))
            for (std::int64_t t = from; t < to; ++t) read[static_cast<std::size_t>(t)] = 1;
          for (std::int64_t t = always_from; t < n; ++t) read[static_cast<std::size_t>(t)] = 1;
          for (int t = 0; t < sink_rows(format) && sealed > 0; ++t) read[static_cast<std::size_t>(t)] = 1;
          for (int j = h * g; j < (h + 1) * g; ++j) {
            const auto k = static_cast<std::size_t>(std::min<std::int64_t>(budget, n));
            const kvmosaic_examples::held_share share = kvmosaic_examples::share_held(exact_weights(qb.data(), j, w.kv[b], n, g), read, k);
            r.recall += share.topk_recall / static_cast<double>(batch * hq);
            r.mass += share.mass / static_cast<double>(batch * hq);
          }
        }
        const memory_stats m = kv.sequence_memory(seqs[b]);
        const double pages = static_cast<double>(kv.pages(seqs[b]).size());
        const double page_bytes = static_cast<double>(kv.engine().page_slot_bytes());
        // Pages touched, the tail and sink rows, and every bound the scoring reads.
        const double bounds = static_cast<double>(m.stored_bytes) - pages * page_bytes -
                              static_cast<double>(n - sealed + (sealed > 0 ? sink_rows(format) : 0)) * dense_row_bytes;
        const double bytes = stats.pages_read * page_bytes + static_cast<double>(n - sealed + (sealed > 0 ? sink_rows(format) : 0)) * dense_row_bytes + bounds;
        r.tokens_read += stats.tokens_read / n / static_cast<double>(batch);
        r.bytes_read += bytes / (n * dense_row_bytes) / static_cast<double>(batch);
      }
    }
    r.reuse = reuse_count > 0 ? reuse_sum / reuse_count : std::nan("");
    std::printf("%-34s %-48s 1/%-3d recall %.3f  mass %.3f  relL2 %.3f  cos %.4f  tokens %.3f  bytes %.3f  reuse %s\n",
                r.format.c_str(), r.selector.c_str(), inverse, r.recall, r.mass, r.rel_l2, r.cosine, r.tokens_read, r.bytes_read,
                std::isnan(r.reuse) ? "-" : std::to_string(r.reuse).c_str());
    std::fflush(stdout);
    rows.push_back(r);
  }
}

/// Quest's group combination: per query head, its own top-k pages (scored with its query alone)
/// against the pages selected for the whole group by max and by sum.
void measure_combine(const workload& w, std::vector<combine_row>& rows) {
  const cache_config& c = w.config;
  select::quest s;
  s.block_tokens = 0;  // pages, as the per-head comparison selects
  cache<format::dense, select::quest> kv(c, {}, s);
  std::vector<sequence_id> seqs;
  for (std::size_t b = 0; b < w.kv.size(); ++b) {
    seqs.push_back(kv.add_sequence());
    kv.prefill(seqs.back(), tensor_view<const float, 3>(w.kv[b].k.data(), w.context, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(w.kv[b].v.data(), w.context, c.num_kv_heads, c.head_dim));
  }
  const int d = c.head_dim, g = c.group_size;
  for (const int inverse : {16, 8, 4}) {
    double recall_max = 0, recall_sum = 0, count = 0;
    for (std::size_t b = 0; b < w.kv.size(); ++b) {
      const auto q = synthetic::generate_query(w.generator, b, w.context);
      const auto& pages = kv.pages(seqs[b]);
      const std::int64_t budget = w.context / inverse;
      std::vector<std::int32_t> weights(pages.size(), c.page_size);
      std::vector<float> lo_hi(2 * static_cast<std::size_t>(d));
      for (int h = 0; h < c.num_kv_heads; ++h) {
        std::vector<std::vector<float>> head_scores(static_cast<std::size_t>(g), std::vector<float>(pages.size()));
        std::vector<float> by_max(pages.size()), by_sum(pages.size());
        for (std::size_t i = 0; i < pages.size(); ++i) {
          format_traits<format::dense>::decode_k(format::dense{}, page_shape{2, d, c.storage}, kv.engine().page_bounds(pages[i], h, 0), 2,
                                                 lo_hi.data());
          std::vector<float> per(static_cast<std::size_t>(g));
          for (int j = 0; j < g; ++j)
            per[static_cast<std::size_t>(j)] = head_scores[static_cast<std::size_t>(j)][i] =
                detail::span_score(q.data() + static_cast<std::size_t>(h * g + j) * d, d, [&](int ch) {
                  return std::make_pair(lo_hi[static_cast<std::size_t>(ch)], lo_hi[static_cast<std::size_t>(d + ch)]);
                });
          by_max[i] = detail::combine_scores(per.data(), g, group_combine::max);
          by_sum[i] = detail::combine_scores(per.data(), g, group_combine::sum);
        }
        const auto chosen_max = detail::budget_prefix(by_max, weights, budget);
        const auto chosen_sum = detail::budget_prefix(by_sum, weights, budget);
        for (int j = 0; j < g; ++j) {
          const auto own = detail::budget_prefix(head_scores[static_cast<std::size_t>(j)], weights, budget);
          if (own.empty()) continue;
          const auto hits = [&](const std::vector<std::int32_t>& chosen) {
            double n = 0;
            for (const std::int32_t i : own) n += std::binary_search(chosen.begin(), chosen.end(), i);
            return n / static_cast<double>(own.size());
          };
          recall_max += hits(chosen_max);
          recall_sum += hits(chosen_sum);
          count += 1;
        }
      }
    }
    rows.push_back(combine_row{"max", 1.0 / inverse, recall_max / count});
    rows.push_back(combine_row{"sum", 1.0 / inverse, recall_sum / count});
    std::printf("quest GQA combine at 1/%d: recall of each query head's own top pages: max %.3f, sum %.3f\n", inverse,
                recall_max / count, recall_sum / count);
  }
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
      std::fprintf(stderr, "usage: kvmosaic_selector_metrics [--context N] [--batch N] [--steps N] [--json FILE]\n");
      return 2;
    }
  }
  if (o.context < 256 || o.batch < 1 || o.steps < 1) {
    std::fprintf(stderr, "kvmosaic_selector_metrics: --context >= 256, --batch >= 1, --steps >= 1\n");
    return 2;
  }
  try {
    workload w;
    w.config.num_kv_heads = 8;
    w.config.group_size = 4;
    w.config.head_dim = 128;
    w.config.page_size = 64;
    w.config.max_sequences = o.batch;
    w.config.max_pages = o.batch * ((o.context + o.steps) / 64 + 1);
    w.generator.num_kv_heads = 8;
    w.generator.group_size = 4;
    w.generator.head_dim = 128;
    w.context = o.context;
    w.steps = o.steps;
    for (int b = 0; b < o.batch; ++b) {
      w.kv.push_back(synthetic::generate_kv(w.generator, static_cast<std::uint64_t>(b), o.context + o.steps));
      w.tokens.push_back(synthetic::generate_tokens(w.generator, static_cast<std::uint64_t>(b), o.context + o.steps));
    }
    std::printf("selector metrics: context %d, batch %d, 8 KV heads x 4, head_dim 128, bf16, pages of 64 (host backend)\n",
                o.context, o.batch);
    std::vector<metrics_row> rows;
    select::quest quest;  // one block per page
    quest.block_tokens = 0;
    select::sentence_chunks chunks;
    chunks.boundaries = boundaries();
    format::bitmap_tiles sparse;
    sparse.s_k = sparse.s_v = 0.7f;
    sparse.sink_tokens = 0;
    format::quant2 codes;
    codes.mode = format::rounding::stochastic;
    codes.sink_tokens = 4;
    select::quest quest16;  // Quest's own page size (host backend: sub-page blocks)
    quest16.block_tokens = 16;
    select::quest quest_sum = quest;  // the other group combination, for comparison
    quest_sum.combine = group_combine::sum;
    measure(w, format::dense{}, quest, rows);
    measure(w, format::dense{}, quest_sum, rows);
    measure(w, format::dense{}, quest16, rows);
    measure(w, format::dense{}, chunks, rows);
    measure(w, sparse, quest, rows);
    measure(w, sparse, chunks, rows);
    measure(w, codes, quest, rows);
    measure(w, codes, chunks, rows);
    // MosaicKV's stage 2 (select::mean_keys) against quest on the same data: whole pages and blocks
    // of 16, over dense and quant2, and over MosaicKV's own format (packed_bitmap, 25% retained).
    select::mean_keys means;  // one block per page
    means.block_tokens = 0;
    select::mean_keys means16;
    means16.block_tokens = 16;
    measure(w, format::dense{}, means, rows);
    measure(w, format::dense{}, means16, rows);
    measure(w, codes, means, rows);
    format::packed_bitmap packed;
    packed.sink_tokens = 4;
    measure(w, packed, quest16, rows);
    measure(w, packed, means16, rows);
    std::vector<combine_row> combine;
    measure_combine(w, combine);
    if (!o.json.empty()) {
      std::ofstream f(o.json);
      f.precision(6);
      f << "{\"context\": " << o.context << ", \"batch\": " << o.batch << ", \"rows\": [\n";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const metrics_row& r = rows[i];
        f << "  {\"format\": \"" << r.format << "\", \"selector\": \"" << r.selector << "\", \"budget\": " << r.budget
          << ", \"topk_recall\": " << r.recall << ", \"mass_recall\": " << r.mass << ", \"rel_l2_error\": " << r.rel_l2
          << ", \"cosine\": " << r.cosine << ", \"tokens_read\": " << r.tokens_read << ", \"bytes_read\": " << r.bytes_read
          << ", \"reuse\": " << (std::isnan(r.reuse) ? std::string("null") : std::to_string(r.reuse)) << "}"
          << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      f << "], \"gqa_combine\": [\n";
      for (std::size_t i = 0; i < combine.size(); ++i)
        f << "  {\"combine\": \"" << combine[i].combine << "\", \"budget\": " << combine[i].budget << ", \"own_topk_recall\": "
          << combine[i].recall << "}" << (i + 1 < combine.size() ? ",\n" : "\n");
      f << "]}\n";
      std::printf("wrote %s\n", o.json.c_str());
    }
  } catch (const kvmosaic::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
