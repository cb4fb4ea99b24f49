// SPDX-License-Identifier: Apache-2.0
// format::packed_bitmap (MosaicKV) on the CUDA backend against the host backend: the device
// engine plans the host's segments bit for bit (it computes the sums a plan is made of in the
// host's order, the host the rest); the device encoder
// writes the host's records up to its rotation's summation order, so a value may differ by the
// two products' fp32 error bounds plus one 16-bit step, and a group whose energy ties the r-th
// within fp32 rounding may be swapped (both bounded here); PackedAttention on the device equals fp64 attention over the vectors the
// device's own pages decode to, within the bound derived for the rotated computation
// (test/support/packed_bound.hpp), over several segments, appends across a segment boundary,
// sinks, a fork, segments of several tiles of the plan's sums and segments begun in the tail. The
// kernels are compiled for four shapes.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../support/packed_bound.hpp"
#include "packed_records.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;

namespace {

using shapes = backend::cuda_for<kernel_shape<dtype::bf16, 128, 4>, kernel_shape<dtype::f16, 64, 1>,
                                 kernel_shape<dtype::bf16, 256, 8>, kernel_shape<dtype::f16, 128, 3>>;
using traits = format_traits<format::packed_bitmap>;
using packed_twin = test::twin<format::packed_bitmap, select::all, shapes>;
using selected_twin = test::twin<format::packed_bitmap, select::mean_keys, shapes>;

page_shape page_of(const cache_config& c) { return page_shape{c.page_size, c.head_dim, c.storage}; }

cache_config config_of(int d, int group, dtype storage) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = group;
  c.head_dim = d;
  c.storage = storage;
  c.page_size = 64;
  c.max_pages = 256;
  c.max_sequences = 8;
  return c;
}

/// Every segment the device engine planned equals the host engine's, bit for bit (the device
/// computes the sums the plan is made of, `device_format::segment_sums`, in the host's order).
void check_segments(const packed_twin& t) {
  const int per = traits::segment_pages(t.format, page_of(t.config));
  for (const sequence_id s : t.seqs) {
    const auto pages = static_cast<std::int64_t>(t.host.pages(s).size());
    for (std::int64_t index = 0; index < pages; index += per)
      for (int h = 0; h < t.config.num_kv_heads; ++h) {
        const traits::segment& a = t.host.engine().segment(t.host.slot(s), index, h);
        const traits::segment& b = t.device.engine().segment(t.device.slot(s), index, h);
        CAPTURE(s, index, h);
        REQUIRE(a.kept == b.kept);
        REQUIRE(a.basis[0] == b.basis[0]);
        REQUIRE(a.basis[1] == b.basis[1]);
        for (int which = 0; which < 2; ++which) {
          REQUIRE(a.strategy[which].retained == b.strategy[which].retained);
          REQUIRE(a.strategy[which].group == b.strategy[which].group);
        }
        REQUIRE(a.block_tokens == b.block_tokens);
      }
  }
}

/// The device's records against the host's (`test::check_record`, packed_records.hpp). Returns the
/// records that differ in their groups.
std::int64_t check_records(const packed_twin& t) {
  const page_shape shape = page_of(t.config);
  const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(t.format, shape);
  const std::size_t slot_bytes = t.host.engine().page_slot_bytes();
  std::vector<std::byte> device_slot(slot_bytes);
  std::int64_t differing = 0;
  const int d = t.config.head_dim;
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const sequence_id s = t.seqs[b];
    const std::vector<page_id>& pages = t.host.pages(s);
    const synthetic::kv_data rows = test::rounded(
        synthetic::generate_kv(t.generator, t.streams[b], static_cast<int>(t.host.length(s))), t.config.storage);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_slot.data(), t.device.engine().pages_data() + pages[i] * slot_bytes, slot_bytes,
                                     cudaMemcpyDeviceToHost));
      const std::byte* host_slot = t.host.engine().k_page(pages[i], 0);
      for (int h = 0; h < t.config.num_kv_heads; ++h)
        for (const int which : {0, 1}) {
          const traits::segment& seg = t.host.engine().segment(t.host.slot(s), static_cast<std::int64_t>(i), h);
          const kvmosaic::detail::packed_strategy st = seg.strategy[which];
          const std::size_t offset = which == 0 ? t.host.engine().geometry().k_page_offset(h) : t.host.engine().geometry().v_page_offset(h);
          const std::byte* hp = host_slot + offset;
          const std::byte* dp = device_slot.data() + offset;
          for (int r = 0; r < t.config.page_size; ++r) {
            const std::int64_t token = static_cast<std::int64_t>(i) * t.config.page_size + r;
            CAPTURE(b, i, h, which, r);
            const float* x = which == 0 ? rows.k_row(static_cast<int>(token), h) : rows.v_row(static_cast<int>(token), h);
            differing += test::check_record(x, d, seg.basis[which], st, g, hp, dp, r, t.config.storage) ? 1 : 0;
          }
        }
    }
  }
  return differing;
}

