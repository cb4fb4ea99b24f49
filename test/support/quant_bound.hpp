// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a quantized (format::quant<Bits, ValueAxis>) cache attends over (its pages decoded, its tail as stored), and the error bounds
// of its output: against exact attention on those values (the 8-bit q and p steps), and between
// two implementations of Eq. 4 that draw the same codes (the host and the CUDA kernels).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// `stored` (the rows as the cache stores them, rounded to its dtype) with every token on a page
/// replaced by what the page decodes to, but the sink tokens and the recent window (kept dense).
/// `cache` is a host-backend cache of a quantized format.
template <class Cache>
synthetic::kv_data quant_decoded(const Cache& cache, sequence_id id, synthetic::kv_data stored) {
  using traits = format_traits<std::decay_t<decltype(cache.format())>>;
  const cache_config& c = cache.config();
  const page_shape shape{c.page_size, c.head_dim, c.storage};
  std::vector<float> rows(static_cast<std::size_t>(c.page_size) * c.head_dim);
  const auto& pages = cache.pages(id);
  const int sinks = cache.format().sink_tokens;
  const std::size_t window_from = pages.size() * c.page_size - std::min<std::size_t>(cache.format().recent_tokens, pages.size() * c.page_size);
  for (std::size_t pg = 0; pg < pages.size(); ++pg)
    for (int h = 0; h < c.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        if (is_v)
          traits::decode_v(cache.format(), shape, cache.engine().v_page(pages[pg], h), c.page_size, rows.data());
        else
          traits::decode_k(cache.format(), shape, cache.engine().k_page(pages[pg], h), c.page_size, rows.data());
        for (int t = pg == 0 ? sinks : 0; t < c.page_size && pg * c.page_size + static_cast<std::size_t>(t) < window_from; ++t)
          for (int ch = 0; ch < c.head_dim; ++ch)
            (is_v ? stored.v : stored.k)[((pg * c.page_size + static_cast<std::size_t>(t)) * c.num_kv_heads + h) *
                                             c.head_dim +
                                         ch] = rows[static_cast<std::size_t>(t) * c.head_dim + ch];
      }
  return stored;
}

/// V per token (`value_axis::head_dim`): p' = p s_tj is quantized per partition of Pi tokens, so
/// each p' is off by at most half a step of max_t p'_t / 255 and multiplies a code up to L: per
/// partition P of a page, Pi L e^(m_b - M) max_(t in P) s_tj, the role sum_t e^(m_b(t) - M) |v_tc|
/// plays for V per channel (the same factors 1/510, 1/255 then apply).
template <class Cache, class Pages, class OnCodes>
double folded_p_term(const Cache& cache, const Pages& pages, int h, int ch, const std::vector<double>& page_weight,
                     const OnCodes& on_codes) {
  using format_type = std::decay_t<decltype(cache.format())>;
  const cache_config& c = cache.config();
  const int page = c.page_size, pi = cache.format().partition;
  const page_shape shape{page, c.head_dim, c.storage};
  const detail::quant_layout layout = detail::quant_layout_of(cache.format(), shape, false);
  double term = 0;
  for (std::size_t pg = 0; pg < pages.size(); ++pg) {
    const detail::quant_page_view view{layout, cache.engine().v_page(pages[pg], h)};
    for (int j = 0; j < page / pi; ++j) {
      double s_max = 0;
      for (int t = j * pi; t < (j + 1) * pi; ++t)
        if (on_codes(static_cast<int>(pg) * page + t)) s_max = std::max<double>(s_max, view.scale(layout.partition_of(t, ch)));
      term += page_weight[pg] * pi * format_type::levels * s_max;
    }
  }
  return term;
}

/// Per-output bounds for one sequence's attention output [num_q_heads][head_dim].
struct quant_bounds {
  /// |out - exact| on the decoded values. With the page logits computed on the codes (8-bit q)
  /// off the exact ones by at most D (measured with the host's score), softmax weights move by
  /// at most a factor e^(2D): (e^(2D) - 1) max_t |v_tc|; each p (page-local, in (0, 1]) is off by
  /// at most half a step of 1/255: e^(3D) / 510 sum_t e^(m_b(t) - M) |v_tc| / L, with m_b the
  /// exact maximum of t's page, M the global one, L = sum_t e^(s_t - M); plus fp32 slack.
  std::vector<double> vs_exact;
  /// |a - b| for two evaluations of Eq. 4 on the same codes and the same 8-bit q': their logits
  /// differ by fp32 rounding, at most delta = 2^-16 sum_c |q_c| max_t |k_tc| (sums of at most 256
  /// terms, 256 unit roundoffs), and where that moves a p across a rounding boundary of its 8-bit
  /// grid, that p's code differs by one step (<= 1/255): (e^(2 delta) - 1) max_t |v_tc| +
  /// e^(2 delta) / 255 sum_t e^(m_b(t) - M) |v_tc| / L, plus fp32 slack.
  std::vector<double> vs_twin;
};

