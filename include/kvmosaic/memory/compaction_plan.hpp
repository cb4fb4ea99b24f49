// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a compaction pass does to one sequence, planned on the host from its slots alone: which
/// surviving tokens move to which slots, which pages empty out, and the logical position each slot
/// holds afterwards. Both backends execute the same plan (the host by copying rows, the CUDA
/// engine by one gather-then-scatter pass on the device), so their block tables, positions and
/// page bytes agree. Source: the eviction and compaction notes (TriAttention's two compaction
/// shapes, and the numpy oracle whose counts the tests reproduce).
///
/// A sequence's *slots* are its sealed pages' rows in block-table order: slot s is row
/// s % page_size of page s / page_size. `positions[s]` is the logical position (the token's index
/// in the sequence as the model saw it, what RoPE used) of the token in slot s, or -1 when that
/// token was evicted. Pages shared with another sequence (reference count above one: a forked
/// prefix) lead the block table and are *frozen*: nothing moves out of or into them and they are
/// never freed by this sequence, so their dead slots stay dead (masked) until their other holders
/// let go.
///
///   - **repack** (order-preserving): every survivor after the frozen pages slides forward, in
///     logical order, so the sequence's slots are dense again; all survivors are read before any
///     is written (the moves may overlap). Most data movement, no position bookkeeping needed
///     beyond what eviction already keeps.
///   - **hole fill**: survivors before `round_start` (the history) stay where they are; the
///     survivors of the newest round (slots from `round_start` on) drop into the history's holes,
///     in order; those that find no hole slide forward behind the history. Far fewer copies, but
///     the physical order of positions is scrambled, so the position map is what RoPE and prefix
///     hashing must read.
///
/// Cost: O(slots) time and memory on the host, per sequence and pass.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"

namespace kvmosaic {

/// What one compaction pass did (summed over the sequences it compacted): the evidence that
/// eviction returns memory.
struct compaction_report {
  std::int32_t pages_freed = 0;      ///< pages returned to the pool
  std::int64_t slot_copies = 0;      ///< token rows moved between slots
  std::int64_t tokens_evicted = 0;   ///< dead tokens whose slots the pass reclaimed or left as holes
  std::int32_t pages_reencoded = 0;  ///< pages written whole again (formats that encode pages)

  compaction_report& operator+=(const compaction_report& r) noexcept {
    pages_freed += r.pages_freed;
    slot_copies += r.slot_copies;
    tokens_evicted += r.tokens_evicted;
    pages_reencoded += r.pages_reencoded;
    return *this;
  }
};

namespace detail {

/// The position map of one sequence whose cache can evict: per sealed slot the token's logical
/// position (-1 once evicted), and per page a live-row mask in the host attend's layout
/// (`words(page_size)` 64-bit words, bit r of word w for row 64 w + r). Kept in step with the
/// block table by the cache: `seal` when pages are sealed, `evict`, `drop_pages` and compaction.
struct slot_positions {
  std::vector<std::int64_t> position;
  std::vector<std::uint64_t> live;
  std::vector<std::uint8_t> reencoded;  ///< per page: compaction passes that encoded it again (saturating)
  std::int64_t dead = 0;         ///< sealed slots whose token was evicted
  std::int64_t round_start = 0;  ///< slots at the end of the previous compaction pass

