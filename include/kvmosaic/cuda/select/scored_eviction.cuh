// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::tova` and `select::h2o` on the CUDA backend. No selection: every step reads every live
/// row, as `select::all` does. What the stage keeps is each sequence's token scores, in device
/// memory by logical position: the step's score kernel (kernel/token_scores.cuh) writes them from
/// the split kernels' logits, and the eviction after a write ranks them on the device
/// (`lowest_scored`), so that a step copies nothing to the host and an eviction copies back only
/// the slots it chose. The evictions themselves are the cache's (host bookkeeping, live-row masks,
/// compaction on the device).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/kernel/token_scores.cuh"
#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/select/h2o.hpp"
#include "kvmosaic/select/tova.hpp"

namespace kvmosaic::cuda {

namespace kernel {
/// table[slot] = value: a table entry changed in stream order (no staging to guard).
template <class Slot>
__global__ void set_score_slot_kernel(Slot* table, int slot, Slot value) {
  table[slot] = value;
}
}  // namespace kernel

/// The device part of a selector that reads token scores: every page read (`select::all`'s
/// stage), plus per sequence slot its scores ([num_kv_heads][capacity] fp32 by logical position,
/// zero until a step reads the token) and its sealed slots' logical positions (a mirror of the
/// cache's position map, uploaded where it changed and kept by the ranking kernel when it
/// evicts). Memory: 4 bytes per position and KV head plus 8 per sealed slot, per sequence, grown
/// geometrically.
template <class Shapes>
class scored_selection_stage : public selection_stage<select::all, Shapes> {
 public:
  explicit scored_selection_stage(const kvmosaic::detail::engine_shape& shape)
      : selection_stage<select::all, Shapes>(shape, select::all{}),
        heads_(shape.num_kv_heads),
        slots_(static_cast<std::size_t>(shape.max_sequences)),
        table_(static_cast<std::size_t>(shape.max_sequences) * sizeof(kernel::score_slot)) {
    KVMOSAIC_CUDA_CHECK(cudaMemset(table_.data(), 0, table_.size()));
    KVMOSAIC_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  }
  ~scored_selection_stage() {
    if (uploaded_ != nullptr) cudaEventDestroy(uploaded_);
  }
  scored_selection_stage(const scored_selection_stage&) = delete;
  scored_selection_stage& operator=(const scored_selection_stage&) = delete;

  /// The per-slot table the score kernel reads (`kernel::score_slot`, [max_sequences]).
  const kernel::score_slot* score_table() const noexcept { return table_.as<const kernel::score_slot>(); }

  /// Room for `positions` positions of `slot`'s scores, the new ones zero. Cost: on growth (by at
  /// least half), a stream synchronization and a copy of the old scores.
  void reserve_scores(std::int32_t slot, std::int64_t positions, cudaStream_t stream) {
    sequence& s = slots_[static_cast<std::size_t>(slot)];
    if (positions <= s.score_capacity) return;
    const std::int64_t capacity = std::max<std::int64_t>({positions, s.score_capacity + s.score_capacity / 2, 256});
    device_buffer grown(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(capacity) * sizeof(float));
    KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(grown.data(), 0, grown.size(), stream));
    if (s.score_capacity > 0)
      KVMOSAIC_CUDA_CHECK(cudaMemcpy2DAsync(grown.data(), static_cast<std::size_t>(capacity) * sizeof(float), s.scores.data(),
                                            static_cast<std::size_t>(s.score_capacity) * sizeof(float),
                                            static_cast<std::size_t>(s.score_capacity) * sizeof(float),
                                            static_cast<std::size_t>(heads_), cudaMemcpyDeviceToDevice, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old buffer may still be read
    s.scores = std::move(grown);
    s.score_capacity = capacity;
    publish(slot, stream);
  }

  /// `to`'s scores and positions become a copy of `from`'s (a fork).
  void copy_scores(std::int32_t from, std::int32_t to, cudaStream_t stream) {
    const sequence& source = slots_[static_cast<std::size_t>(from)];
    reserve_scores(to, source.score_capacity, stream);
    sequence& target = slots_[static_cast<std::size_t>(to)];
    if (source.score_capacity > 0)
      KVMOSAIC_CUDA_CHECK(cudaMemcpy2DAsync(target.scores.data(), static_cast<std::size_t>(target.score_capacity) * sizeof(float),
                                            source.scores.data(), static_cast<std::size_t>(source.score_capacity) * sizeof(float),
                                            static_cast<std::size_t>(source.score_capacity) * sizeof(float),
                                            static_cast<std::size_t>(heads_), cudaMemcpyDeviceToDevice, stream));
  }

  /// Frees `slot`'s storage (the sequence ended).
  void release_scores(std::int32_t slot) {
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());  // kernels of earlier steps may still read it
    slots_[static_cast<std::size_t>(slot)] = sequence{};
    const kernel::score_slot none{};
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(table_.as<kernel::score_slot>() + slot, &none, sizeof none, cudaMemcpyHostToDevice));
  }

