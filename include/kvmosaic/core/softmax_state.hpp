// SPDX-License-Identifier: Apache-2.0
#pragma once

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

#include "kvmosaic/core/config.hpp"

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