/// The device's attention against fp64 attention over the vectors its own pages decode to, per
/// element within `folded_bound`: each segment's sealed rows in its rotated space, the sinks and
/// the tail dense, with the kernel's operand rounding (the sm_90 kernel splits q' and p into hi +
/// lo halves); and the host's output on its own pages within 1e-2 relative L2 of the device's
/// (the records differ by the roundings `check_records` bounds).
void check_attention(packed_twin& t) {
  const typename packed_twin::step_outputs step = t.attend_both();
  const int hq = t.config.num_q_heads(), d = t.config.head_dim, heads = t.config.num_kv_heads, page = t.config.page_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
  const int per = traits::segment_pages(t.format, page_of(t.config));
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const sequence_id s = t.seqs[b];
    CAPTURE(b, t.host.length(s));
    const std::vector<float> q(step.q.begin() + static_cast<std::ptrdiff_t>(b * per_seq), step.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    const std::vector<float> gpu(step.gpu.begin() + static_cast<std::ptrdiff_t>(b * per_seq), step.gpu.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    const std::vector<float> host(step.host.begin() + static_cast<std::ptrdiff_t>(b * per_seq), step.host.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    for (const float x : gpu) REQUIRE(std::isfinite(x));  // every output written (the buffer was poisoned with NaN)
    const synthetic::kv_data dec = test::decoded(t.device, s, heads, d);
    const std::vector<double> exact =
        host::exact_attention(tensor_view<const float, 2>(q.data(), hq, d), test::k_view(dec), test::v_view(dec), scale);
    // The parts the kernel folds in one basis each: the sinks and the tail dense (index 0), the
    // sealed rows of segment i (index i + 1).
    const auto pages = static_cast<std::int64_t>(t.device.pages(s).size());
    const std::int64_t sealed = pages * page, segments = (pages + per - 1) / per;
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(segments) + 1);
    for (std::int64_t i = 0; i < dec.num_tokens; ++i)
      rows[i < t.format.sink_tokens || i >= sealed ? 0 : static_cast<std::size_t>(i / page / per) + 1].push_back(i);
    std::vector<synthetic::kv_data> tokens;
    for (const std::vector<std::int64_t>& r : rows) tokens.push_back(test::tokens_of(dec, r));
    for (int h = 0; h < heads; ++h) {
      std::vector<test::folded_part> parts;
      for (std::size_t i = 0; i < tokens.size(); ++i)
        if (tokens[i].num_tokens > 0)
          parts.push_back({&tokens[i], i == 0 ? nullptr : &t.device.engine().segment(t.device.slot(s), static_cast<std::int64_t>(i) - 1, h)});
      const std::vector<double> bound =
          test::folded_bound(q, h, t.config.group_size, scale, page, static_cast<double>(pages + 2), parts, t.q_rounding(), t.p_rounding());
      for (int i = 0; i < t.config.group_size * d; ++i) {
        const std::size_t at = static_cast<std::size_t>(h) * t.config.group_size * d + static_cast<std::size_t>(i);
        INFO("element " << at << ": gpu " << gpu[at] << ", exact " << exact[at]);
        REQUIRE(std::abs(gpu[at] - exact[at]) <= bound[static_cast<std::size_t>(i)]);
      }
    }
    const std::vector<double> host_wide(host.begin(), host.end());
    CHECK(host::compare(gpu.data(), host_wide.data(), gpu.size()).rel_l2_error < 1e-2);
  }
}

/// Two selected steps, 80 appends apart (a segment boundary crossed): the device's output equals
/// the host engine's on the same rows, every element written. The same pages and rows as the
/// host's: a different choice moves the output by far more than the roundings the first test case
/// bounds, by which alone the records differ.
/// Both engines keep packed_bitmap's block keys (the mean key channel-compressed in its
/// segment's basis) for mean_keys, and the device's equal the host's byte for byte: the same
/// orders (the mean's token-order sum, the rotation's channel-order FMAs, the energies' sum).
void check_block_keys(const selected_twin& t) {
  REQUIRE(t.host.engine().format_block_keys());
  REQUIRE(t.device.engine().selection().format_block_keys());
  const std::size_t bytes = t.host.engine().page_bounds_bytes();
  std::vector<std::byte> device_keys(bytes);
  std::size_t compared = 0;
  for (const sequence_id s : t.seqs) {
    const std::int64_t sealed = t.host.length(s) / t.config.page_size;
    const auto& pages = t.host.pages(s);
    for (std::int64_t i = 0; i < sealed; ++i) {
      const page_id page = pages[static_cast<std::size_t>(i)];
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_keys.data(), t.device.engine().selection().bounds_data() + page * bytes, bytes,
                                     cudaMemcpyDeviceToHost));
      CAPTURE(s, i);
      REQUIRE(std::memcmp(device_keys.data(), t.host.engine().page_bounds(page, 0, 0), bytes) == 0);
      ++compared;
    }
  }
  REQUIRE(compared > 0);
}

