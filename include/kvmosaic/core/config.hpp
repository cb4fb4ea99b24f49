// kvmosaic: compressed KV-cache structures and decode-attention kernels.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Library-wide configuration: version, the host/device function qualifiers, and the limits that
/// every part of the library shares (supported head_dim, GQA group sizes, page sizes). Those limits
/// live here, once, so compile-time checks (`static_assert`) and runtime checks (`kvmosaic::error`)
/// state the same allowed values.

#define KVMOSAIC_VERSION_MAJOR 0
#define KVMOSAIC_VERSION_MINOR 1
#define KVMOSAIC_VERSION_PATCH 0
#define KVMOSAIC_VERSION_STRING "0.1.0"

#if defined(__CUDACC__)
/// Marks functions usable from host code and from CUDA device code.
#  define KVMOSAIC_HOST_DEVICE __host__ __device__
#  define KVMOSAIC_DEVICE __device__
#  define KVMOSAIC_FORCEINLINE __forceinline__
#else
#  define KVMOSAIC_HOST_DEVICE
#  define KVMOSAIC_DEVICE
#  define KVMOSAIC_FORCEINLINE inline
#endif

#if defined(__CUDA_ARCH__)
#  define KVMOSAIC_IS_DEVICE_CODE 1
#else
#  define KVMOSAIC_IS_DEVICE_CODE 0
#endif

namespace kvmosaic {

/// The library version as "major.minor.patch".
inline const char* version_string() noexcept { return KVMOSAIC_VERSION_STRING; }

/// Shape limits every format, selector and kernel supports. A kernel specialized on a shape checks it
/// with `static_assert` against these predicates; a cache configured at run time checks it with a
/// `kvmosaic::error` naming the parameter. Both print the same allowed values.
namespace limits {

/// head_dim values with kernels: 64, 128 and 256 (the head sizes of current open models).
constexpr bool is_supported_head_dim(int head_dim) noexcept {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
constexpr const char* supported_head_dims = "64, 128 or 256";

/// Query heads per KV head (GQA group size), 1 (MHA) to 8.
constexpr int max_group_size = 8;
constexpr bool is_supported_group_size(int group_size) noexcept {
  return group_size >= 1 && group_size <= max_group_size;
}
constexpr const char* supported_group_sizes = "1 to 8";

/// Tokens per page: a positive multiple of 16 (the MMA tile height), at most 1024.
constexpr int page_size_multiple = 16;
constexpr int max_page_size = 1024;
constexpr int default_page_size = 64;
constexpr bool is_supported_page_size(int page_size) noexcept {
  return page_size > 0 && page_size <= max_page_size && page_size % page_size_multiple == 0;
}
constexpr const char* supported_page_sizes = "a multiple of 16 from 16 to 1024";

/// Capacity limits of one cache: every byte count derived from them (pool and tail arenas,
/// per-step metadata) fits in 64 bits and every index the kernels compute fits in their integer
/// types, so a configuration inside them fails, if at all, with a `kvmosaic::error` from an
/// allocation that cannot be served, never with an overflow.
constexpr int max_kv_heads = 1024;            ///< KV heads of one layer
constexpr int max_pool_pages = 1 << 24;       ///< pages in one pool (16M pages of up to 1024 tokens)
constexpr int max_sequences = 1 << 20;        ///< live sequences (tail slots) of one cache

}  // namespace limits
}  // namespace kvmosaic
