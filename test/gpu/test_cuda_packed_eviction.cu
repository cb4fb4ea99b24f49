// SPDX-License-Identifier: Apache-2.0
// format::packed_bitmap with score-based eviction on the CUDA backend (select::tova, select::h2o,
// compact::repack), both kernel paths. The device's encoder and the host's differ by their fp32
// summation order, so the device is checked against references computed from its own pages:
// - each step's token scores against the fp64 softmax over the keys the device's pages decode to
//   (`cache::read`), within a bound derived for the rotated computation; H2O's accumulated over
//   the steps, with compactions between them;
// - each eviction against `detail::lowest_ranked` of the device's own scores;
// - each page a compaction writes against the host encoder's page of the same rows (each moved
//   row decoded from its old page in its old segment and rounded, then encoded in its new page's
//   segment), record by record within the bounds of `test::check_record`; pages it does not
//   write keep their bytes;
// - SnapKV's window votes (from the same logits) against fp64 votes over the decoded keys, its
//   snapshot's evictions against a brute force over the device's votes.
// Without a GPU the test says so and returns.

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <vector>

#include "../support/feed.hpp"
#include "../support/packed_bound.hpp"
#include "packed_records.hpp"
#include "snapkv_reference.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

using shapes = backend::cuda_for<kernel_shape<dtype::bf16, 64, 3>, kernel_shape<dtype::bf16, 64, 6>>;
using traits = format_traits<format::packed_bitmap>;
template <class Selector>
using packed_cache = cache<format::packed_bitmap, Selector, compact::repack, shapes>;

cache_config config_of(int group, int page_size = 64) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = group;
  c.head_dim = 64;
  c.page_size = page_size;
  c.max_pages = 64 * 64 / page_size;
  c.max_sequences = 2;
  return c;
}

/// Segments of two pages, so that a sequence spans several and a compaction moves rows across
/// them.
format::packed_bitmap make(int sinks) {
  format::packed_bitmap f;
  f.segment_tokens = 128;
  f.sink_tokens = sinks;
  return f;
}

/// Two sequences of synthetic data, prefilled on the device with `lengths` tokens and `steps`
/// more kept for the appends.
struct workload {
  std::vector<synthetic::kv_data> data;
  std::vector<sequence_id> seqs;
  int lengths[2] = {5 * 64 + 13, 3 * 64 + 2};
};