  /// Copies positions[from, to) of `slot`'s sealed-slot position map (host memory) to the device
  /// mirror, growing it as needed. Cost: 8 bytes per slot copied, through page-locked staging.
  void upload_positions(std::int32_t slot, const std::int64_t* positions, std::int64_t from, std::int64_t to,
                        cudaStream_t stream) {
    if (from >= to) return;
    sequence& s = slots_[static_cast<std::size_t>(slot)];
    if (to > s.position_capacity) {
      const std::int64_t capacity = std::max<std::int64_t>({to, s.position_capacity + s.position_capacity / 2, 256});
      device_buffer grown(static_cast<std::size_t>(capacity) * sizeof(std::int64_t));
      if (from > 0)
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(grown.data(), s.positions.data(), static_cast<std::size_t>(from) * sizeof(std::int64_t),
                                            cudaMemcpyDeviceToDevice, stream));
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old mirror may still be read
      s.positions = std::move(grown);
      s.position_capacity = capacity;
      publish(slot, stream);
    }
    const std::size_t bytes = static_cast<std::size_t>(to - from) * sizeof(std::int64_t);
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(uploaded_));  // the previous upload has left the staging
    staging_.reserve(bytes);
    std::copy(positions + from, positions + to, staging_.as<std::int64_t>());
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::int64_t*>(s.positions.data()) + from, staging_.data(), bytes, cudaMemcpyHostToDevice, stream));
    KVMOSAIC_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  }

  /// One sequence's eviction ranking: of the first `slots` sealed slots of `slot`, those whose
  /// position is in [first_evictable, before), the `count` with the lowest shared score.
  struct ranking {
    std::int32_t slot;
    std::int64_t slots;
    std::int64_t first_evictable;
    std::int64_t before;
    std::int64_t count;
  };
  /// The rankings on the device, all at once (kernel/token_scores.cuh: `rank_keys_kernel`, up to
  /// seven `rank_digit_kernel`s, `rank_choose_kernel`): per ranking, the chosen slots
  /// (ascending), in the order the host's `detail::lowest_scored` ranks (ties to the earlier
  /// position, NaN highest), marked evicted in the device mirror. Waits for the stream. Cost:
  /// one read of each sequence's slot positions and of its candidates' scores, then a pass over 8
  /// bytes per slot per digit until the count is decided, and 8 bytes per chosen slot copied back.
  std::vector<std::vector<std::int64_t>> lowest_scored(const std::vector<ranking>& rankings, cudaStream_t stream) {
    const char* where = "cuda::scored_selection_stage::lowest_scored";
    const auto n = static_cast<std::int32_t>(rankings.size());
    std::vector<std::vector<std::int64_t>> out(rankings.size());
    if (n == 0) return out;
    std::int64_t total_slots = 0, stride = 1, longest = 1;
    for (const ranking& r : rankings) {
      kvmosaic::detail::require(r.before <= (std::int64_t{1} << 32), where, "before", r.before, "positions below 2^32");
      total_slots += r.slots;
      stride = std::max(stride, std::min(std::max<std::int64_t>(r.count, 0), r.slots));
      longest = std::max(longest, r.slots);
    }
    // Device scratch: the requests, then each one's radix-select state (zeroed).
    const std::size_t requests_bytes = align(static_cast<std::size_t>(n) * sizeof(kernel::rank_request));
    const std::size_t states_bytes = static_cast<std::size_t>(n) * sizeof(kernel::rank_state);
    const std::size_t chosen_bytes = static_cast<std::size_t>(n) * static_cast<std::size_t>(stride + 1) * sizeof(std::int64_t);
    grow(rank_scratch_, requests_bytes + states_bytes);
    grow(keys_, static_cast<std::size_t>(total_slots) * sizeof(unsigned long long));
    grow(chosen_, chosen_bytes);
    if (chosen_host_.size() < chosen_bytes) chosen_host_ = pinned_buffer(chosen_.size());
    requests_host_.reserve(requests_bytes);
    auto* requests = requests_host_.as<kernel::rank_request>();
    std::int64_t keys_at = 0;
    for (std::int32_t i = 0; i < n; ++i) {
      const ranking& r = rankings[static_cast<std::size_t>(i)];
      const sequence& s = slots_[static_cast<std::size_t>(r.slot)];
      requests[i] = kernel::rank_request{
          kernel::score_slot{static_cast<float*>(s.scores.data()), s.score_capacity, static_cast<std::int64_t*>(s.positions.data())},
          std::min(r.slots, s.position_capacity), r.first_evictable, r.before, std::max<std::int64_t>(r.count, 0), keys_at};
      keys_at += r.slots;
    }
    auto* scratch = rank_scratch_.as<std::byte>();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(scratch, requests_host_.data(), static_cast<std::size_t>(n) * sizeof(kernel::rank_request),
                                        cudaMemcpyHostToDevice, stream));
    KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(scratch + requests_bytes, 0, states_bytes, stream));
    KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(chosen_.data(), 0, chosen_bytes, stream));
    const kernel::rank_params p{reinterpret_cast<const kernel::rank_request*>(scratch),
                                reinterpret_cast<kernel::rank_state*>(scratch + requests_bytes),
                                heads_,
                                keys_.as<unsigned long long>(),
                                chosen_.as<std::int64_t>(),
                                stride};
    // About 4 slots per thread: the longest sequence spread over the device.
    constexpr std::int64_t slots_per_cta = 4 * kernel::rank_threads;
    kernel::launch_ranking(p, n, static_cast<int>(std::min<std::int64_t>((longest + slots_per_cta - 1) / slots_per_cta, 1024)),
                           stride, stream);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(chosen_host_.data(), chosen_.data(), chosen_bytes, cudaMemcpyDeviceToHost, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto* chosen = chosen_host_.as<const std::int64_t>();
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int64_t* row = chosen + static_cast<std::size_t>(i) * static_cast<std::size_t>(stride + 1);
      std::vector<std::int64_t>& slots = out[static_cast<std::size_t>(i)];
      slots.assign(row + 1, row + 1 + row[0]);
      std::sort(slots.begin(), slots.end());
    }
    return out;
  }

  /// The first `positions` positions of `slot`'s scores, copied to the host as
  /// [position][num_kv_heads] (`detail::token_score_buffer`'s layout). Waits for the stream.
  std::vector<float> scores(std::int32_t slot, std::int64_t positions, cudaStream_t stream) const {
    const sequence& s = slots_[static_cast<std::size_t>(slot)];
    positions = std::min(positions, s.score_capacity);
    std::vector<float> by_head(static_cast<std::size_t>(heads_) * static_cast<std::size_t>(std::max<std::int64_t>(positions, 0)));
    if (positions > 0)
      KVMOSAIC_CUDA_CHECK(cudaMemcpy2DAsync(by_head.data(), static_cast<std::size_t>(positions) * sizeof(float), s.scores.data(),
                                            static_cast<std::size_t>(s.score_capacity) * sizeof(float),
                                            static_cast<std::size_t>(positions) * sizeof(float), static_cast<std::size_t>(heads_),
                                            cudaMemcpyDeviceToHost, stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> out(by_head.size());
    for (int h = 0; h < heads_; ++h)
      for (std::int64_t t = 0; t < positions; ++t)
        out[static_cast<std::size_t>(t) * heads_ + h] = by_head[static_cast<std::size_t>(h) * positions + t];
    return out;
  }

 private:
  struct sequence {
    device_buffer scores;     ///< [heads][score_capacity]
    std::int64_t score_capacity = 0;
    device_buffer positions;  ///< [position_capacity]
    std::int64_t position_capacity = 0;
  };
  static std::size_t align(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }
  /// Grows `buffer` to at least `bytes` (by half again), its contents not kept.
  static void grow(device_buffer& buffer, std::size_t bytes) {
    if (bytes > buffer.size()) buffer = device_buffer(std::max(bytes, buffer.size() + buffer.size() / 2));
  }
  /// Writes `slot`'s table entry in stream order.
  void publish(std::int32_t slot, cudaStream_t stream) {
    const sequence& s = slots_[static_cast<std::size_t>(slot)];
    kernel::set_score_slot_kernel<<<1, 1, 0, stream>>>(
        table_.as<kernel::score_slot>(), slot,
        kernel::score_slot{static_cast<float*>(s.scores.data()), s.score_capacity, static_cast<std::int64_t*>(s.positions.data())});
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  }

  int heads_;
  std::vector<sequence> slots_;
  device_buffer table_;        ///< [max_sequences] kernel::score_slot
  device_buffer rank_scratch_;  ///< the rankings' requests, histograms and candidate counts
  device_buffer keys_;          ///< the rankings' keys
  device_buffer chosen_;        ///< per ranking: how many were chosen, then the chosen slots
  pinned_buffer chosen_host_;
  pinned_buffer requests_host_;
  pinned_buffer staging_;      ///< position uploads
  cudaEvent_t uploaded_ = nullptr;
};

/// Reads every live row; keeps and ranks the token scores on the device (above).
template <class Shapes>
class selection_stage<select::tova, Shapes> : public scored_selection_stage<Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::tova&) : scored_selection_stage<Shapes>(shape) {}
};

/// Reads every live row; keeps and ranks the token scores on the device (above).
template <class Shapes>
class selection_stage<select::h2o, Shapes> : public scored_selection_stage<Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::h2o&) : scored_selection_stage<Shapes>(shape) {}
};

}  // namespace kvmosaic::cuda