void check_selected_steps(selected_twin& t) {
  for (int round = 0; round < 2; ++round) {
    const typename selected_twin::step_outputs step = t.attend_both();
    const std::size_t per_seq = static_cast<std::size_t>(t.config.num_q_heads()) * t.config.head_dim;
    for (std::size_t b = 0; b < t.seqs.size(); ++b) {
      CAPTURE(round, b);
      const auto from = static_cast<std::ptrdiff_t>(b * per_seq), to = static_cast<std::ptrdiff_t>((b + 1) * per_seq);
      const std::vector<float> gpu(step.gpu.begin() + from, step.gpu.begin() + to);
      const std::vector<double> host(step.host.begin() + from, step.host.begin() + to);
      for (const float x : gpu) REQUIRE(std::isfinite(x));
      CHECK(host::compare(gpu.data(), host.data(), gpu.size()).rel_l2_error < 1e-2);
    }
    for (int step_index = 0; step_index < 80; ++step_index) t.append_step();
  }
}

format::packed_bitmap make(int group, int sinks, format::strategy mode = format::strategy::fixed) {
  format::packed_bitmap f;
  f.group = group;
  f.segment_tokens = 256;  // 4 pages: several segments in a short sequence
  f.sink_tokens = sinks;
  f.mode = mode;
  f.loss_threshold = 0.2f;  // the search picks differing strategies per segment
  return f;
}

}  // namespace