template <class Cache>
workload prefill(Cache& kv, int steps) {
  const cache_config& c = kv.config();
  workload w;
  for (int b = 0; b < 2; ++b) {
    const int n = w.lengths[b];
    w.data.push_back(synthetic::generate_kv(test::generator_for(c, 29 + static_cast<std::uint64_t>(b)), 0, n + steps));
    const device_array<float> k(w.data.back().k), v(w.data.back().v);
    w.seqs.push_back(kv.add_sequence());
    kv.prefill(w.seqs.back(), tensor_view<const float, 3>(k.data(), n, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(v.data(), n, c.num_kv_heads, c.head_dim));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return w;
}

/// Appends token lengths[b] + step of each sequence's data, from device memory.
template <class Cache>
void append_next(Cache& kv, const workload& w, int step) {
  const cache_config& c = kv.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  std::vector<float> k(2 * row), v(2 * row);
  for (std::size_t b = 0; b < 2; ++b) {
    const std::size_t at = static_cast<std::size_t>(w.lengths[b] + step) * row;
    std::copy_n(w.data[b].k.begin() + static_cast<std::ptrdiff_t>(at), row, k.begin() + static_cast<std::ptrdiff_t>(b * row));
    std::copy_n(w.data[b].v.begin() + static_cast<std::ptrdiff_t>(at), row, v.begin() + static_cast<std::ptrdiff_t>(b * row));
  }
  const device_array<float> dk(k), dv(v);
  kv.append(span<const sequence_id>(w.seqs.data(), 2), tensor_view<const float, 3>(dk.data(), 2, c.num_kv_heads, c.head_dim),
            tensor_view<const float, 3>(dv.data(), 2, c.num_kv_heads, c.head_dim));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
}

/// One step's queries (sequence b: step_query(c, step + 100 b)), attended on the device; the
/// outputs in `outputs` where given.
template <class Cache>
std::vector<float> attend(Cache& kv, const workload& w, int step, std::vector<float>* outputs = nullptr) {
  const cache_config& c = kv.config();
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q;
  for (int b = 0; b < 2; ++b) {
    const std::vector<float> one = test::step_query(c, step + 100 * b);
    q.insert(q.end(), one.begin(), one.end());
  }
  device_array<float> dq(q), out(q.size());
  kv.attend(span<const sequence_id>(w.seqs.data(), 2), tensor_view<const float, 3>(dq.data(), 2, hq, d),
            tensor_view<float, 3>(out.data(), 2, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> host_out = out.to_host(q.size());
  for (const float x : host_out) REQUIRE(std::isfinite(x));  // every output written (the buffer was poisoned with NaN)
  if (outputs != nullptr) *outputs = host_out;
  return q;
}

std::vector<std::int64_t> live_positions(const std::vector<std::int64_t>& slots) {
  std::vector<std::int64_t> live;
  for (const std::int64_t p : slots)
    if (p >= 0) live.push_back(p);
  std::sort(live.begin(), live.end());
  return live;
}

/// A sequence's keys as the device's pages decode them (`cache::read`), by slot.
struct decoded_keys {
  std::vector<float> k;
  std::vector<std::int64_t> slots;  ///< each slot's position, -1 when evicted
  int heads = 0, d = 0;
  const float* row(std::size_t slot, int h) const { return k.data() + (slot * heads + static_cast<std::size_t>(h)) * d; }
};
template <class Cache>
decoded_keys read_keys(const Cache& kv, sequence_id seq) {
  const cache_config& c = kv.config();
  decoded_keys out;
  out.heads = c.num_kv_heads;
  out.d = c.head_dim;
  const std::int64_t stored = kv.stored_tokens(seq);
  out.k.resize(static_cast<std::size_t>(stored) * out.heads * out.d);
  std::vector<float> v(out.k.size());
  kv.read(seq, tensor_view<float, 3>(out.k.data(), stored, out.heads, out.d), tensor_view<float, 3>(v.data(), stored, out.heads, out.d));
  out.slots = kv.positions(seq);
  return out;
}

/// The largest error of the device's scaled logit of query `qj` (KV head h) over the live rows,
/// against scale q . k on the decoded keys: a sealed row's logit is fl(fl(q B_k) . y) in its
/// segment's basis, within scale (2 gamma_{D + kept + 2} + q_rounding) sum_j sum_c |q_c| |B_cj|
/// |y_j| of it (test/support/packed_bound.hpp, `folded_bound`: the decoded key the reference reads
/// is off by the same order), a dense row's (sinks, tail) within gamma_{D + 2} scale sum |q k|;
/// the largest over every row and every segment of the sequence is taken.
template <class Cache>
double logit_error(const Cache& kv, sequence_id seq, const decoded_keys& keys, const float* qj, int h, int segment_pages) {
  const int d = keys.d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double q_rounding = kv.engine().uses_bulk_copy() ? std::ldexp(1.0, -16) : 0.0;  // bf16 hi + lo halves of q'
  double delta = 0;
  for (std::size_t i = 0; i < keys.slots.size(); ++i) {
    if (keys.slots[i] < 0) continue;
    double magnitude = 0;
    for (int x = 0; x < d; ++x) magnitude += std::abs(static_cast<double>(qj[x]) * keys.row(i, h)[x]);
    delta = std::max(delta, test::gamma(d + 2) * scale * magnitude);
  }
  const auto pages = static_cast<std::int64_t>(kv.pages(seq).size());
  for (std::int64_t s = 0; s < (pages + segment_pages - 1) / segment_pages; ++s) {
    const traits::segment& seg = kv.engine().segment(kv.slot(seq), s * segment_pages, h);
    const int kept = seg.kept;
    std::vector<double> qb(static_cast<std::size_t>(kept), 0.0);  // sum_c |q_c| |B_cj|
    for (int j = 0; j < kept; ++j)
      for (int x = 0; x < d; ++x) qb[static_cast<std::size_t>(j)] += std::abs(static_cast<double>(qj[x]) * seg.basis[0][static_cast<std::size_t>(x) * kept + j]);
    for (std::size_t i = 0; i < keys.slots.size(); ++i) {
      if (keys.slots[i] < 0) continue;
      const std::vector<double> y = test::rotate(keys.row(i, h), seg.basis[0], d, kept);
      double sum = 0;
      for (int j = 0; j < kept; ++j) sum += qb[static_cast<std::size_t>(j)] * std::abs(y[static_cast<std::size_t>(j)]);
      delta = std::max(delta, scale * (2 * test::gamma(d + kept + 2) + q_rounding) * sum);
    }
  }
  return delta;
}

/// What one step writes to `seq`'s scores ([position][KV head], fp64) and the bound on the
/// device's difference from it. Per query head, p = exp(s - m) / l over the live tokens, s = scale
/// q . k on the keys the device's pages decode to; each logit within `logit_error` of the
/// device's, so p moves by a factor within e^{4 delta + 2 u range} (1 + gamma_{n + blocks + 8}),
/// as for the other formats (test/unit/test_token_scores.cpp).
struct expected_scores {
  std::vector<double> score, bound;
  std::vector<bool> live;  ///< [position]: held at the step (an evicted position keeps its last score)
};
template <class Cache>
expected_scores oracle_scores(const Cache& kv, sequence_id seq, const float* q, group_combine combine, int segment_pages) {
  const cache_config& c = kv.config();
  const int heads = c.num_kv_heads, groups = c.group_size, d = c.head_dim;
  const decoded_keys keys = read_keys(kv, seq);
  const std::vector<std::int64_t>& slots = keys.slots;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  expected_scores e;
  e.score.assign(static_cast<std::size_t>(kv.length(seq)) * heads, 0.0);
  e.bound.assign(e.score.size(), 0.0);
  e.live.assign(static_cast<std::size_t>(kv.length(seq)), false);
  std::int64_t live = 0;
  for (const std::int64_t p : slots)
    if (p >= 0) {
      ++live;
      e.live[static_cast<std::size_t>(p)] = true;
    }
  const double blocks = std::ceil(static_cast<double>(kv.stored_tokens(seq)) / c.page_size) + 2;
  for (int h = 0; h < heads; ++h)
    for (int g = 0; g < groups; ++g) {
      const float* qj = q + static_cast<std::size_t>(h * groups + g) * d;
      std::vector<double> logit(slots.size(), 0.0);
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] < 0) continue;
        double dot = 0;
        for (int x = 0; x < d; ++x) dot += static_cast<double>(qj[x]) * keys.row(i, h)[x];
        logit[i] = scale * dot;
      }
      test::add_probabilities(logit, slots, heads, h, logit_error(kv, seq, keys, qj, h, segment_pages),
                              static_cast<double>(live) + blocks + 8, combine, e.score, e.bound);
    }
  return e;
}

/// Adds one step's expected scores to `total` (H2O's accumulation; new positions start at zero).
void accumulate(expected_scores& total, const expected_scores& step) {
  total.score.resize(step.score.size(), 0.0);
  total.bound.resize(step.bound.size(), 0.0);
  total.live = step.live;
  for (std::size_t i = 0; i < step.score.size(); ++i) {
    total.score[i] += step.score[i];
    total.bound[i] += step.bound[i] + 2 * std::ldexp(1.0, -24) * total.score[i];  // one fp32 addition more
  }
}

/// The device's scores of `seq`'s live positions within `e`'s bounds; returns how many scored
/// above zero.
template <class Cache>
std::int64_t check_scores(const Cache& kv, sequence_id seq, const expected_scores& e) {
  const std::vector<float> ds = kv.token_scores(seq);
  REQUIRE(ds.size() == e.score.size());
  std::int64_t scored = 0;
  for (std::size_t i = 0; i < ds.size(); ++i) {
    if (!e.live[i / static_cast<std::size_t>(kv.config().num_kv_heads)]) continue;
    INFO("sequence " << seq << ", score " << i << ": device " << ds[i] << ", expected " << e.score[i] << " +- " << e.bound[i]);
    REQUIRE(std::abs(ds[i] - e.score[i]) <= e.bound[i] + 1e-12);
    scored += ds[i] > 0.0f;
  }
  return scored;
}

/// The page bytes of `seq`, in block-table order.
template <class Cache>
std::vector<std::byte> page_bytes(const Cache& kv, sequence_id seq) {
  const std::vector<page_id>& pages = kv.pages(seq);
  std::vector<std::byte> out(pages.size() * kv.engine().page_slot_bytes());
  if (!pages.empty()) kv.engine().copy_pages_out(pages.data(), pages.size(), out.data());
  return out;
}

/// Runs `compact` (a compaction of `seq`: `cache::compact`, or a snapshot) and checks every page:
/// one the pass did not write keeps its bytes; in one it wrote, each record holding a token is
/// the host encoder's record of that token's row as the device's old page decodes it
/// (`cache::read`, rounded to bf16), in the new page's segment (`test::check_record`, with one
/// 16-bit step of slack per channel for the device's own decode). Returns the pages it wrote.
template <class Cache, class Compact>
int check_rewritten_pages(Cache& kv, sequence_id seq, const format::packed_bitmap& f, Compact&& compact) {
  const cache_config& c = kv.config();
  const int heads = c.num_kv_heads, d = c.head_dim, p = c.page_size;
  const page_shape shape{p, d, c.storage};
  const std::int64_t stored = kv.stored_tokens(seq);
  std::vector<float> k(static_cast<std::size_t>(stored) * heads * d), v(k.size());
  kv.read(seq, tensor_view<float, 3>(k.data(), stored, heads, d), tensor_view<float, 3>(v.data(), stored, heads, d));
  for (std::vector<float>* rows : {&k, &v})  // rounded as a compaction rounds the rows it decodes
    for (float& x : *rows) x = kvmosaic::detail::storage_value(kvmosaic::detail::storage_bits(x, c.storage), c.storage);
  const std::vector<std::int64_t> before = kv.positions(seq);
  const std::vector<page_id> pages_before = kv.pages(seq);
  const std::vector<std::byte> bytes_before = page_bytes(kv, seq);
  compact();
  const std::vector<std::int64_t> after = kv.positions(seq);
  const std::vector<std::int64_t> live_before = live_positions(before), live_after = live_positions(after);
  REQUIRE(std::includes(live_before.begin(), live_before.end(), live_after.begin(), live_after.end()));  // none came back
  const std::vector<page_id>& pages = kv.pages(seq);
  const std::vector<std::byte> bytes = page_bytes(kv, seq);
  std::map<std::int64_t, std::size_t> slot_before;
  for (std::size_t i = 0; i < before.size(); ++i)
    if (before[i] >= 0) slot_before[before[i]] = i;
  const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape);
  const kvmosaic::detail::arena_geometry& arena = kv.engine().geometry();
  const std::size_t slot_bytes = kv.engine().page_slot_bytes();
  const int per = traits::segment_pages(f, shape);
  int written = 0;
  std::vector<float> rows(static_cast<std::size_t>(p) * d);
  std::vector<std::byte> expected(std::max(arena.k_page_bytes, arena.v_page_bytes));
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const std::byte* now = bytes.data() + i * slot_bytes;
    if (i < pages_before.size() && pages_before[i] == pages[i] && std::equal(now, now + slot_bytes, bytes_before.data() + i * slot_bytes))
      continue;  // not written by the pass (or written with the same bytes)
    ++written;
    for (int h = 0; h < heads; ++h) {
      const traits::segment& seg = kv.engine().segment(kv.slot(seq), static_cast<std::int64_t>(i) / per * per, h);
      for (const int which : {0, 1}) {
        // Row r of the page: the token now in slot i p + r, as its old slot decoded; a slot with
        // no token takes the old row of the same slot (the pass's default source).
        for (int r = 0; r < p; ++r) {
          const std::size_t slot = i * p + static_cast<std::size_t>(r);
          const std::size_t source = after[slot] >= 0 ? slot_before.at(after[slot]) : slot;
          const float* x = (which == 0 ? k.data() : v.data()) + (source * heads + static_cast<std::size_t>(h)) * d;
          std::copy_n(x, d, rows.begin() + static_cast<std::ptrdiff_t>(r) * d);
        }
        if (which == 0) traits::encode_k(f, shape, seg, rows.data(), expected.data());
        else traits::encode_v(f, shape, seg, rows.data(), expected.data());
        const std::byte* device_page = now + (which == 0 ? arena.k_page_offset(h) : arena.v_page_offset(h));
        for (int r = 0; r < p; ++r) {
          if (after[i * p + static_cast<std::size_t>(r)] < 0) continue;
          CAPTURE(seq, i, h, which, r);
          test::check_record(rows.data() + static_cast<std::ptrdiff_t>(r) * d, d, seg.basis[which], seg.strategy[which], g,
                             expected.data(), device_page, r, c.storage, std::ldexp(1.0, -8));
        }
      }
    }
  }
  return written;
}

