// SPDX-License-Identifier: Apache-2.0
#pragma once

// Test support: run the cache and the fp64 oracle on the same synthetic data, and the tolerance
// that the storage dtype and fp32 arithmetic imply for each output element.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// A worst-case bound on |attend(stored K, V) - exact(K, V)| for every element of one query head's
/// output, derived (not tuned) from:
///   - storage rounding: |k' - k| <= u|k| + a, |v' - v| <= u|v| + a (u unit roundoff, a half the
///     subnormal spacing of the storage dtype);
///   - fp32 arithmetic: each logit is a D-term dot product (error <= gamma_D sum |q k|), each output
///     a sum over a page plus one merge per page (error <= gamma_n max|v|), gamma_n = n u32/(1-n u32).
/// A logit error of at most delta per token moves every softmax weight by a factor within
/// e^{+-2 delta}, so the output moves by at most (e^{2 delta} - 1) max_t |v_t,c|, plus the V rounding.
struct error_bound {
  std::vector<double> per_element;  // [num_q_heads][head_dim]
};

inline double gamma(double n) {
  const double u32 = 5.9604644775390625e-08;
  return n * u32 / (1.0 - n * u32);
}

/// One query head's probabilities over a step's live slots, added into its expected token
/// scores: p = exp(s - m) / l over the slots whose position is >= 0 (`logit`, scaled, by slot),
/// into score[position x heads + h], summed over the group or its largest (`combine`). With each
/// logit within `delta` of the kernel's, p moves by a factor within e^{4 delta + 2 u range}
/// (1 + gamma_terms), u the fp32 unit roundoff and range the largest m - s: `bound` gets p times
/// that, combined alike.
inline void add_probabilities(const std::vector<double>& logit, const std::vector<std::int64_t>& slots, int heads, int h,
                              double delta, double terms, group_combine combine, std::vector<double>& score,
                              std::vector<double>& bound) {
  double m = -INFINITY;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i] >= 0) m = std::max(m, logit[i]);
  double l = 0, range = 0;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i] >= 0) {
      l += std::exp(logit[i] - m);
      range = std::max(range, m - logit[i]);
    }
  const double relative = std::expm1(4 * delta + 2 * std::ldexp(1.0, -24) * range) + gamma(terms);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;
    const double p = std::exp(logit[i] - m) / l;
    const std::size_t at = static_cast<std::size_t>(slots[i]) * heads + static_cast<std::size_t>(h);
    if (combine == group_combine::sum) {
      score[at] += p;
      bound[at] += p * relative;
    } else {
      score[at] = std::max(score[at], p);
      bound[at] = std::max(bound[at], p * relative);
    }
  }
}

