// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The split-KV plan of one decode step (flash-decoding): which contiguous range of pages of which
/// sequence each CTA reads, and where its partial state `(m, l, o)` goes for the merge.
///
/// Computed on the host from the batch's lengths alone, once per step, and reused by every kernel
/// of the step (FlashInfer's scheduler does the same): a single 128K sequence is cut into many
/// splits that fill the GPU, while a large batch of short sequences gets one split each. The
/// dense tail is read by the last split of its sequence.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"

namespace kvmosaic {

/// One unit of work: pages [page_begin, page_end) of sequence `batch_index`, plus its tail when
/// `with_tail` is set. 16 bytes, copied to the device as is.
struct split_work {
  std::int32_t batch_index;
  std::int32_t page_begin;
  std::int32_t page_end;
  std::int32_t with_tail;
};

/// The plan of one step.
struct split_plan {
  std::vector<split_work> work;              ///< one entry per split, grouped by sequence
  std::vector<std::int32_t> partial_offset;  ///< batch + 1 entries: splits of b are [offset[b], offset[b+1])
  std::int32_t pages_per_split = 1;          ///< the longest split, in pages

  std::int32_t num_splits() const noexcept { return static_cast<std::int32_t>(work.size()); }
};

/// Plans a step for sequences with `full_pages[b]` encoded pages and `tail_rows[b]` tail tokens.
/// `target_splits` is how many splits fill the device in one wave (per KV head). For 1 to 4 waves,
/// the split size is the smallest number of pages for which the batch needs at most that many
/// waves of splits (binary search, as in FlashInfer's scheduler); the plan takes the one with the
/// least (waves x longest split), the time of a step when every split streams at the same rate.
/// Splits never exceed `max_pages_per_split` (kernels keep a split's page ids on chip), even if
/// that takes more than one wave. With `page_multiple` > 1, split sizes and boundaries are
/// multiples of it (but a sequence's last split): for kernels that deal a split's pages to that
/// many workers, none of which should idle at the end (quant2's 4 warps). With `segment_pages`
/// > 0 (formats with segments, whose kernels work in one segment's basis at a time), no split
/// crosses a multiple of it and the dense tail is a split of its own (pages [n, n)).
/// `split_cost_pages` is the fixed work of one split in pages' worth (a format whose kernel sets
/// up each split at a cost, as a segment's rotations): a wave then costs its longest split plus
/// it, so that short splits in more waves are taken only when they win by more than the set-ups.
/// Cost: O(batch log pages) host work.
inline split_plan make_split_plan(const std::vector<std::int32_t>& full_pages, const std::vector<std::int32_t>& tail_rows,
                                  std::int32_t target_splits, std::int32_t max_pages_per_split = 1 << 30,
                                  std::int32_t page_multiple = 1, std::int32_t segment_pages = 0,
                                  std::int32_t split_cost_pages = 0) {
  detail::require(full_pages.size() == tail_rows.size(), "make_split_plan", "tail_rows.size()", tail_rows.size(),
                  "full_pages.size()");
  detail::require(target_splits >= 1, "make_split_plan", "target_splits", target_splits, ">= 1");
  detail::require(max_pages_per_split >= 1, "make_split_plan", "max_pages_per_split", max_pages_per_split, ">= 1");
  detail::require(page_multiple >= 1 && page_multiple <= max_pages_per_split, "make_split_plan", "page_multiple",
                  page_multiple, "1 to max_pages_per_split");
  std::int32_t longest = 1;
  for (std::size_t b = 0; b < full_pages.size(); ++b) {
    detail::require(full_pages[b] >= 0 && tail_rows[b] >= 0 && full_pages[b] + tail_rows[b] > 0, "make_split_plan",
                    "sequence length", full_pages[b], "at least one token per sequence");
    longest = std::max(longest, full_pages[b]);
  }
  const auto rounded = [&](std::int32_t pages_per_split) {
    const std::int32_t up = (pages_per_split + page_multiple - 1) / page_multiple * page_multiple;
    return up <= max_pages_per_split ? up : max_pages_per_split / page_multiple * page_multiple;
  };
  detail::require(segment_pages >= 0, "make_split_plan", "segment_pages", segment_pages, ">= 0 (0: no segments)");
  detail::require(split_cost_pages >= 0, "make_split_plan", "split_cost_pages", split_cost_pages, ">= 0");
  // The pieces a sequence's pages are split within: its segments, or all of them.
  const auto for_each_piece = [&](std::int32_t pages, auto&& f) {
    if (segment_pages == 0 || pages == 0) return f(0, pages);
    for (std::int32_t first = 0; first < pages; first += segment_pages) f(first, std::min(pages, first + segment_pages));
  };
  const auto splits_for = [&](std::int32_t pages_per_split) {
    std::int64_t splits = 0;
    for (std::size_t b = 0; b < full_pages.size(); ++b) {
      for_each_piece(full_pages[b], [&](std::int32_t begin, std::int32_t end) {
        splits += std::max<std::int32_t>(1, (end - begin + pages_per_split - 1) / pages_per_split);
      });
      if (segment_pages > 0 && full_pages[b] > 0 && tail_rows[b] > 0) ++splits;
    }
    return splits;
  };
  // The smallest split size whose split count fits in `waves` waves of target_splits.
  const auto smallest_fitting = [&](std::int64_t waves) {
    std::int32_t lo = 1, hi = std::min(longest, max_pages_per_split);
    while (lo < hi) {
      const std::int32_t mid = lo + (hi - lo) / 2;
      if (splits_for(mid) <= waves * target_splits) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  };
  // A step lasts about (waves) x (longest split + a split's fixed work): one wave of few long
  // splits can lose to two waves of many short ones when the batch leaves SMs idle (32 sequences
  // on 49 slots per head).
  const auto cost_of = [&](std::int32_t size) {
    return ((splits_for(size) + target_splits - 1) / target_splits) * (static_cast<std::int64_t>(size) + split_cost_pages);
  };
  std::int32_t lo = rounded(smallest_fitting(1));
  std::int64_t best_cost = cost_of(lo);
  for (std::int64_t waves = 2; waves <= 4; ++waves) {
    const std::int32_t size = rounded(smallest_fitting(waves));
    const std::int64_t cost = cost_of(size);
    if (cost < best_cost) {
      best_cost = cost;
      lo = size;
    }
  }
  split_plan plan;
  plan.pages_per_split = lo;
  plan.partial_offset.reserve(full_pages.size() + 1);
  for (std::size_t b = 0; b < full_pages.size(); ++b) {
    plan.partial_offset.push_back(plan.num_splits());
    const bool tail_alone = segment_pages > 0 && full_pages[b] > 0;
    for_each_piece(full_pages[b], [&](std::int32_t piece_begin, std::int32_t piece_end) {
      // Even splits: the piece's pages, in units of page_multiple, spread over its split count,
      // sizes differing by at most one unit.
      const std::int32_t pages = piece_end - piece_begin;
      const std::int32_t count = std::max<std::int32_t>(1, (pages + lo - 1) / lo);
      const std::int64_t units = (pages + page_multiple - 1) / page_multiple;
      const auto boundary = [&](std::int32_t i) {
        return piece_begin + static_cast<std::int32_t>(std::min<std::int64_t>(pages, units * i / count * page_multiple));
      };
      const bool last_piece = piece_end == full_pages[b];
      for (std::int32_t i = 0; i < count; ++i) {
        const std::int32_t begin = boundary(i);
        const std::int32_t end = i + 1 == count ? piece_end : boundary(i + 1);
        const bool with_tail = !tail_alone && last_piece && i + 1 == count && tail_rows[b] > 0;
        plan.work.push_back(split_work{static_cast<std::int32_t>(b), begin, end, with_tail ? 1 : 0});
      }
    });
    if (tail_alone && tail_rows[b] > 0) plan.work.push_back(split_work{static_cast<std::int32_t>(b), full_pages[b], full_pages[b], 1});
  }
  plan.partial_offset.push_back(plan.num_splits());
  return plan;
}

}  // namespace kvmosaic