/// TOVA over packed_bitmap on the device: `steps` decode steps of two sequences, a budget of 240
/// tokens, a compaction of both every 6 steps (checked page by page); each step's scores against
/// the fp64 oracle, each append's evictions against `lowest_ranked` of the device's scores.
void check_tova(bool portable, int group) {
  const cache_config c = config_of(group);
  const format::packed_bitmap f = make(0);
  select::tova s;
  s.budget.tokens = 240;
  s.compact_every = 1 << 20;  // the test compacts
  packed_cache<select::tova> kv(c, f, s);
  if (portable) kv.engine().use_portable_kernel();
  const int steps = 19, per = traits::segment_pages(f, page_shape{c.page_size, c.head_dim, c.storage});
  const workload w = prefill(kv, steps);
  int evicted = 0, written = 0;
  for (int step = 0; step < steps; ++step) {
    if (step > 0 && step % 6 == 0)
      for (const sequence_id seq : w.seqs) written += check_rewritten_pages(kv, seq, f, [&] { kv.compact(seq); });
    const std::vector<float> q = attend(kv, w, step);
    std::vector<std::vector<float>> scores;
    std::vector<std::vector<std::int64_t>> live;
    for (std::size_t b = 0; b < 2; ++b) {
      INFO("step " << step << ", sequence " << b);
      const sequence_id seq = w.seqs[b];
      CHECK(check_scores(kv, seq,
                         oracle_scores(kv, seq, q.data() + b * static_cast<std::size_t>(c.num_q_heads()) * c.head_dim,
                                       group_combine::sum, per)) > 0);
      scores.push_back(kv.token_scores(seq));
      live.push_back(live_positions(kv.positions(seq)));
    }
    if (step + 1 == steps) break;
    append_next(kv, w, step + 1);
    for (std::size_t b = 0; b < 2; ++b) {
      const sequence_id seq = w.seqs[b];
      const std::vector<std::int64_t> slots = kv.positions(seq);
      const std::size_t sealed = kv.pages(seq).size() * static_cast<std::size_t>(c.page_size);
      std::int64_t open_from = kv.length(seq);
      for (std::size_t i = sealed; i < slots.size(); ++i)
        if (slots[i] >= 0) open_from = std::min(open_from, slots[i]);
      std::vector<std::int64_t> candidates;
      for (const std::int64_t p : live[b])
        if (p < open_from) candidates.push_back(p);
      const auto count = std::max<std::int64_t>(0, static_cast<std::int64_t>(live[b].size()) + 1 - s.budget.tokens);
      const std::vector<float>& sc = scores[b];
      std::vector<std::int64_t> expected = kvmosaic::detail::lowest_ranked(candidates, count, [&](std::int64_t p) {
        float total = 0.0f;
        for (int h = 0; h < c.num_kv_heads; ++h) total += sc[static_cast<std::size_t>(p) * c.num_kv_heads + static_cast<std::size_t>(h)];
        return total;
      });
      std::sort(expected.begin(), expected.end());
      std::vector<std::int64_t> before = live[b];
      before.push_back(kv.length(seq) - 1);
      const std::vector<std::int64_t> now = live_positions(slots);
      std::vector<std::int64_t> gone;
      std::set_difference(before.begin(), before.end(), now.begin(), now.end(), std::back_inserter(gone));
      INFO("step " << step << ", sequence " << b);
      REQUIRE(gone == expected);
      evicted += static_cast<int>(gone.size());
    }
  }
  CHECK(evicted > 0);
  CHECK(written > 0);
  for (const sequence_id seq : w.seqs) CHECK(kv.stored_tokens(seq) <= s.budget.tokens + c.page_size);
}