/// The bound for K, V rounded to `storage` (u, a of that dtype) and fp32 arithmetic.
/// With `exact_storage` the data is taken as already stored (u = a = 0): only fp32 arithmetic counts.
/// `q_rounding` is the relative error of q inside a kernel that multiplies a rounded q (the
/// tensor-core path keeps q as hi + lo 16-bit parts: 2^-16 for bf16, 2^-22 for f16); `p_rounding`
/// the relative error of the softmax weights in a kernel that multiplies p . V that way.
/// `blocks`: the blocks an implementation folds (pages, sink rows, tail) when more than the
/// tokens fill (a cache with evicted tokens); 0: ceil(tokens / page_size).
inline error_bound attention_error_bound(const std::vector<float>& q, const synthetic::kv_data& kv, int group_size,
                                         double softmax_scale, dtype storage, int page_size,
                                         bool exact_storage = false, double q_rounding = 0.0,
                                         double p_rounding = 0.0, double blocks = 0.0) {
  const double u = exact_storage ? 0.0 : unit_roundoff(storage);
  const double a = exact_storage ? 0.0
                   : storage == dtype::f16 ? dtype_traits<half>::subnormal_half_spacing
                                           : dtype_traits<bfloat16>::subnormal_half_spacing;
  const int d = kv.head_dim, heads = kv.num_kv_heads, n = kv.num_tokens;
  const double pages = std::max(blocks, std::ceil(static_cast<double>(n) / page_size));
  const double gamma_dot = gamma(d + 2);                 // dot product, scale, exp
  const double gamma_sum = gamma(page_size + pages + 4);  // p.v in a page, merges, final divide
  error_bound bound;
  bound.per_element.assign(static_cast<std::size_t>(heads) * group_size * d, 0.0);
  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < group_size; ++g) {
      const float* qj = q.data() + static_cast<std::size_t>(h * group_size + g) * d;
      double delta = 0;
      std::vector<double> v_max(static_cast<std::size_t>(d), 0.0);
      for (int t = 0; t < n; ++t) {
        double storage_err = 0, magnitude = 0;
        for (int c = 0; c < d; ++c) {
          const double k = std::abs(static_cast<double>(kv.k[(static_cast<std::size_t>(t) * heads + h) * d + c]));
          storage_err += std::abs(static_cast<double>(qj[c])) * (u * k + a + q_rounding * k);
          magnitude += std::abs(static_cast<double>(qj[c])) * k * (1 + u);
          const double v = std::abs(static_cast<double>(kv.v[(static_cast<std::size_t>(t) * heads + h) * d + c]));
          v_max[static_cast<std::size_t>(c)] = std::max(v_max[static_cast<std::size_t>(c)], v);
        }
        delta = std::max(delta, softmax_scale * (storage_err + gamma_dot * magnitude));
      }
      double* out = bound.per_element.data() + static_cast<std::size_t>(h * group_size + g) * d;
      for (int c = 0; c < d; ++c) {
        const double vm = v_max[static_cast<std::size_t>(c)];
        out[c] = (std::expm1(2 * delta) + u + gamma_sum + p_rounding) * vm * (1 + u) + a;
      }
    }
  }
  return bound;
}

}  // namespace kvmosaic::test

namespace kvmosaic::test {

/// The same data rounded to the storage dtype, as the cache stores it.
inline synthetic::kv_data rounded(const synthetic::kv_data& kv, dtype storage) {
  synthetic::kv_data r = kv;
  const auto round = [storage](float x) { return storage == dtype::f16 ? to_float(half(x)) : to_float(bfloat16(x)); };
  for (float& x : r.k) x = round(x);
  for (float& x : r.v) x = round(x);
  return r;
}

/// The tokens `tokens` of `kv` (in the order given), as a kv_data of their own: what a cache that
/// evicted the others holds.
inline synthetic::kv_data tokens_of(const synthetic::kv_data& kv, const std::vector<std::int64_t>& tokens) {
  synthetic::kv_data out = kv;
  const auto row = static_cast<std::int64_t>(kv.num_kv_heads) * kv.head_dim;
  out.k.clear();
  out.v.clear();
  for (const std::int64_t t : tokens) {
    out.k.insert(out.k.end(), kv.k.begin() + t * row, kv.k.begin() + (t + 1) * row);
    out.v.insert(out.v.end(), kv.v.begin() + t * row, kv.v.begin() + (t + 1) * row);
  }
  out.num_tokens = static_cast<int>(tokens.size());
  return out;
}

/// Views of a kv_data's K and V as [tokens][kv_heads][head_dim].
inline tensor_view<const float, 3> k_view(const synthetic::kv_data& kv) {
  return tensor_view<const float, 3>(kv.k.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim);
}
inline tensor_view<const float, 3> v_view(const synthetic::kv_data& kv) {
  return tensor_view<const float, 3>(kv.v.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim);
}

/// fp64 exact attention of query q ([Hq][D]) over kv.
inline std::vector<double> exact(const std::vector<float>& q, const synthetic::kv_data& kv, double softmax_scale) {
  const tensor_view<const float, 2> qv(q.data(), static_cast<std::int64_t>(q.size()) / kv.head_dim, kv.head_dim);
  return host::exact_attention(qv, k_view(kv), v_view(kv), softmax_scale);
}

}  // namespace kvmosaic::test