/// The bounds for query q ([num_q_heads][head_dim], unscaled) of sequence `id` of the host quant2
/// cache `cache`, whose decoded values are `decoded` (quant_decoded).
template <class Cache>
quant_bounds quant_attention_bounds(const Cache& cache, sequence_id id, const std::vector<float>& q,
                                      const synthetic::kv_data& decoded, double scale) {
  using format_type = std::decay_t<decltype(cache.format())>;
  using traits = format_traits<format_type>;
  const cache_config& c = cache.config();
  const int d = c.head_dim, heads = c.num_kv_heads, page = c.page_size, groups = c.group_size;
  const page_shape shape{page, d, c.storage};
  const int length = static_cast<int>(cache.length(id));
  const auto& pages = cache.pages(id);
  const int full = static_cast<int>(pages.size()) * page;
  const int sinks = pages.empty() ? 0 : cache.format().sink_tokens;  // dense, as the tail
  const int window_from = full - std::min(cache.format().recent_tokens, full);  // so is the window
  const auto on_codes = [&](int t) { return t >= sinks && t < window_from; };
  quant_bounds bounds;
  bounds.vs_exact.resize(static_cast<std::size_t>(heads) * groups * d);
  bounds.vs_twin.resize(bounds.vs_exact.size());
  const auto k_at = [&](int t, int h, int ch) { return decoded.k[(static_cast<std::size_t>(t) * heads + h) * d + ch]; };
  const auto v_at = [&](int t, int h, int ch) { return decoded.v[(static_cast<std::size_t>(t) * heads + h) * d + ch]; };
  std::vector<float> scaled(static_cast<std::size_t>(d)), page_logits(static_cast<std::size_t>(page));
  std::vector<double> logit(static_cast<std::size_t>(length));
  for (int j = 0; j < heads * groups; ++j) {
    const int h = j / groups;
    for (int ch = 0; ch < d; ++ch)
      scaled[static_cast<std::size_t>(ch)] = q[static_cast<std::size_t>(j) * d + ch] * static_cast<float>(scale);
    double worst = 0, top = -1e300, magnitude = 0;
    for (int ch = 0; ch < d; ++ch) {
      double k_max = 0;
      for (int t = 0; t < length; ++t) k_max = std::max(k_max, std::abs(static_cast<double>(k_at(t, h, ch))));
      magnitude += std::abs(static_cast<double>(scaled[static_cast<std::size_t>(ch)])) * k_max;
    }
    for (int t = 0; t < length; ++t) {
      double exact_logit = 0;
      for (int ch = 0; ch < d; ++ch) exact_logit += static_cast<double>(scaled[static_cast<std::size_t>(ch)]) * k_at(t, h, ch);
      if (t < full && t % page == 0)
        traits::score(cache.format(), shape, cache.engine().k_page(pages[static_cast<std::size_t>(t / page)], h), page,
                      scaled.data(), 1, page_logits.data());
      if (on_codes(t)) worst = std::max(worst, std::abs(page_logits[static_cast<std::size_t>(t % page)] - exact_logit));
      logit[static_cast<std::size_t>(t)] = exact_logit;
      top = std::max(top, exact_logit);
    }
    const double delta = std::ldexp(magnitude, -16);
    double l = 0;
    for (const double x : logit) l += std::exp(x - top);
    std::vector<double> page_weight(pages.size());  // e^(m_b - M) per page
    for (std::size_t pg = 0; pg < pages.size(); ++pg) {
      const auto first = logit.begin() + static_cast<std::ptrdiff_t>(pg) * page;
      page_weight[pg] = std::exp(*std::max_element(first, first + page) - top);
    }
    for (int ch = 0; ch < d; ++ch) {
      double max_v = 0, p_term = 0;
      for (int t = 0; t < length; ++t) {
        const double value = std::abs(static_cast<double>(v_at(t, h, ch)));
        max_v = std::max(max_v, value);
        if (on_codes(t) && format_type::v_axis == format::value_axis::tokens)
          p_term += page_weight[static_cast<std::size_t>(t / page)] * value;
      }
      if constexpr (format_type::v_axis == format::value_axis::head_dim)
        p_term = folded_p_term(cache, pages, h, ch, page_weight, on_codes);
      const std::size_t i = static_cast<std::size_t>(j) * d + ch;
      bounds.vs_exact[i] = (std::exp(2 * worst) - 1) * max_v + std::exp(3 * worst) / 510 * p_term / l + 1e-5 * max_v;
      bounds.vs_twin[i] =
          (std::exp(2 * delta) - 1) * max_v + std::exp(2 * delta) / 255 * p_term / l + 1e-5 * max_v;
    }
  }
  return bounds;
}

