// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Policy categories. Each policy struct (a format, a selector, a compactor) declares which kind of
/// policy it is with a member `using policy_category = kvmosaic::format_tag;` (or `selector_tag`,
/// `compactor_tag`). The composition checks the category of each template argument first, so a
/// misplaced or foreign type is rejected with one sentence rather than a page of template errors.

#include <type_traits>

namespace kvmosaic {

struct format_tag {};     ///< how one page of K and V is stored
struct selector_tag {};   ///< which tokens a query reads (or which the cache keeps)
struct compactor_tag {};  ///< how evicted tokens turn into freed pages
struct backend_tag {};    ///< where the data lives and the kernels run (host or cuda)

namespace detail {
/// Maps (Backend, Format, Selector) to the backend's engine type; each backend specializes it.
template <class Backend, class Format, class Selector>
struct engine_for {
  static_assert(sizeof(Backend) == 0,
                "kvmosaic: no engine for this backend: include kvmosaic/kvmosaic.cuh for backend::cuda");
};

template <class T, class Category, class = void>
struct has_policy_category : std::false_type {};
template <class T, class Category>
struct has_policy_category<T, Category, std::void_t<typename T::policy_category>>
    : std::is_same<typename T::policy_category, Category> {};
}  // namespace detail

/// True when `T` is a storage format, a selector, a compactor, a backend.
template <class T>
inline constexpr bool is_format_v = detail::has_policy_category<T, format_tag>::value;
template <class T>
inline constexpr bool is_selector_v = detail::has_policy_category<T, selector_tag>::value;
template <class T>
inline constexpr bool is_compactor_v = detail::has_policy_category<T, compactor_tag>::value;
template <class T>
inline constexpr bool is_backend_v = detail::has_policy_category<T, backend_tag>::value;

}  // namespace kvmosaic