/// The device's attention `out` for sequence `seq` (queries q, [q heads][d]) against fp64
/// attention over the live rows its pages decode to, per element within `test::folded_bound`:
/// the sinks and the tail dense, each segment's sealed rows in its rotated space, with the
/// kernel's operand rounding.
template <class Cache>
void check_attention(const Cache& kv, sequence_id seq, const float* q, const float* out, const format::packed_bitmap& f) {
  const cache_config& c = kv.config();
  const int hq = c.num_q_heads(), d = c.head_dim, heads = c.num_kv_heads, page = c.page_size;
  const page_shape shape{page, d, c.storage};
  const int per = traits::segment_pages(f, shape);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const synthetic::kv_data dec = test::decoded(kv, seq, heads, d);
  const std::vector<std::int64_t> slots = kv.positions(seq);
  const auto pages = static_cast<std::int64_t>(kv.pages(seq).size());
  const std::int64_t sealed = pages * page;
  // The parts folded in one basis each: index 0 the dense rows (sinks and tail), i + 1 segment i's.
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>((pages + per - 1) / per) + 1);
  std::vector<std::int64_t> live;
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(slots.size()); ++i) {
    if (slots[static_cast<std::size_t>(i)] < 0) continue;
    live.push_back(i);
    const bool dense = slots[static_cast<std::size_t>(i)] < f.sink_tokens || i >= sealed;
    rows[dense ? 0 : static_cast<std::size_t>(i / page / per) + 1].push_back(i);
  }
  std::vector<synthetic::kv_data> parts_tokens;
  for (const std::vector<std::int64_t>& r : rows) parts_tokens.push_back(test::tokens_of(dec, r));
  const synthetic::kv_data kept = test::tokens_of(dec, live);
  const std::vector<double> exact =
      host::exact_attention(tensor_view<const float, 2>(q, hq, d), test::k_view(kept), test::v_view(kept), scale);
  const double q_rounding = kv.engine().uses_bulk_copy() ? std::ldexp(1.0, -16) : 0.0;
  const double p_rounding = kv.engine().splits_p_on_tensor_cores() ? q_rounding : 0.0;
  for (int h = 0; h < heads; ++h) {
    std::vector<test::folded_part> parts;
    for (std::size_t i = 0; i < parts_tokens.size(); ++i)
      if (parts_tokens[i].num_tokens > 0)
        parts.push_back({&parts_tokens[i], i == 0 ? nullptr : &kv.engine().segment(kv.slot(seq), static_cast<std::int64_t>(i - 1) * per, h)});
    const std::vector<double> bound =
        test::folded_bound(std::vector<float>(q, q + static_cast<std::size_t>(hq) * d), h, c.group_size, scale, page,
                           static_cast<double>(pages + 2), parts, q_rounding, p_rounding);
    for (int i = 0; i < c.group_size * d; ++i) {
      const std::size_t at = static_cast<std::size_t>(h) * c.group_size * d + static_cast<std::size_t>(i);
      INFO("element " << at << ": device " << out[at] << ", exact " << exact[at]);
      REQUIRE(std::abs(out[at] - exact[at]) <= bound[static_cast<std::size_t>(i)]);
    }
  }
}

