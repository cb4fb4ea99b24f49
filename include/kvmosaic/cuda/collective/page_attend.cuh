// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The per-format attend collective: folds one page (or the dense tail) of one KV head into the
/// running online-softmax state of a CTA's threads, computing q.k and p.v on the stored form.
///
/// The decode kernel (kernel/decode.cuh) is generic; each format specializes `page_attend` on its
/// tag. The thread mapping all collectives share: a CTA of `Threads` threads is `rows` token rows of
/// `lanes_per_row` lanes, each lane owning 8 consecutive channels (16 bytes) of head_dim; a thread
/// keeps q, m, l and o for those channels and every query head of the group (`thread_state`).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/config.hpp"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/vector_io.cuh"
#include "kvmosaic/format/dense.hpp"

namespace kvmosaic::cuda {

/// What each thread carries through a split: its 8-channel slice of the (pre-scaled) queries of
/// the group, and per query head the running max `m`, sum `l` and unnormalized output slice `o`.
template <int Group>
struct thread_state {
  float q[Group][detail::vector_elements];
  float m[Group];
  float l[Group];
  float o[Group][detail::vector_elements];
};

/// Where a collective reads a page from: global memory (streamed, the portable path) or shared
/// memory (staged there by bulk copies, the sm_90 path).
struct from_global {
  __device__ __forceinline__ static uint4 load(const std::byte* address) { return detail::load_streaming(address); }
};
struct from_shared {
  __device__ __forceinline__ static uint4 load(const std::byte* address) { return detail::load_shared(address); }
};

/// Primary template: a format without a CUDA attend collective.
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll>
struct page_attend {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this format has no CUDA attend collective yet: specialize "
                "kvmosaic::cuda::page_attend<Format, ...> (see cuda/collective/page_attend.cuh)");
};

/// Dense pages: rows of head_dim 16-bit values. Each step a thread loads `Unroll` 16-byte slices of
/// K and of V (all in flight before first use), reduces its partial dot products across the lanes
/// of its row with shuffles, and updates its state once per step (one rescale per `Unroll` tokens).
/// Cost per token and query head: head_dim FMAs for q.k and for p.v, log2(lanes_per_row) shuffles
/// shared by the row, one exp. Bytes: exactly the page rows read, once.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
struct page_attend<format::dense, T, HeadDim, Group, Threads, Unroll> {
  static constexpr int vec = detail::vector_elements;
  static constexpr int lanes_per_row = HeadDim / vec;
  static constexpr int rows = Threads / lanes_per_row;
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));
  static_assert(lanes_per_row <= 32 && 32 % lanes_per_row == 0, "a token row must fit in one warp");
  static_assert(Threads % 32 == 0 && rows >= 1, "Threads must be whole warps covering at least one row");

  /// Folds tokens [0, n) of the K rows at `k` and the V rows at `v` (in memory space `Space`) into
  /// `s`: those whose bit is set in `rows_read` (bit t % 32 of word t / 32), or all of them when it
  /// is null; the others are neither loaded nor counted. Every thread of the CTA calls it with the
  /// same n (the shuffles need the whole warp). With `logits` (a step that records token
  /// scores), the scaled logit of token t and head j goes to logits[t * Group + j] for every t < n
  /// (-inf for a token not read).
  template <class Space = from_global>
  __device__ __forceinline__ static void fold(const std::byte* __restrict__ k, const std::byte* __restrict__ v,
                                              int n, thread_state<Group>& s, const std::uint32_t* rows_read = nullptr,
                                              float* logits = nullptr) {
    const int lane = static_cast<int>(threadIdx.x) % lanes_per_row;
    const int row = static_cast<int>(threadIdx.x) / lanes_per_row;
    const std::byte* k_lane = k + lane * 16;
    const std::byte* v_lane = v + lane * 16;
    for (int t0 = 0; t0 < n; t0 += rows * Unroll) {
      uint4 k_raw[Unroll], v_raw[Unroll];
      bool read[Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const int t = t0 + row + rows * u;
        read[u] = t < n && (rows_read == nullptr || ((rows_read[t >> 5] >> (t & 31)) & 1u) != 0);
        if (read[u]) {
          k_raw[u] = Space::load(k_lane + static_cast<std::size_t>(t) * row_bytes);
          v_raw[u] = Space::load(v_lane + static_cast<std::size_t>(t) * row_bytes);
        } else {
          k_raw[u] = make_uint4(0, 0, 0, 0);
          v_raw[u] = make_uint4(0, 0, 0, 0);
        }
      }
      float logit[Group][Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        float key[vec];
        detail::widen<T>(k_raw[u], key);
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < vec; ++i) dot = fmaf(s.q[g][i], key[i], dot);
          logit[g][u] = dot;
        }
      }