TEST_CASE("GPU packed_bitmap: the host's segments, the host's records within rounding, PackedAttention within its bound",
          "[gpu][packed_bitmap]") {
  if (!gpu_available()) return;
  struct shape {
    int head_dim, group;
    dtype storage;
  };
  const shape s = GENERATE(shape{128, 4, dtype::bf16}, shape{64, 1, dtype::f16}, shape{256, 8, dtype::bf16},
                           shape{128, 3, dtype::f16});
  const int g = GENERATE(1, 2, 4);
  const int sinks = GENERATE(0, 4);
  const auto mode = GENERATE(format::strategy::fixed, format::strategy::search);
  const bool portable = GENERATE(false, true);  // the sm_75+ kernel on this device too
  CAPTURE(s.head_dim, s.group, to_string(s.storage), g, sinks, mode == format::strategy::search, portable);
  packed_twin t(config_of(s.head_dim, s.group, s.storage), 17, make(g, sinks, mode));
  if (portable) t.device.engine().use_portable_kernel();
  // Lengths in the tail only, at page and segment boundaries, and several segments.
  for (const int length : {1, 63, 64, 65, 256, 300, 700}) t.add(length, t.seqs.size());
  check_segments(t);
  const std::int64_t differing = check_records(t);
  check_attention(t);
  for (int step = 0; step < 70; ++step) t.append_step();  // 700 + 70 crosses into segment 3 (page 12)
  check_segments(t);
  const std::int64_t differing_after = check_records(t);
  check_attention(t);
  WARN("records whose groups differ from the host's by an fp32 tie: " << differing << ", after appends " << differing_after);
}