/// `quant_attention_bounds`' `vs_exact` for a sequence of a cache that evicts: the attended
/// tokens are the live ones, `decoded` holds every position's values as attended (rows of live
/// sealed slots decoded from their pages, sink and tail rows as stored), `slots` the sequence's
/// sealed slots (per slot its position, -1 for a dead one; block-table order), `sealed` the first
/// tail position. A page's p are quantized after its own softmax over its live rows (dead rows
/// get p = 0), so the page term takes the maximum over the page's live rows on codes.
template <class Cache>
std::vector<double> quant_live_bounds(const Cache& cache, sequence_id id, const std::vector<float>& q,
                                       const synthetic::kv_data& decoded, const std::vector<std::int64_t>& slots,
                                       std::int64_t sealed, double scale) {
  using traits = format_traits<std::decay_t<decltype(cache.format())>>;
  static_assert(std::decay_t<decltype(cache.format())>::v_axis == format::value_axis::tokens,
                "quant_live_bounds: derived for V partitioned per channel (value_axis::tokens)");
  const cache_config& c = cache.config();
  const int d = c.head_dim, heads = c.num_kv_heads, page = c.page_size, groups = c.group_size;
  const page_shape shape{page, d, c.storage};
  const auto& pages = cache.pages(id);
  const int sinks = pages.empty() ? 0 : cache.format().sink_tokens;
  struct token {
    std::int64_t position;
    std::int64_t slot;  // -1: read as a dense row (a sink or a tail row)
  };
  std::vector<token> tokens;
  for (std::int64_t p = 0; p < sinks; ++p) tokens.push_back({p, -1});
  for (std::size_t x = 0; x < slots.size(); ++x) {
    const bool sink_row = x < static_cast<std::size_t>(sinks);  // masked in the page
    if (slots[x] >= 0 && !sink_row) tokens.push_back({slots[x], static_cast<std::int64_t>(x)});
  }
  for (std::int64_t p = sealed; p < decoded.num_tokens; ++p) tokens.push_back({p, -1});
  const auto k_at = [&](std::int64_t t, int h, int ch) { return decoded.k[(static_cast<std::size_t>(t) * heads + h) * d + ch]; };
  const auto v_at = [&](std::int64_t t, int h, int ch) { return decoded.v[(static_cast<std::size_t>(t) * heads + h) * d + ch]; };
  std::vector<double> bound(static_cast<std::size_t>(heads) * groups * d);
  std::vector<float> scaled(static_cast<std::size_t>(d)), page_logits(pages.size() * static_cast<std::size_t>(page));
  std::vector<double> logit(tokens.size());
  for (int j = 0; j < heads * groups; ++j) {
    const int h = j / groups;
    for (int ch = 0; ch < d; ++ch)
      scaled[static_cast<std::size_t>(ch)] = q[static_cast<std::size_t>(j) * d + ch] * static_cast<float>(scale);
    for (std::size_t pg = 0; pg < pages.size(); ++pg)
      traits::score(cache.format(), shape, cache.engine().k_page(pages[pg], h), page, scaled.data(), 1,
                    page_logits.data() + pg * static_cast<std::size_t>(page));
    double worst = 0, top = -1e300;
    std::vector<double> page_top(pages.size(), -1e300);  // max exact logit of the page's live rows on codes
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      double exact_logit = 0;
      for (int ch = 0; ch < d; ++ch)
        exact_logit += static_cast<double>(scaled[static_cast<std::size_t>(ch)]) * k_at(tokens[i].position, h, ch);
      logit[i] = exact_logit;
      top = std::max(top, exact_logit);
      if (tokens[i].slot >= 0) {
        const std::size_t pg = static_cast<std::size_t>(tokens[i].slot / page);
        worst = std::max(worst, std::abs(page_logits[static_cast<std::size_t>(tokens[i].slot)] - exact_logit));
        page_top[pg] = std::max(page_top[pg], exact_logit);
      }
    }
    double l = 0;
    for (const double x : logit) l += std::exp(x - top);
    for (int ch = 0; ch < d; ++ch) {
      double max_v = 0, p_term = 0;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        const double value = std::abs(static_cast<double>(v_at(tokens[i].position, h, ch)));
        max_v = std::max(max_v, value);
        if (tokens[i].slot >= 0) p_term += std::exp(page_top[static_cast<std::size_t>(tokens[i].slot / page)] - top) * value;
      }
      bound[static_cast<std::size_t>(j) * d + ch] =
          (std::exp(2 * worst) - 1) * max_v + std::exp(3 * worst) / 510 * p_term / l + 1e-5 * max_v;
    }
  }
  return bound;
}

}  // namespace kvmosaic::test