#pragma unroll
      for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g)
#pragma unroll
          for (int u = 0; u < Unroll; ++u) logit[g][u] += __shfl_xor_sync(0xffffffffu, logit[g][u], offset);
      }
      if (rows_read != nullptr) {  // a row not read counts as a logit of -inf: p = 0
#pragma unroll
        for (int u = 0; u < Unroll; ++u)
#pragma unroll
          for (int g = 0; g < Group; ++g) logit[g][u] = read[u] ? logit[g][u] : -HUGE_VALF;
      }
      if (logits != nullptr && lane == 0) {
#pragma unroll
        for (int u = 0; u < Unroll; ++u) {
          const int t = t0 + row + rows * u;
          if (t < n)
#pragma unroll
            for (int g = 0; g < Group; ++g) logits[static_cast<std::size_t>(t) * Group + g] = logit[g][u];
        }
      }
      update(logit, v_raw, t0, row, n, s);
    }
  }

  /// As `fold`, with the logits already computed (by tensor cores): `logits[g * stride + t]` for
  /// the n tokens of the V rows at `v`.
  template <class Space = from_shared>
  __device__ __forceinline__ static void fold_scored(const float* logits, int stride, const std::byte* __restrict__ v,
                                                     int n, thread_state<Group>& s) {
    const int lane = static_cast<int>(threadIdx.x) % lanes_per_row;
    const int row = static_cast<int>(threadIdx.x) / lanes_per_row;
    const std::byte* v_lane = v + lane * 16;
    for (int t0 = 0; t0 < n; t0 += rows * Unroll) {
      uint4 v_raw[Unroll];
      float logit[Group][Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const int t = t0 + row + rows * u;
        const bool valid = t < n;
        v_raw[u] = valid ? Space::load(v_lane + static_cast<std::size_t>(t) * row_bytes) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int g = 0; g < Group; ++g) logit[g][u] = valid ? logits[g * stride + t] : -HUGE_VALF;
      }
      update(logit, v_raw, t0, row, n, s);
    }
  }

 private:
  /// The online-softmax step shared by both folds: one rescale per `Unroll` tokens, then p.v.
  __device__ __forceinline__ static void update(const float (&logit)[Group][Unroll], const uint4 (&v_raw)[Unroll], int t0,
                                                int row, int n, thread_state<Group>& s) {
    float value[Unroll][vec];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) detail::widen<T>(v_raw[u], value[u]);
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      float step_max = -HUGE_VALF;
#pragma unroll
      for (int u = 0; u < Unroll; ++u)
        if (t0 + row + rows * u < n) step_max = fmaxf(step_max, logit[g][u]);
      const float m_new = fmaxf(s.m[g], step_max);
      if (m_new == -HUGE_VALF) continue;  // this row has seen no token yet
      const float rescale = __expf(s.m[g] - m_new);
      s.l[g] *= rescale;
#pragma unroll
      for (int i = 0; i < vec; ++i) s.o[g][i] *= rescale;
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const float p = t0 + row + rows * u < n ? __expf(logit[g][u] - m_new) : 0.0f;
        s.l[g] += p;
#pragma unroll
        for (int i = 0; i < vec; ++i) s.o[g][i] = fmaf(p, value[u][i], s.o[g][i]);
      }
      s.m[g] = m_new;
    }
  }
};

}  // namespace kvmosaic::cuda