/// SnapKV over packed_bitmap on the device, for sequence b of a two-sequence prefill: the
/// window's votes (from the split kernels' logits) against fp64 votes over the keys the device's
/// pages decode to (`detail::window_votes`), within the relative error the logits' `logit_error`
/// allows; the snapshot's evictions against a brute force over the device's votes; the pages its
/// compaction wrote against the host encoder's.
void check_snapkv(bool portable, group_combine combine) {
  const cache_config c = config_of(3);
  const format::packed_bitmap f = make(4);  // sinks: never candidates
  const int per = traits::segment_pages(f, page_shape{c.page_size, c.head_dim, c.storage});
  select::snapkv s;
  s.budget.tokens = 160;
  s.window = 8;
  s.combine = combine;
  packed_cache<select::snapkv> kv(c, f, s);
  if (portable) kv.engine().use_portable_kernel();
  const workload w = prefill(kv, 0);
  const int hq = c.num_q_heads(), d = c.head_dim, heads = c.num_kv_heads;
  for (std::size_t b = 0; b < 2; ++b) {
    INFO("sequence " << b);
    const sequence_id seq = w.seqs[b];
    std::vector<float> window;
    for (int q = 0; q < s.window; ++q) {
      const std::vector<float> one = test::step_query(c, 7 * q + 3 * static_cast<int>(b));
      window.insert(window.end(), one.begin(), one.end());
    }
    const tensor_view<const float, 3> queries(window.data(), s.window, hq, d);
    const std::int64_t length = kv.length(seq), window_start = length - s.window;
    const std::vector<double> votes = kv.window_votes(seq, queries, 0.0f, combine);
    const decoded_keys keys = read_keys(kv, seq);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const std::vector<double> reference = kvmosaic::detail::window_votes(
        [&](std::int64_t i, int h, int x) { return keys.row(static_cast<std::size_t>(i), h)[x]; }, keys.slots,
        [&](int q, int j, int x) { return static_cast<double>(window[(static_cast<std::size_t>(q) * hq + j) * d + x]) * scale; },
        window_start, s.window, heads, c.group_size, d, combine);
    // Each vote sums (or takes the largest of) probabilities, each within a factor e^{4 delta}
    // (1 + gamma) of the reference's, delta the largest logit error of the window's queries.
    double delta = 0;
    for (int q = 0; q < s.window; ++q)
      for (int j = 0; j < hq; ++j)
        delta = std::max(delta, logit_error(kv, seq, keys, window.data() + (static_cast<std::size_t>(q) * hq + j) * d, j / c.group_size, per));
    const double relative = std::expm1(4 * delta) + test::gamma(static_cast<double>(length) + 16);
    REQUIRE(votes.size() == reference.size());
    std::int64_t voted = 0;
    for (std::size_t i = 0; i < votes.size(); ++i) {
      INFO("vote " << i << ": device " << votes[i] << ", reference " << reference[i]);
      if (std::isinf(reference[i])) {
        REQUIRE(std::isinf(votes[i]));
        continue;
      }
      REQUIRE(std::abs(votes[i] - reference[i]) <= relative * std::abs(reference[i]) + 1e-12);
      voted += votes[i] > 0.0;
    }
    CHECK(voted > 0);
    const std::vector<std::int64_t> before = kv.positions(seq);
    const std::int64_t open_from = length - kv.stored_tokens(seq) % c.page_size;
    const std::vector<std::int64_t> expected =
        test::brute_force_evictions(votes, before, window_start, std::min(window_start, open_from), f.sink_tokens, heads,
                                    s.pool_kernel, s.budget.resolve(length));
    std::int64_t evicted = 0;
    check_rewritten_pages(kv, seq, f, [&] { evicted = kv.snapshot(seq, queries); });
    CHECK(evicted == static_cast<std::int64_t>(expected.size()));
    std::vector<std::int64_t> gone;
    const std::vector<std::int64_t> live_before = live_positions(before), live_after = live_positions(kv.positions(seq));
    std::set_difference(live_before.begin(), live_before.end(), live_after.begin(), live_after.end(), std::back_inserter(gone));
    REQUIRE(gone == expected);
  }
  // A step after the snapshots reads the compacted pages in their segments.
  std::vector<float> out;
  const std::vector<float> q = attend(kv, w, 0, &out);
  for (std::size_t b = 0; b < 2; ++b)
    check_attention(kv, w.seqs[b], q.data() + b * static_cast<std::size_t>(hq) * d, out.data() + b * static_cast<std::size_t>(hq) * d, f);
}

}  // namespace

