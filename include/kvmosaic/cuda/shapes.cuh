// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Which kernel shapes a CUDA cache compiles. A shape is (storage dtype, head_dim, GQA group
/// size): the template arguments of every decode kernel. `backend::cuda` compiles every supported
/// shape (2 dtypes x 3 head dims x 8 group sizes); `backend::cuda_for<kernel_shape<...>, ...>`
/// compiles only the listed ones, so an engine that knows its model builds one shape:
///
/// ```cpp
/// using backend = kvmosaic::backend::cuda_for<kvmosaic::kernel_shape<kvmosaic::dtype::bf16, 128, 4>>;
/// kvmosaic::cache<kvmosaic::format::quant2, kvmosaic::select::all, kvmosaic::compact::none, backend> kv(config);
/// ```
///
/// A cache whose run-time `cache_config` is not one of its backend's shapes is rejected at
/// construction with an error listing them. `detail::dispatch_shape` is the one place where a
/// run-time shape becomes template arguments.

#include <string>
#include <type_traits>

#include "kvmosaic/core/config.hpp"
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"

namespace kvmosaic {

/// One kernel shape: the storage dtype (f16 or bf16), head_dim and GQA group size.
template <dtype Storage, int HeadDim, int GroupSize>
struct kernel_shape {
  static_assert(Storage == dtype::f16 || Storage == dtype::bf16, "kvmosaic::kernel_shape: Storage must be dtype::f16 or dtype::bf16");
  static_assert(limits::is_supported_head_dim(HeadDim), "kvmosaic::kernel_shape: HeadDim must be 64, 128 or 256");
  static_assert(limits::is_supported_group_size(GroupSize), "kvmosaic::kernel_shape: GroupSize must be 1 to 8");
  static constexpr dtype storage = Storage;
  static constexpr int head_dim = HeadDim;
  static constexpr int group_size = GroupSize;
  /// The element type of the storage dtype.
  using element = std::conditional_t<Storage == dtype::f16, half, bfloat16>;
};

namespace backend {
/// Pages in device memory; prefill, append and attention run as CUDA kernels, compiled for the
/// listed `kernel_shape`s only, or for every supported shape when the list is empty.
template <class... Shapes>
struct cuda_for {
  using policy_category = backend_tag;
  static constexpr const char* name = "cuda";
};
/// The CUDA backend with kernels for every supported shape.
using cuda = cuda_for<>;
}  // namespace backend

namespace cuda::detail {

template <class T>
struct is_kernel_shape : std::false_type {};
template <dtype S, int D, int G>
struct is_kernel_shape<kernel_shape<S, D, G>> : std::true_type {};

/// A list of kernel shapes (empty: every supported shape).
template <class... Shapes>
struct shape_list {
  static_assert((is_kernel_shape<Shapes>::value && ...),
                "kvmosaic::backend::cuda_for: every argument must be a kvmosaic::kernel_shape<dtype, head_dim, group_size>");
  static constexpr bool all = sizeof...(Shapes) == 0;

