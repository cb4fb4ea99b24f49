// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Non-owning views over caller-owned memory (host or device). A view is a pointer plus extents
/// and strides in elements; it never allocates or frees, and it is trivially copyable so it can be
/// passed to a kernel by value. `tensor_view<T, Rank>` is a minimal, C++17 stand-in for
/// `std::mdspan` with a right-most-contiguous default layout.

#include <cstdint>
#include <type_traits>

#include "kvmosaic/core/config.hpp"

namespace kvmosaic {

/// A strided view of `Rank` dimensions over elements of `T`. Index with `view(i, j, ...)`.
/// Cost: an index is a dot product of the indices with the strides; no bounds checks.
template <class T, int Rank>
class tensor_view {
  static_assert(Rank >= 1 && Rank <= 4, "kvmosaic: tensor_view Rank must be 1 to 4");

 public:
  using element_type = T;
  static constexpr int rank = Rank;

  tensor_view() = default;

  /// A contiguous (row-major) view: the last extent varies fastest.
  template <class... Extents, class = std::enable_if_t<sizeof...(Extents) == Rank>>
  KVMOSAIC_HOST_DEVICE tensor_view(T* data, Extents... extents) noexcept : data_(data) {
    const std::int64_t list[] = {static_cast<std::int64_t>(extents)...};
    std::int64_t stride = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      extents_[d] = list[d];
      strides_[d] = stride;
      if (d > 0) stride *= list[d];  // the outermost extent is never multiplied: any int64 count fits
    }
  }

  /// A view with explicit strides (in elements).
  KVMOSAIC_HOST_DEVICE static tensor_view strided(T* data, const std::int64_t (&extents)[Rank],
                                                  const std::int64_t (&strides)[Rank]) noexcept {
    tensor_view v;
    v.data_ = data;
    for (int d = 0; d < Rank; ++d) {
      v.extents_[d] = extents[d];
      v.strides_[d] = strides[d];
    }
    return v;
  }

  /// Views of `T` convert to views of `const T`.
  template <class U, class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_same<U, T>::value>>
  KVMOSAIC_HOST_DEVICE tensor_view(const tensor_view<U, Rank>& other) noexcept : data_(other.data()) {
    for (int d = 0; d < Rank; ++d) {
      extents_[d] = other.extent(d);
      strides_[d] = other.stride(d);
    }
  }

  KVMOSAIC_HOST_DEVICE T* data() const noexcept { return data_; }
  KVMOSAIC_HOST_DEVICE std::int64_t extent(int d) const noexcept { return extents_[d]; }
  KVMOSAIC_HOST_DEVICE std::int64_t stride(int d) const noexcept { return strides_[d]; }
  KVMOSAIC_HOST_DEVICE std::int64_t size() const noexcept {
    std::int64_t n = 1;
    for (int d = 0; d < Rank; ++d) n *= extents_[d];
    return n;
  }
  KVMOSAIC_HOST_DEVICE bool empty() const noexcept { return size() == 0; }

  /// True when the elements are packed row-major with no gaps.
  KVMOSAIC_HOST_DEVICE bool is_contiguous() const noexcept {
    std::int64_t stride = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      if (extents_[d] != 1 && strides_[d] != stride) return false;
      stride *= extents_[d];
    }
    return true;
  }

  template <class... Indices, class = std::enable_if_t<sizeof...(Indices) == Rank>>
  KVMOSAIC_HOST_DEVICE T& operator()(Indices... indices) const noexcept {
    const std::int64_t list[] = {static_cast<std::int64_t>(indices)...};
    std::int64_t offset = 0;
    for (int d = 0; d < Rank; ++d) offset += list[d] * strides_[d];
    return data_[offset];
  }

 private:
  T* data_ = nullptr;
  std::int64_t extents_[Rank] = {};
  std::int64_t strides_[Rank] = {};
};

/// A contiguous one-dimensional view.
template <class T>
using span = tensor_view<T, 1>;

namespace detail {

/// Whether two views can reach a common byte: their address ranges (from the lowest to the
/// highest element their extents and strides reach) intersect. Conservative for interleaved
/// strided views; exact for contiguous ones. Cost: O(Rank).
template <class A, int RankA, class B, int RankB>
bool views_overlap(const tensor_view<A, RankA>& a, const tensor_view<B, RankB>& b) noexcept {
  const auto range = [](const auto& v, std::uintptr_t& lo, std::uintptr_t& hi) {
    using E = std::remove_pointer_t<decltype(v.data())>;
    std::int64_t first = 0, last = 0;  // element offsets
    for (int d = 0; d < std::decay_t<decltype(v)>::rank; ++d) {
      if (v.extent(d) == 0) return false;
      const std::int64_t reach = (v.extent(d) - 1) * v.stride(d);
      (reach < 0 ? first : last) += reach;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(v.data());
    lo = base + static_cast<std::uintptr_t>(first * static_cast<std::int64_t>(sizeof(E)));
    hi = base + static_cast<std::uintptr_t>((last + 1) * static_cast<std::int64_t>(sizeof(E)));
    return true;
  };
  std::uintptr_t a_lo = 0, a_hi = 0, b_lo = 0, b_hi = 0;
  if (!range(a, a_lo, a_hi) || !range(b, b_lo, b_hi)) return false;
  return a_lo < b_hi && b_lo < a_hi;
}

}  // namespace detail

}  // namespace kvmosaic