TEST_CASE("GPU packed_bitmap: segments of several tiles of sums, and segments begun in the tail", "[gpu][packed_bitmap]") {
  if (!gpu_available()) return;
  struct shape {
    int head_dim, group;
    dtype storage;
  };
  const shape s = GENERATE(shape{128, 4, dtype::bf16}, shape{64, 1, dtype::f16}, shape{256, 8, dtype::bf16});
  const int sinks = GENERATE(0, 4);
  const auto mode = GENERATE(format::strategy::fixed, format::strategy::search);
  CAPTURE(s.head_dim, to_string(s.storage), sinks, mode == format::strategy::search);
  format::packed_bitmap f = make(1, sinks, mode);
  f.segment_tokens = 4096;  // two tiles of sums (2048 rows each) a whole segment
  REQUIRE(traits::segment_sum_tile_rows == 2048);
  cache_config c = config_of(s.head_dim, s.group, s.storage);
  c.max_pages = 256;
  packed_twin t(c, 53, f);
  // With sinks, one tile's sums a pass of the device's sums (several passes a segment); without,
  // every tile in one pass.
  if (sinks > 0) t.device.engine().format_state().sum_pass_bytes = 1;
  t.add(4999, 0);  // a whole segment (the sinks leave its first tile short), then a part of a tile
  t.add(2100, 1);  // a tile and a part
  // A sequence prefilled in three calls: each of its two segments starts with rows already in
  // the tail when its first page is sealed.
  const int total = 4096 + 300, cuts[4] = {0, 40, 4096 + 20, total};  // tails of 40 and 20 rows
  const auto kv = synthetic::generate_kv(t.generator, 2, total);
  const sequence_id h = t.host.add_sequence(), d = t.device.add_sequence();
  REQUIRE(h == d);
  const int heads = c.num_kv_heads, dim = c.head_dim;
  for (int part = 0; part < 3; ++part) {
    const int from = cuts[part], rows = cuts[part + 1] - cuts[part];
    const std::size_t at = static_cast<std::size_t>(from) * heads * dim, size = static_cast<std::size_t>(rows) * heads * dim;
    const std::vector<float> k(kv.k.begin() + static_cast<std::ptrdiff_t>(at), kv.k.begin() + static_cast<std::ptrdiff_t>(at + size));
    const std::vector<float> v(kv.v.begin() + static_cast<std::ptrdiff_t>(at), kv.v.begin() + static_cast<std::ptrdiff_t>(at + size));
    t.host.prefill(h, tensor_view<const float, 3>(k.data(), rows, heads, dim), tensor_view<const float, 3>(v.data(), rows, heads, dim));
    test::device_array<float> dk(k), dv(v);
    t.device.prefill(d, tensor_view<const float, 3>(dk.data(), rows, heads, dim), tensor_view<const float, 3>(dv.data(), rows, heads, dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  }
  t.seqs.push_back(h);
  t.streams.push_back(2);
  check_segments(t);
  check_records(t);
  check_attention(t);
}

TEST_CASE("GPU packed_bitmap: a searched slot whose r is not a whole number of groups of 4", "[gpu][packed_bitmap]") {
  if (!gpu_available()) return;
  // r_slot = 38 at head_dim 128: records start 76 bytes apart, so the search may pick g = 2 (one
  // 32-bit load a group) but not g = 4 (64-bit loads would be misaligned).
  format::packed_bitmap f = make(1, 4, format::strategy::search);
  f.retained = 38.0f / 128.0f;
  const bool portable = GENERATE(false, true);
  CAPTURE(portable);
  packed_twin t(config_of(128, 4, dtype::bf16), 29, f);
  if (portable) t.device.engine().use_portable_kernel();
  for (const int length : {65, 300, 700}) t.add(length, t.seqs.size());
  check_segments(t);
  int pairs = 0;
  for (const sequence_id s : t.seqs)
    for (int h = 0; h < t.config.num_kv_heads; ++h)
      for (int which = 0; which < 2; ++which) {
        const traits::segment& seg = t.device.engine().segment(t.device.slot(s), 0, h);
        REQUIRE(seg.strategy[which].group != 4);
        pairs += seg.strategy[which].group == 2;
      }
  CHECK(pairs > 0);  // the whole-group loads of g = 2 are exercised
  check_records(t);
  check_attention(t);
}

namespace {

/// The device's search sums of `heads` KV heads' random K and V rows (a NaN in one row of one
/// head's V) against the host's `packed_search_sums` on the same rows and bases.
template <int HeadDim>
void check_search_sums(float retained) {
  const int heads = 2;
  const std::int64_t n = 300;  // a partial last chunk
  format::packed_bitmap f;
  f.retained = retained;
  f.mode = format::strategy::search;
  const auto g = kvmosaic::detail::packed_geometry::of(f, page_shape{64, HeadDim, dtype::bf16});
  const std::vector<kvmosaic::detail::packed_strategy> candidates = kvmosaic::detail::packed_candidates(g);
  std::mt19937 random(47);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  // Rows [n][heads][head_dim] as a call gives them (fp32), over 16 binades so that the sums round.
  std::vector<float> k(static_cast<std::size_t>(n) * heads * HeadDim), v(k.size());
  for (std::vector<float>* rows : {&k, &v})
    for (float& x : *rows) x = std::ldexp(uniform(random), static_cast<int>(random() % 16) - 8);
  v[(static_cast<std::size_t>(70) * heads + 1) * HeadDim + 5] = std::numeric_limits<float>::quiet_NaN();
  const std::size_t basis_floats = static_cast<std::size_t>(HeadDim) * g.kept;
  std::vector<float> bases(static_cast<std::size_t>(heads) * 2 * basis_floats);
  for (float& b : bases) b = uniform(random);
  const std::int64_t chunks = (n + 63) / 64;
  const int count = kvmosaic::detail::packed_search_sum_count;
  std::vector<double> expected(static_cast<std::size_t>(heads) * chunks * 2 * count), got(expected.size());
  for (int h = 0; h < heads; ++h)
    for (int which = 0; which < 2; ++which) {
      std::vector<float> rows(static_cast<std::size_t>(n) * HeadDim);
      for (std::int64_t t = 0; t < n; ++t)
        for (int c = 0; c < HeadDim; ++c)
          rows[static_cast<std::size_t>(t) * HeadDim + c] = (which == 0 ? k : v)[(static_cast<std::size_t>(t) * heads + h) * HeadDim + c];
      const std::vector<float> basis(bases.begin() + (2 * h + which) * basis_floats, bases.begin() + (2 * h + which + 1) * basis_floats);
      kvmosaic::detail::packed_search_sums(g, rows.data(), n, basis, expected.data() + (static_cast<std::size_t>(h) * chunks * 2 + which) * count,
                                           2 * count);
    }
  kvmosaic::cuda::device_buffer k_device(k.size() * 4), v_device(v.size() * 4), bases_device(bases.size() * 4), sums_device(got.size() * 8);
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(k_device.data(), k.data(), k.size() * 4, cudaMemcpyHostToDevice));
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(v_device.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(bases_device.data(), bases.data(), bases.size() * 4, cudaMemcpyHostToDevice));
  kvmosaic::cuda::kernel::packed_search_params p{};
  p.rows = kvmosaic::cuda::kernel::packed_sum_rows{nullptr, 0, 0, dtype::bf16, k_device.as<const std::byte>(), v_device.as<const std::byte>(),
                                         dtype::f32, 0, 0, 0, 0, n, heads};
  p.bases = bases_device.as<const float>();
  p.sums = sums_device.as<double>();
  p.kept = g.kept;
  p.candidates = static_cast<int>(candidates.size());
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    p.retained[i] = candidates[i].retained;
    p.group[i] = candidates[i].group;
  }
  kvmosaic::cuda::kernel::packed_search_sums_kernel<HeadDim><<<dim3(static_cast<unsigned>(chunks), heads, 2), kvmosaic::cuda::kernel::packed_search_threads>>>(p);
  KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  KVMOSAIC_CUDA_CHECK(cudaMemcpy(got.data(), p.sums, got.size() * 8, cudaMemcpyDeviceToHost));
  int nans = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(HeadDim, retained, i);
    nans += std::isnan(expected[i]) ? 1 : 0;
    if (std::isnan(expected[i])) CHECK(std::isnan(got[i]));
    else CHECK(std::memcmp(&got[i], &expected[i], sizeof(double)) == 0);
  }
  CHECK(nans > 0);  // the NaN row's chunk: its norm and every candidate's sum
}

}  // namespace