TEST_CASE("GPU packed_bitmap token scores: the fp64 softmax over the device's decoded keys, both kernels, groups 3 and 6",
          "[gpu][packed_bitmap][token_scores]") {
  if (!gpu_available()) return;
  // Pages of 16 on the sm_90 kernel: four pages a slot, each warp's logits at its own page's rows.
  for (const int group : {3, 6})
    for (const int page_size : {64, 16})
      for (const bool portable : {false, true}) {
        if (portable && page_size != 64) continue;
        INFO("group " << group << ", pages of " << page_size << (portable ? ", portable kernel" : ", sm_90 kernel where there is one"));
        const cache_config c = config_of(group, page_size);
        const format::packed_bitmap f = make(4);  // sinks: exact rows, masked in page 0
        const int per = traits::segment_pages(f, page_shape{c.page_size, c.head_dim, c.storage});
        select::h2o s;  // H2O's accumulation, group max, over three steps
        s.budget.tokens = 1 << 20;
        s.combine = group_combine::max;
        packed_cache<select::h2o> kv(c, f, s);
        if (portable) kv.engine().use_portable_kernel();
        const workload w = prefill(kv, 3);
        std::vector<expected_scores> total(2);
        for (int step = 0; step < 3; ++step) {
          if (step > 0) append_next(kv, w, step);
          std::vector<expected_scores> next;
          for (std::size_t b = 0; b < 2; ++b) {
            const std::vector<float> q = test::step_query(c, step + 100 * static_cast<int>(b));
            next.push_back(oracle_scores(kv, w.seqs[b], q.data(), group_combine::max, per));
          }
          attend(kv, w, step);
          for (std::size_t b = 0; b < 2; ++b) {
            INFO("step " << step << ", sequence " << b);
            accumulate(total[b], next[b]);
            CHECK(check_scores(kv, w.seqs[b], total[b]) > 0);
          }
        }
      }
}

TEST_CASE("GPU packed_bitmap eviction: TOVA evicts the lowest of the device's scores, compaction re-encodes in the new segments",
          "[gpu][packed_bitmap][token_scores][compaction]") {
  if (!gpu_available()) return;
  SECTION("sm_90 kernel where there is one, group 3") { check_tova(false, 3); }
  SECTION("portable kernel, group 6") { check_tova(true, 6); }
}

TEST_CASE("GPU packed_bitmap snapkv: window votes from the device's logits, the snapshot's evictions and re-encoded pages",
          "[gpu][packed_bitmap][snapkv]") {
  if (!gpu_available()) return;
  SECTION("sm_90 kernel where there is one, group sum") { check_snapkv(false, group_combine::sum); }
  SECTION("portable kernel, group max") { check_snapkv(true, group_combine::max); }
}