  static int words(int page_size) noexcept { return (page_size + 63) / 64; }
  /// Room for `pages` sealed pages, so that `seal` cannot throw.
  void reserve(std::size_t pages, int page_size) {
    position.reserve(pages * static_cast<std::size_t>(page_size));
    live.reserve(pages * static_cast<std::size_t>(words(page_size)));
    reencoded.reserve(pages);
  }
  /// `pages` new sealed pages holding positions first, first + 1, ... (within the reserved room).
  void seal(std::size_t pages, std::int64_t first, int page_size) noexcept {
    for (std::size_t i = 0; i < pages * static_cast<std::size_t>(page_size); ++i)
      position.push_back(first + static_cast<std::int64_t>(i));
    reencoded.insert(reencoded.end(), pages, std::uint8_t{0});
    for (std::size_t i = 0; i < pages; ++i)
      for (int w = 0; w < words(page_size); ++w) {
        const int rows = page_size - 64 * w;
        live.push_back(rows >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << rows) - 1);
      }
  }
  /// Marks sealed slot `slot` dead.
  void evict(std::int64_t slot, int page_size) noexcept {
    position[static_cast<std::size_t>(slot)] = -1;
    const std::int64_t page = slot / page_size, row = slot % page_size;
    live[static_cast<std::size_t>(page * words(page_size) + row / 64)] &= ~(std::uint64_t{1} << (row % 64));
    ++dead;
  }
  /// Removes the listed pages (ascending block-table indices) with their slots.
  void drop_pages(const std::vector<std::int32_t>& pages, int page_size) noexcept {
    std::size_t write_slot = 0, write_word = 0, write_page = 0;
    std::size_t next = 0;
    const std::int64_t history = round_start;  // each dropped page below it leaves the history
    const auto count = static_cast<std::int32_t>(position.size() / static_cast<std::size_t>(page_size));
    for (std::int32_t page = 0; page < count; ++page) {
      const auto first = static_cast<std::size_t>(page) * static_cast<std::size_t>(page_size);
      if (next < pages.size() && pages[next] == page) {
        ++next;
        for (int r = 0; r < page_size; ++r) dead -= position[first + static_cast<std::size_t>(r)] < 0;
        if (first < static_cast<std::size_t>(history)) round_start -= page_size;
        continue;
      }
      reencoded[write_page++] = reencoded[static_cast<std::size_t>(page)];
      for (int r = 0; r < page_size; ++r) position[write_slot++] = position[first + static_cast<std::size_t>(r)];
      for (int w = 0; w < words(page_size); ++w)
        live[write_word++] = live[static_cast<std::size_t>(page) * static_cast<std::size_t>(words(page_size)) + static_cast<std::size_t>(w)];
    }
    position.resize(write_slot);
    live.resize(write_word);
    reencoded.resize(write_page);
  }
};

/// One row move of a plan: the token in slot `from` goes to slot `to`.
struct slot_move {
  std::int64_t from;
  std::int64_t to;
};

/// A compaction pass over one sequence (see the file comment).
struct compaction_plan {
  std::vector<slot_move> moves;              ///< every survivor that changes slot; read all, then write all
  std::vector<std::int64_t> positions;       ///< per slot kept afterwards: its logical position, -1 for a hole
  std::int32_t pages_kept = 0;               ///< leading pages of the block table kept; the rest are freed
  std::int32_t pages_freed = 0;
  std::vector<std::int32_t> pages_written;   ///< indices (in the block table) of kept pages a move writes, ascending
  std::int64_t tokens_evicted = 0;           ///< dead slots before the pass

  /// The pass's report (`reencoded`: whether the format rewrites whole pages it changes).
  compaction_report report(bool reencoded) const noexcept {
    compaction_report r;
    r.pages_freed = pages_freed;
    r.slot_copies = static_cast<std::int64_t>(moves.size());
    r.tokens_evicted = tokens_evicted;
    r.pages_reencoded = reencoded ? static_cast<std::int32_t>(pages_written.size()) : 0;
    return r;
  }
};

namespace detail_compaction {

inline void check(const std::vector<std::int64_t>& positions, int page_size, std::int32_t frozen_pages, const char* where) {
  require(page_size >= 1, where, "page_size", page_size, ">= 1");
  require(positions.size() % static_cast<std::size_t>(page_size) == 0, where, "positions.size()", positions.size(),
          "whole pages (a multiple of page_size)");
  const auto pages = static_cast<std::int64_t>(positions.size()) / page_size;
  require(frozen_pages >= 0 && frozen_pages <= pages, where, "frozen_pages", frozen_pages,
          "0 to the number of pages");
}

/// Fills `plan.positions`, `pages_kept`, `pages_freed` and `pages_written` once `layout` (the slots
/// kept, by position) and the moves are known. Trailing dead slots free their pages, down to the
/// first `first` slots (the frozen pages, never freed).
inline void finish(compaction_plan& plan, std::vector<std::int64_t> layout, std::int64_t total_pages, int page_size,
                   std::int64_t first) {
  std::int64_t used = static_cast<std::int64_t>(layout.size());
  while (used > first && layout[static_cast<std::size_t>(used - 1)] < 0) --used;
  const std::int64_t kept = (used + page_size - 1) / page_size;
  layout.resize(static_cast<std::size_t>(kept * page_size), -1);
  plan.positions = std::move(layout);
  plan.pages_kept = static_cast<std::int32_t>(kept);
  plan.pages_freed = static_cast<std::int32_t>(total_pages - kept);
  for (const slot_move& m : plan.moves) {
    const auto page = static_cast<std::int32_t>(m.to / page_size);
    if (plan.pages_written.empty() || plan.pages_written.back() != page) plan.pages_written.push_back(page);
  }
  std::sort(plan.pages_written.begin(), plan.pages_written.end());
  plan.pages_written.erase(std::unique(plan.pages_written.begin(), plan.pages_written.end()), plan.pages_written.end());
}

}  // namespace detail_compaction

/// Order-preserving repack: the survivors after the frozen pages, in slot order, move to the
/// first slots after them. Cost: O(slots).
inline compaction_plan plan_repack(const std::vector<std::int64_t>& positions, int page_size, std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "compact::repack");
  compaction_plan plan;
  const std::int64_t first = static_cast<std::int64_t>(frozen_pages) * page_size;
  std::vector<std::int64_t> layout(positions.begin(), positions.begin() + first);
  for (std::int64_t s = 0; s < static_cast<std::int64_t>(positions.size()); ++s) {
    const std::int64_t p = positions[static_cast<std::size_t>(s)];
    if (p < 0) {
      ++plan.tokens_evicted;
      continue;
    }
    if (s < first) continue;
    const auto to = static_cast<std::int64_t>(layout.size());
    if (to != s) plan.moves.push_back(slot_move{s, to});
    layout.push_back(p);
  }
  detail_compaction::finish(plan, std::move(layout), static_cast<std::int64_t>(positions.size()) / page_size, page_size, first);
  return plan;
}

