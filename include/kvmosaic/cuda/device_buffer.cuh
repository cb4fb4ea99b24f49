// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Owning buffers: device memory (`device_buffer`) and page-locked host memory (`pinned_buffer`),
/// both movable, not copyable, and freed on destruction. Allocation goes through plain
/// cudaMalloc/cudaMallocHost (no managed memory), as the engines' page arenas need.

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "kvmosaic/cuda/error.cuh"

namespace kvmosaic::cuda {

namespace detail {
template <class Free>
class raw_buffer {
 public:
  raw_buffer() = default;
  raw_buffer(void* data, std::size_t bytes) noexcept : data_(data), bytes_(bytes) {}
  raw_buffer(raw_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  raw_buffer& operator=(raw_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  raw_buffer(const raw_buffer&) = delete;
  raw_buffer& operator=(const raw_buffer&) = delete;
  ~raw_buffer() { reset(); }

  void* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) Free{}(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};
struct free_device {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
struct free_pinned {
  void operator()(void* p) const noexcept { cudaFreeHost(p); }
};
}  // namespace detail

/// Device memory from cudaMalloc.
class device_buffer : public detail::raw_buffer<detail::free_device> {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : raw_buffer(allocate(bytes), bytes) {}

  /// Grows (never shrinks) to at least `bytes`; the contents are not kept.
  void reserve(std::size_t bytes) {
    if (bytes > size()) *this = device_buffer(bytes);
  }

 private:
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
};

/// Page-locked host memory from cudaMallocHost: the staging of per-step metadata. Kernels may
/// read it over the bus through `device_address()` (with unified addressing, which every 64-bit
/// platform CUDA supports, page-locked memory is mapped into the device's address space).
class pinned_buffer : public detail::raw_buffer<detail::free_pinned> {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t bytes) : raw_buffer(allocate(bytes), bytes) {
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaHostGetDevicePointer(&device_address_, data(), 0));
  }
  pinned_buffer(pinned_buffer&& other) noexcept
      : raw_buffer(std::move(other)), device_address_(std::exchange(other.device_address_, nullptr)) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    raw_buffer::operator=(std::move(other));
    device_address_ = std::exchange(other.device_address_, nullptr);
    return *this;
  }

  void reserve(std::size_t bytes) {
    if (bytes > size()) *this = pinned_buffer(bytes);
  }

  /// The address at which kernels read this memory (over PCIe or NVLink-C2C, uncached).
  const void* device_address() const noexcept { return device_address_; }

 private:
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    if (bytes > 0) KVMOSAIC_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void* device_address_ = nullptr;
};

}  // namespace kvmosaic::cuda