TEST_CASE("GPU packed_bitmap: the strategy search's sums on the device equal the host's, bit for bit", "[gpu][packed_bitmap]") {
  if (!gpu_available()) return;
  check_search_sums<64>(0.375f);
  check_search_sums<128>(0.375f);
  check_search_sums<128>(38.0f / 128.0f);  // no g = 4: four candidates
  check_search_sums<256>(0.375f);          // 192 groups at g = 1
}

TEST_CASE("GPU packed_bitmap: a fork reads its shared pages in the same segments", "[gpu][packed_bitmap]") {
  if (!gpu_available()) return;
  packed_twin t(config_of(128, 4, dtype::bf16), 23, make(1, 4));
  t.add(900, 0);
  const sequence_id child = t.device.fork_sequence(t.seqs[0]);
  const std::vector<float> q = t.queries();
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  test::device_array<float> dq(q), a(q.size()), b(q.size());
  t.device.attend(span<const sequence_id>(&t.seqs[0], 1), tensor_view<const float, 3>(dq.data(), 1, hq, d), tensor_view<float, 3>(a.data(), 1, hq, d));
  t.device.attend(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(dq.data(), 1, hq, d), tensor_view<float, 3>(b.data(), 1, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(a.to_host(q.size()) == b.to_host(q.size()));
  // The parent's slot is reused by a new sequence: the child's segments are its own copies.
  t.device.remove_sequence(t.seqs[0]);
  const sequence_id other = t.device.add_sequence();
  const auto kv = synthetic::generate_kv(t.generator, 99, 300);
  test::device_array<float> k(kv.k), v(kv.v);
  t.device.prefill(other, tensor_view<const float, 3>(k.data(), 300, 2, 128), tensor_view<const float, 3>(v.data(), 300, 2, 128));
  t.device.attend(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(dq.data(), 1, hq, d), tensor_view<float, 3>(b.data(), 1, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(a.to_host(q.size()) == b.to_host(q.size()));
}

TEST_CASE("GPU packed_bitmap with select::mean_keys: the host's choice, PackedAttention over the pages chosen",
          "[gpu][packed_bitmap][select]") {
  if (!gpu_available()) return;
  struct shape {
    int head_dim, group;
    dtype storage;
  };
  // Groups of up to 4 and of 5 to 8 (the block-key scoring kernel's two widths of query heads).
  const shape s = GENERATE(shape{128, 4, dtype::bf16}, shape{64, 1, dtype::f16}, shape{256, 8, dtype::bf16});
  const int inverse = GENERATE(4, 16);
  const int block = GENERATE(0, 16);
  const int sinks = GENERATE(0, 4);
  const bool portable = GENERATE(false, true);
  CAPTURE(s.head_dim, s.group, inverse, block, sinks, portable);
  select::mean_keys selector;
  selector.budget.ratio = 1.0 / inverse;
  selector.block_tokens = block;
  cache_config c = config_of(s.head_dim, s.group, s.storage);
  c.max_pages = 512;
  selected_twin t(c, 31, make(1, sinks), selector);
  if (portable) t.device.engine().use_portable_kernel();
  // Under a selector the sm_90 kernel keeps three page pairs in flight (device.cuh), which every
  // sm_90 part has the shared memory for at these shapes.
  if (t.device.engine().uses_bulk_copy()) CHECK(t.device.engine().compressed_stages() == 3);
  for (const int length : {700, 1500, 3000}) t.add(length, t.seqs.size());
  check_block_keys(t);
  check_selected_steps(t);
  check_block_keys(t);  // and after appends sealed pages
}

TEST_CASE("GPU packed_bitmap: pages of 16 and 32 tokens, several pages a slot of the sm_90 kernel",
          "[gpu][packed_bitmap][select]") {
  if (!gpu_available()) return;
  const int page_size = GENERATE(16, 32);
  const int g = GENERATE(1, 4);
  CAPTURE(page_size, g);
  cache_config c = config_of(128, 4, dtype::bf16);
  c.page_size = page_size;
  c.max_pages = 256 * 64 / page_size;
  SECTION("select::all: every page, a slot within a split's segment") {
    packed_twin t(c, 41, make(g, 4));
    for (const int length : {1, 63, 64, 65, 256, 300, 700}) t.add(length, t.seqs.size());
    check_records(t);
    check_attention(t);
    for (int step = 0; step < 70; ++step) t.append_step();
    check_attention(t);
  }
  SECTION("select::all: the plan cuts a split at the pages the sm_90 kernel lists") {
    // One segment of 2048 pages of 16 (1024 of 32) and a plan aimed at one split per KV head
    // whose splits cost so much that it takes as few as it may: uncapped, the long sequence's
    // 600 pages would be one split (plus the dense tail's own); the sm_90 kernel lists at most
    // `packed_listed_pages` of them, so the plan must cut them in two.
    format::packed_bitmap f = make(g, 4);
    f.segment_tokens = 32768;
    c.max_pages = 1024;
    packed_twin t(c, 47, f);
    t.device.engine().set_target_splits(1);
    t.device.engine().set_split_cost_pages(1 << 20);
    const int pages = kvmosaic::cuda::kernel::packed_listed_pages + 88;
    t.add(pages * page_size + 9, 0);
    check_attention(t);
    CHECK(t.device.engine().last_step_splits() == (t.device.engine().uses_bulk_copy() ? 3 : 2));
    for (int step = 0; step < 3; ++step) t.append_step();
    check_attention(t);
  }
  SECTION("select::mean_keys: chosen pages, a slot cut where the segment changes") {
    // Whole pages of 16 (no row masks), or blocks of 16 in pages of 32 (row masks per page).
    select::mean_keys selector;
    selector.budget.ratio = 1.0 / 4;
    selector.block_tokens = page_size == 16 ? 0 : 16;
    selected_twin t(c, 43, make(g, 4), selector);
    // Slots of several small pages take two stages under a selector (device.cuh, `configure`).
    if (t.device.engine().uses_bulk_copy()) CHECK(t.device.engine().compressed_stages() == 2);
    // The tables pulled beside the query rotation at every step (on sm_90), where these contexts'
    // tables are below the size from which the engine does so; the case above keeps the default.
    t.device.engine().set_pull_beside_bytes(0);
    for (const int length : {700, 1500}) t.add(length, t.seqs.size());
    check_block_keys(t);
    check_selected_steps(t);
    check_block_keys(t);
  }
}