  /// Whether (storage, head_dim, group_size) is a listed shape; group_size 0: any group.
  static bool contains(dtype storage, int head_dim, int group_size) noexcept {
    if constexpr (all) {
      return (storage == dtype::f16 || storage == dtype::bf16) && limits::is_supported_head_dim(head_dim) &&
             (group_size == 0 || limits::is_supported_group_size(group_size));
    } else {
      return ((storage == Shapes::storage && head_dim == Shapes::head_dim &&
               (group_size == 0 || group_size == Shapes::group_size)) ||
              ...);
    }
  }
  /// "bf16/128/4, f16/64/1" or "every supported shape", for messages.
  static std::string describe() {
    if constexpr (all) {
      return "every supported shape";
    } else {
      std::string s;
      ((s += (s.empty() ? "" : ", ") + std::string(to_string(Shapes::storage)) + "/" + std::to_string(Shapes::head_dim) + "/" +
             std::to_string(Shapes::group_size)),
       ...);
      return s;
    }
  }
};

template <class Backend>
struct shapes_of;
template <class... Shapes>
struct shapes_of<backend::cuda_for<Shapes...>> {
  using type = shape_list<Shapes...>;
};
/// The kernel shapes of a CUDA backend (`backend::cuda_for<...>`), as an engine lists them.
template <class Backend>
using shapes_of_t = typename shapes_of<Backend>::type;

/// Calls f(element{}) for the element type of the run-time `type` (float, half or bfloat16):
/// where the engine turns an input or output array's dtype into template arguments, so that its
/// kernel-launching members are not templates (an explicit instantiation covers them).
template <class F>
void dispatch_io_type(dtype type, F&& f) {
  switch (type) {
    case dtype::f32: return f(float{});
    case dtype::f16: return f(half{});
    case dtype::bf16: return f(bfloat16{});
  }
  kvmosaic::detail::require(false, "cuda::dispatch_io_type", "dtype", static_cast<int>(type), "f32, f16 or bf16");
}

/// Calls f(element{}, head_dim constant, group constant) for the listed shape that matches the
/// run-time one; `group_size` 0 matches any group (kernels that do not depend on it: the first
/// listed group is passed, 1 for the full list). Throws `invalid_argument` when none matches.
template <class... Shapes, class F>
void dispatch_shape(shape_list<Shapes...>, dtype storage, int head_dim, int group_size, F&& f) {
  const auto fail = [&] {
    kvmosaic::detail::require(false, "cuda::dispatch_shape", "storage/head_dim/group_size",
                              std::string(to_string(storage)) + "/" + std::to_string(head_dim) + "/" + std::to_string(group_size),
                              shape_list<Shapes...>::describe().c_str());
  };
  if constexpr (sizeof...(Shapes) == 0) {
    const auto by_group = [&](auto element, auto dim) {
      switch (group_size) {
        case 0:
        case 1: return f(element, dim, std::integral_constant<int, 1>{});
        case 2: return f(element, dim, std::integral_constant<int, 2>{});
        case 3: return f(element, dim, std::integral_constant<int, 3>{});
        case 4: return f(element, dim, std::integral_constant<int, 4>{});
        case 5: return f(element, dim, std::integral_constant<int, 5>{});
        case 6: return f(element, dim, std::integral_constant<int, 6>{});
        case 7: return f(element, dim, std::integral_constant<int, 7>{});
        case 8: return f(element, dim, std::integral_constant<int, 8>{});
      }
      fail();
    };
    const auto by_dim = [&](auto element) {
      switch (head_dim) {
        case 64: return by_group(element, std::integral_constant<int, 64>{});
        case 128: return by_group(element, std::integral_constant<int, 128>{});
        case 256: return by_group(element, std::integral_constant<int, 256>{});
      }
      fail();
    };
    if (storage == dtype::f16) return by_dim(half{});
    if (storage == dtype::bf16) return by_dim(bfloat16{});
    fail();
  } else {
    bool done = false;
    const auto try_shape = [&](auto shape) {
      using S = decltype(shape);
      if (done || storage != S::storage || head_dim != S::head_dim || (group_size != 0 && group_size != S::group_size)) return;
      done = true;
      f(typename S::element{}, std::integral_constant<int, S::head_dim>{}, std::integral_constant<int, S::group_size>{});
    };
    (try_shape(Shapes{}), ...);
    if (!done) fail();
  }
}

}  // namespace cuda::detail

namespace cuda {
/// Whether `Backend` (a `backend::cuda_for<...>`) compiles kernels for the shape (storage dtype,
/// head_dim, GQA group size; 0: any group): a cache on that backend accepts a `cache_config` of
/// that shape only then, and rejects others with an error naming the shapes. Lets a caller that
/// takes shapes at run time fall back before it builds a cache. O(number of listed shapes), no
/// CUDA call.
template <class Backend>
bool compiles_shape(dtype storage, int head_dim, int group_size) noexcept {
  return detail::shapes_of_t<Backend>::contains(storage, head_dim, group_size);
}
/// The shapes `Backend` compiles, for messages: "bf16/128/4, f16/64/1" or "every supported shape".
template <class Backend>
std::string compiled_shapes() {
  return detail::shapes_of_t<Backend>::describe();
}
}  // namespace cuda
}  // namespace kvmosaic
