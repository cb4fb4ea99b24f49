// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The page pool: bookkeeping for a fixed number of fixed-size page slots. It hands out page ids,
/// counts references (a page shared by forked sequences, e.g. a common prompt prefix, is freed
/// when its last holder releases it) and keeps the free-page gauge, the proof of reclaimed memory.
///
/// The pool owns no bytes: the backend's arena (host memory or device memory) maps a page id to
/// its slot, `slot address = base + id * slot_bytes`, as vLLM's block tables do. Bookkeeping stays on
/// the host on every backend, as in inference engines, so allocation never synchronizes the GPU.

#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"

namespace kvmosaic {

/// Index of a page slot in a pool (int32, as in vLLM block tables).
using page_id = std::int32_t;

/// Free list and reference counts of `capacity` page slots. Cost: O(1) per allocate, retain and
/// release; O(capacity) memory. Not thread-safe: one owner drives it (the cache).
class page_pool {
 public:
  explicit page_pool(std::int32_t capacity) : ref_counts_(checked(capacity), 0) {
    free_list_.reserve(static_cast<std::size_t>(capacity));
    // Hand out low ids first: the stack pops from the back.
    for (std::int32_t id = capacity - 1; id >= 0; --id) free_list_.push_back(id);
  }

  std::int32_t capacity() const noexcept { return static_cast<std::int32_t>(ref_counts_.size()); }
  std::int32_t free_pages() const noexcept { return static_cast<std::int32_t>(free_list_.size()); }
  std::int32_t used_pages() const noexcept { return capacity() - free_pages(); }
  bool can_allocate(std::int64_t count) const noexcept { return count <= free_pages(); }

  /// Takes `count` pages, all or none, each with reference count 1. Throws `capacity_error` naming
  /// the request and the free count when the pool cannot hold them; the pool is then unchanged.
  std::vector<page_id> allocate(std::int64_t count) {
    if (count < 0) throw invalid_argument("count", detail::describe("page_pool::allocate", "count", count, ">= 0"));
    if (!can_allocate(count)) {
      throw capacity_error(
          "page_pool", "kvmosaic: page pool exhausted: " + std::to_string(count) + " page(s) needed, " +
                           std::to_string(free_pages()) + " free of " + std::to_string(capacity()) +
                           "; allowed: at most the free pages (raise cache_config::max_pages or free sequences)");
    }
    std::vector<page_id> pages(static_cast<std::size_t>(count));
    for (auto& id : pages) {
      id = free_list_.back();
      free_list_.pop_back();
      ref_counts_[static_cast<std::size_t>(id)] = 1;
    }
    return pages;
  }

  /// Adds a holder to a page in use (a forked sequence shares it).
  void retain(page_id id) {
    check_in_use(id, "page_pool::retain");
    ++ref_counts_[static_cast<std::size_t>(id)];
  }

  /// Drops a holder; the page returns to the free list when none is left.
  void release(page_id id) {
    check_in_use(id, "page_pool::release");
    if (--ref_counts_[static_cast<std::size_t>(id)] == 0) free_list_.push_back(id);
  }

  /// Holders of a page (0 when free).
  std::int32_t ref_count(page_id id) const {
    detail::require(id >= 0 && id < capacity(), "page_pool::ref_count", "page", id, "0 to capacity - 1");
    return ref_counts_[static_cast<std::size_t>(id)];
  }

 private:
  static std::size_t checked(std::int32_t capacity) {
    detail::require(capacity >= 1, "page_pool", "capacity", capacity, ">= 1");
    return static_cast<std::size_t>(capacity);
  }
  void check_in_use(page_id id, const char* where) const {
    detail::require(id >= 0 && id < capacity() && ref_counts_[static_cast<std::size_t>(id)] > 0, where, "page",
                    id, "a page id that is allocated");
  }

  std::vector<std::int32_t> ref_counts_;
  std::vector<page_id> free_list_;
};

}  // namespace kvmosaic