/// Hole filling: slots before `round_start` keep their survivors; the survivors from
/// `round_start` on fill the history's holes after the frozen pages, in order, and those left over
/// slide forward behind the history. `round_start`: a slot index from the end of the frozen pages
/// to the number of slots. Cost: O(slots).
inline compaction_plan plan_hole_fill(const std::vector<std::int64_t>& positions, int page_size, std::int64_t round_start,
                                      std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "compact::hole_fill");
  const std::int64_t first = static_cast<std::int64_t>(frozen_pages) * page_size;
  const auto slots = static_cast<std::int64_t>(positions.size());
  require(round_start >= first && round_start <= slots, "compact::hole_fill", "round_start", round_start,
          "a slot from the end of the shared pages to the sequence's slots");
  compaction_plan plan;
  std::vector<std::int64_t> layout(positions.begin(), positions.begin() + round_start);
  std::vector<std::int64_t> holes;
  for (std::int64_t s = 0; s < round_start; ++s)
    if (positions[static_cast<std::size_t>(s)] < 0) {
      ++plan.tokens_evicted;
      if (s >= first) holes.push_back(s);
    }
  std::size_t next_hole = 0;
  for (std::int64_t s = round_start; s < slots; ++s) {
    const std::int64_t p = positions[static_cast<std::size_t>(s)];
    if (p < 0) {
      ++plan.tokens_evicted;
      continue;
    }
    std::int64_t to;
    if (next_hole < holes.size()) {
      to = holes[next_hole++];
      layout[static_cast<std::size_t>(to)] = p;
    } else {
      to = static_cast<std::int64_t>(layout.size());
      layout.push_back(p);
    }
    if (to != s) plan.moves.push_back(slot_move{s, to});
  }
  detail_compaction::finish(plan, std::move(layout), slots / page_size, page_size, first);
  return plan;
}

/// Pages whose every slot is dead, which eviction alone returns (block-granular reclaim, no
/// compaction): their indices in the block table, ascending. Frozen pages are never listed.
inline std::vector<std::int32_t> empty_pages(const std::vector<std::int64_t>& positions, int page_size,
                                             std::int32_t frozen_pages = 0) {
  detail_compaction::check(positions, page_size, frozen_pages, "cache::evict");
  std::vector<std::int32_t> pages;
  const auto count = static_cast<std::int32_t>(positions.size() / static_cast<std::size_t>(page_size));
  for (std::int32_t page = frozen_pages; page < count; ++page) {
    const auto begin = positions.begin() + static_cast<std::ptrdiff_t>(page) * page_size;
    if (std::all_of(begin, begin + page_size, [](std::int64_t p) { return p < 0; })) pages.push_back(page);
  }
  return pages;
}

}  // namespace detail
}  // namespace kvmosaic
