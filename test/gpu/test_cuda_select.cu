// SPDX-License-Identifier: Apache-2.0
// select::quest on the CUDA backend, over dense, bitmap_tiles and quant2: the device keeps the
// host's key bounds, its scoring and top-k choose the pages the host chooses (the same fp32
// order, so the same set), and attention over them matches the host and fp64 exact attention over
// exactly the tokens read. A budget of the whole context reproduces select::all bit for bit.

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "reliability.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;
using test::small_config;

namespace {

using ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

/// A page-block selector (quest, mean_keys) over whole pages (the page-granular path; sub-page
/// blocks are set where a case says).
template <class Selector = select::quest>
Selector selector_of(double ratio) {
  Selector s;
  s.budget.ratio = ratio;
  s.block_tokens = 0;
  return s;
}
select::quest quest_of(double ratio) { return selector_of<select::quest>(ratio); }

/// The tokens of `kv` inside `read`, for one KV head.
synthetic::kv_data head_subset(const synthetic::kv_data& kv, int head, const ranges& read) {
  synthetic::kv_data r;
  r.num_kv_heads = 1;
  r.head_dim = kv.head_dim;
  for (const auto& [from, to] : read)
    for (std::int64_t t = from; t < to; ++t) {
      r.k.insert(r.k.end(), kv.k_row(static_cast<int>(t), head), kv.k_row(static_cast<int>(t), head) + kv.head_dim);
      r.v.insert(r.v.end(), kv.v_row(static_cast<int>(t), head), kv.v_row(static_cast<int>(t), head) + kv.head_dim);
      ++r.num_tokens;
    }
  return r;
}

/// Attends on both backends; checks that the device chose the host's pages, and (dense and
/// bitmap_tiles) that both outputs match fp64 exact attention over the tokens read.
template <class Format, class Selector>
void check_selected_step(test::twin<Format, Selector>& t, bool check_exact = true) {
  const auto step = t.attend_both();
  const std::vector<float>& q = step.q;
  const std::vector<float>& host_out = step.host;
  const std::vector<float>& gpu_out = step.gpu;
  const int hq = t.config.num_q_heads(), d = t.config.head_dim, g = t.config.group_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double q_rounding = t.q_rounding(), p_rounding = t.p_rounding();
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const sequence_id seq = t.seqs[b];
    const int length = static_cast<int>(t.host.length(seq));
    const std::int64_t sealed = static_cast<std::int64_t>(t.host.pages(seq).size()) * t.config.page_size;
    // Read whatever the selection: sentence_chunks' open chunk (from the end of the last closed one).
    std::int64_t always_from = length;
    if constexpr (selector_traits<Selector>::needs_token_ids) {
      const auto chunks = t.host.chunks(seq);
      always_from = chunks.empty() ? 0 : chunks.back().end;
    }
    CAPTURE(b, length);
    const auto kept = t.kept_values(test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), t.config.storage));
    for (int h = 0; h < t.config.num_kv_heads; ++h) {
      CAPTURE(h);
      // The device's pages are the host's selection, page for page, and with blocks smaller than
      // a page, row for row.
      const int page = t.config.page_size, words = (page + 31) / 32;
      std::vector<std::uint32_t> rows(static_cast<std::size_t>(sealed / page) * words, 0u);
      ranges read = t.host.selected_ranges(seq, h);
      read.emplace_back(std::min(always_from, sealed), length);
      for (const auto& [from, to] : read)
        for (std::int64_t token = from; token < std::min(to, sealed); ++token)
          rows[static_cast<std::size_t>(token / page * words + token % page / 32)] |= 1u << (token % page % 32);
      // The rows a page is read for: the exact tokens (sinks, recent window) are read from their
      // exact copies, so their page copies are masked out of the device's row masks -- except
      // the sinks of a format whose split kernel skips a first page's sinks itself
      // (`device_format::masks_sink_rows`, quant2), when there is no window to mask besides.
      std::vector<std::uint32_t> page_rows = rows;
      const std::int64_t window = window_rows(t.host.format());
      const std::int64_t sinks = window > 0 || !kvmosaic::cuda::device_format<Format>::masks_sink_rows ? sink_rows(t.host.format()) : 0;
      for (std::int64_t token = 0; token < sealed; ++token)
        if (token < sinks || token >= sealed - window)
          page_rows[static_cast<std::size_t>(token / page * words + token % page / 32)] &= ~(1u << (token % page % 32));
      std::vector<std::int32_t> expected;
      std::vector<std::uint32_t> expected_rows;
      for (std::size_t i = 0; i < rows.size() / static_cast<std::size_t>(words); ++i) {
        const auto first = rows.begin() + static_cast<std::ptrdiff_t>(i * static_cast<std::size_t>(words));
        if (std::all_of(first, first + words, [](std::uint32_t w) { return w == 0; })) continue;
        expected.push_back(t.host.pages(seq)[i]);
        const auto masked = page_rows.begin() + static_cast<std::ptrdiff_t>(i * static_cast<std::size_t>(words));
        expected_rows.insert(expected_rows.end(), masked, masked + words);
      }
      REQUIRE(t.device.engine().selection().selected_pages(static_cast<std::int32_t>(b), h) == expected);
      if (t.device.engine().selection().row_masks())
        REQUIRE(t.device.engine().selection().selected_rows(static_cast<std::int32_t>(b), h) == expected_rows);
      // The tokens read, once each: the chosen spans (which may reach into the tail) and the rest.
      std::vector<char> is_read(static_cast<std::size_t>(length), 0);
      for (const auto& [from, to] : read)
        for (std::int64_t token = from; token < std::min<std::int64_t>(to, length); ++token) is_read[static_cast<std::size_t>(token)] = 1;
      for (std::int64_t token = sealed; token < length; ++token) is_read[static_cast<std::size_t>(token)] = 1;
      read.clear();
      for (std::int64_t token = 0; token < length; ++token)
        if (is_read[static_cast<std::size_t>(token)] != 0) {
          if (!read.empty() && read.back().second == token)
            ++read.back().second;
          else
            read.emplace_back(token, token + 1);
        }
      const std::size_t first_out = (b * static_cast<std::size_t>(hq) + static_cast<std::size_t>(h) * g) * d;
      for (std::size_t i = 0; i < static_cast<std::size_t>(g) * d; ++i) REQUIRE(std::isfinite(gpu_out[first_out + i]));
      if (!check_exact || read.empty()) continue;
      const auto kv = head_subset(kept, h, read);
      const std::vector<float> qh(q.begin() + static_cast<std::ptrdiff_t>(first_out),
                                  q.begin() + static_cast<std::ptrdiff_t>(first_out + static_cast<std::size_t>(g) * d));
      const auto exact = test::exact(qh, kv, scale);
      const auto bound = test::attention_error_bound(qh, kv, g, scale, t.config.storage, t.config.page_size, true,
                                                     q_rounding, p_rounding);
      for (std::size_t i = 0; i < exact.size(); ++i) {
        INFO("element " << i);
        REQUIRE(std::abs(gpu_out[first_out + i] - exact[i]) <= bound.per_element[i]);
        REQUIRE(std::abs(gpu_out[first_out + i] - host_out[first_out + i]) <= 2 * bound.per_element[i]);
      }
    }
  }
}

template <class Format, class Selector = select::quest>
void run_selection_matrix(const Format& format, bool check_exact, int page_size, int block_tokens = 0) {
  for (const dtype storage : {dtype::bf16, dtype::f16})
    for (const int head_dim : {64, 128, 256})
      for (const int group : {1, 3, 8})
        for (const double ratio : {1.0 / 16, 1.0 / 4}) {
          CAPTURE(to_string(storage), head_dim, group, ratio);
          const cache_config c = small_config(head_dim, group, storage, page_size);
          Selector s = selector_of<Selector>(ratio);
          s.block_tokens = block_tokens;
          s.combine = group == 3 ? group_combine::sum : group_combine::max;
          test::twin<Format, Selector> t(c, 41 + head_dim + group, format, s);
          for (const int length : {1, page_size - 1, page_size, 3 * page_size + 5, 40 * page_size + 17})
            t.add(length, static_cast<std::uint64_t>(length));
          check_selected_step(t, check_exact);
          t.append_step();
          check_selected_step(t, check_exact);
        }
}

}  // namespace

TEST_CASE("GPU quest over dense: the host's pages, and exact attention over them", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  run_selection_matrix(format::dense{}, true, 64);
}

TEST_CASE("GPU quest over dense with the portable kernel and pages of 128", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(128, 4, dtype::bf16, 128);
  test::twin<format::dense, select::quest> t(c, 7, {}, quest_of(1.0 / 8));
  t.device.engine().use_portable_kernel();
  for (const int length : {100, 1000, 5000}) t.add(length, static_cast<std::uint64_t>(length));
  check_selected_step(t);
}

TEST_CASE("GPU quest over dense with pages of 16 (Quest's block size)", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  for (const double ratio : {1.0 / 16, 1.0 / 4}) {
    const cache_config c = small_config(128, 4, dtype::bf16, 16);
    test::twin<format::dense, select::quest> t(c, 17, {}, quest_of(ratio));
    for (const int length : {15, 16, 700, 3000}) t.add(length, static_cast<std::uint64_t>(length));
    check_selected_step(t);
    t.append_step();
    check_selected_step(t);
  }
}

TEST_CASE("GPU top-k: equal scores go to the earlier page; sequences of more than 8192 pages", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  // The top-k places 1024 pages a round and prefetches the ids of its first 8 rounds: the long
  // sequence (9,000 pages of 16) has later rounds. Zero queries score every page 0, so the budget
  // ends inside one run of equal keys, which go in sequence order: the first k pages. A one-hot
  // query scores a page by one channel's stored bound, whose 16-bit values repeat.
  cache_config c = small_config(128, 4, dtype::bf16, 16);
  c.max_pages = 9200;
  test::twin<format::dense, select::quest> t(c, 23, {}, quest_of(1.0 / 16));
  for (const int length : {700, 9000 * 16 + 5}) t.add(length, static_cast<std::uint64_t>(length));
  check_selected_step(t);
  t.adjust_queries = [](std::vector<float>& q) { std::fill(q.begin(), q.end(), 0.0f); };
  check_selected_step(t);
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const auto pages = t.host.pages(t.seqs[b]);
    const std::size_t k = static_cast<std::size_t>(t.device.engine().selection().selected_pages(static_cast<std::int32_t>(b), 0).size());
    CAPTURE(b, k, pages.size());
    REQUIRE(k > 0);
    REQUIRE(k < pages.size());
    for (int h = 0; h < c.num_kv_heads; ++h)
      REQUIRE(t.device.engine().selection().selected_pages(static_cast<std::int32_t>(b), h) ==
              std::vector<std::int32_t>(pages.begin(), pages.begin() + static_cast<std::ptrdiff_t>(k)));
  }
  t.adjust_queries = [d = c.head_dim](std::vector<float>& q) {
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = i % static_cast<std::size_t>(d) == 0 ? 1.0f : 0.0f;
  };
  check_selected_step(t);
}

TEST_CASE("GPU quest over bitmap_tiles and quant2", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  format::bitmap_tiles bt;
  bt.s_k = bt.s_v = 0.7;
  run_selection_matrix(bt, true, 64);
  format::quant2 q2;
  q2.sink_tokens = 4;
  run_selection_matrix(q2, false, 64);  // pages picked as the host picks them (quant2's bounds: test_cuda_quant2)
}

TEST_CASE("GPU quest with a whole-context budget is select::all, bit for bit; budget 0 reads sinks and tail",
          "[gpu][select][quest]") {
  if (!gpu_available()) return;
  const auto run = [](auto format) {
    using F = decltype(format);
    const cache_config c = small_config(128, 4, dtype::bf16, 64);
    select::quest everything = quest_of(1.0);
    test::twin<F, select::quest> selected(c, 5, format, everything);
    test::twin<F> plain(c, 5, format);
    for (const int length : {70, 4000, 9000}) {
      selected.add(length, static_cast<std::uint64_t>(length));
      plain.add(length, static_cast<std::uint64_t>(length));
    }
    const std::vector<float> q = plain.queries();
    const auto batch = static_cast<std::int64_t>(plain.seqs.size());
    const int hq = c.num_q_heads(), d = c.head_dim;
    test::device_array<float> dq(q), a(q.size()), b(q.size());
    const span<const sequence_id> ids(plain.seqs.data(), batch);
    selected.device.attend(ids, tensor_view<const float, 3>(dq.data(), batch, hq, d), tensor_view<float, 3>(a.data(), batch, hq, d));
    plain.device.attend(ids, tensor_view<const float, 3>(dq.data(), batch, hq, d), tensor_view<float, 3>(b.data(), batch, hq, d));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(a.to_host(q.size()) == b.to_host(q.size()));
  };
  run(format::dense{});
  format::bitmap_tiles bt;
  bt.s_k = bt.s_v = 0.5;
  run(bt);
  format::quant2 q2;
  q2.sink_tokens = 4;
  run(q2);

  // Budget 0 over quant2 with sinks: the 4 sink rows and the tail, exactly (dense rows).
  const cache_config c = small_config(128, 4, dtype::bf16, 64);
  select::quest none = quest_of(0.0);
  none.budget.tokens = 0;
  format::quant2 f;
  f.sink_tokens = 4;
  test::twin<format::quant2, select::quest> t(c, 9, f, none);
  for (const int length : {30, 700, 3000}) t.add(length, static_cast<std::uint64_t>(length));
  const std::vector<float> q = t.queries();
  const auto batch = static_cast<std::int64_t>(t.seqs.size());
  const int hq = c.num_q_heads(), d = c.head_dim;
  test::device_array<float> dq(q), out(q.size());
  t.device.attend(span<const sequence_id>(t.seqs.data(), batch), tensor_view<const float, 3>(dq.data(), batch, hq, d),
                  tensor_view<float, 3>(out.data(), batch, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = out.to_host(q.size());
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const int length = static_cast<int>(t.host.length(t.seqs[b]));
    const std::int64_t sealed = length / 64 * 64;
    const auto stored = test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), c.storage);
    ranges read;
    if (sealed > 0) read.emplace_back(0, 4);
    if (sealed < length) read.emplace_back(sealed, length);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const auto kv = head_subset(stored, h, read);
      const std::size_t first = (b * static_cast<std::size_t>(hq) + static_cast<std::size_t>(h) * c.group_size) * d;
      const std::vector<float> qh(q.begin() + static_cast<std::ptrdiff_t>(first),
                                  q.begin() + static_cast<std::ptrdiff_t>(first + static_cast<std::size_t>(c.group_size) * d));
      const double scale = 1.0 / std::sqrt(128.0);
      const auto exact = test::exact(qh, kv, scale);
      const auto bound = test::attention_error_bound(qh, kv, c.group_size, scale, c.storage, 64, true);
      for (std::size_t i = 0; i < exact.size(); ++i) REQUIRE(std::abs(got[first + i] - exact[i]) <= bound.per_element[i]);
    }
  }
}

TEST_CASE("GPU quest keeps the host's key bounds, per page and per block", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(128, 4, dtype::f16, 64);
  for (const int block : {0, 16, 8}) {
    CAPTURE(block);
    select::quest s = quest_of(0.25);
    s.block_tokens = block;
    test::twin<format::bitmap_tiles, select::quest> t(c, 3, format::bitmap_tiles{}, s);
    t.add(3000, 1);
    t.append_step();
    const std::size_t bytes = t.host.engine().page_bounds_bytes();
    std::vector<std::byte> device_bounds(bytes);
    for (const page_id page : t.host.pages(t.seqs[0])) {
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_bounds.data(), t.device.engine().selection().bounds_data() + page * bytes, bytes,
                                     cudaMemcpyDeviceToHost));
      REQUIRE(std::memcmp(device_bounds.data(), t.host.engine().page_bounds(page, 0, 0), bytes) == 0);
    }
  }
  select::quest odd;
  odd.block_tokens = 12;
  CHECK_THROWS_WITH((cache<format::dense, select::quest, compact::none, test::gpu_backend>(c, {}, odd)),
                    Catch::Contains("block_tokens"));
}

TEST_CASE("GPU mean_keys over dense, bitmap_tiles and quant2: the host's blocks, and exact attention over them",
          "[gpu][select][mean_keys]") {
  if (!gpu_available()) return;
  run_selection_matrix<format::dense, select::mean_keys>(format::dense{}, true, 64, 16);
  run_selection_matrix<format::dense, select::mean_keys>(format::dense{}, true, 64, 0);
  format::bitmap_tiles bt;
  bt.s_k = bt.s_v = 0.7;
  run_selection_matrix<format::bitmap_tiles, select::mean_keys>(bt, true, 64, 16);
  format::quant2 q2;
  q2.sink_tokens = 4;
  run_selection_matrix<format::quant2, select::mean_keys>(q2, false, 64, 16);
}

TEST_CASE("GPU mean_keys keeps the host's mean rows, per block", "[gpu][select][mean_keys]") {
  if (!gpu_available()) return;
  for (const dtype storage : {dtype::f16, dtype::bf16})
    for (const int block : {0, 16, 8}) {
      CAPTURE(to_string(storage), block);
      const cache_config c = small_config(128, 4, storage, 64);
      select::mean_keys s = selector_of<select::mean_keys>(0.25);
      s.block_tokens = block;
      test::twin<format::dense, select::mean_keys> t(c, 3, format::dense{}, s);
      t.add(3000, 1);
      t.append_step();
      const std::size_t bytes = t.host.engine().page_bounds_bytes();
      REQUIRE(bytes == static_cast<std::size_t>(c.num_kv_heads) * (64 / (block == 0 ? 64 : block)) * 128 * 2);
      std::vector<std::byte> device_rows(bytes);
      for (const page_id page : t.host.pages(t.seqs[0])) {
        KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_rows.data(), t.device.engine().selection().bounds_data() + page * bytes, bytes,
                                       cudaMemcpyDeviceToHost));
        REQUIRE(std::memcmp(device_rows.data(), t.host.engine().page_bounds(page, 0, 0), bytes) == 0);
      }
    }
}

TEST_CASE("GPU quest with blocks smaller than a page: the host's rows, and exact attention over them",
          "[gpu][select][quest][blocks]") {
  if (!gpu_available()) return;
  // (page, block): the TMA kernel (64, 16 and 8; 16, 8), the bulk-copy kernel (48, 16) and four
  // mask words a page (128, 32).
  const std::pair<int, int> shapes[] = {{64, 16}, {64, 8}, {16, 8}, {48, 16}, {128, 32}};
  for (const auto& [page, block] : shapes)
    for (const int head_dim : {64, 128, 256})
      for (const int group : {1, 4, 8})
        for (const double ratio : {1.0 / 16, 1.0 / 4}) {
          CAPTURE(page, block, head_dim, group, ratio);
          const cache_config c = small_config(head_dim, group, dtype::bf16, page);
          select::quest s = quest_of(ratio);
          s.block_tokens = block;
          test::twin<format::dense, select::quest> t(c, 11 + head_dim + group, {}, s);
          for (const int length : {1, page, 3 * page + 5, 40 * page + 17}) t.add(length, static_cast<std::uint64_t>(length));
          check_selected_step(t);
          t.append_step();
          check_selected_step(t);
        }
  SECTION("the portable kernel") {
    const cache_config c = small_config(128, 4, dtype::f16, 64);
    select::quest s = quest_of(1.0 / 8);
    s.block_tokens = 16;
    test::twin<format::dense, select::quest> t(c, 7, {}, s);
    t.device.engine().use_portable_kernel();
    for (const int length : {100, 1000, 5000}) t.add(length, static_cast<std::uint64_t>(length));
    check_selected_step(t);
  }
  SECTION("bitmap_tiles and quant2 with sinks") {
    for (const int block : {8, 32}) {
      const cache_config c = small_config(128, 4, dtype::bf16, 64);
      select::quest s = quest_of(1.0 / 8);
      s.block_tokens = block;
      format::bitmap_tiles bt;
      bt.s_k = bt.s_v = 0.7;
      test::twin<format::bitmap_tiles, select::quest> t(c, 13, bt, s);
      format::quant2 q2;
      q2.sink_tokens = 4;
      test::twin<format::quant2, select::quest> u(c, 13, q2, s);
      for (const int length : {30, 700, 3000}) {
        t.add(length, static_cast<std::uint64_t>(length));
        u.add(length, static_cast<std::uint64_t>(length));
      }
      check_selected_step(t);
      check_selected_step(u, false);
      t.append_step();
      check_selected_step(t);
    }
  }
}

TEST_CASE("GPU quest on small cases (compute-sanitizer)", "[gpu][select][sanitize]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(64, 4, dtype::bf16, 64);
  test::twin<format::dense, select::quest> t(c, 2, {}, quest_of(0.25));
  for (const int length : {5, 300, 700}) t.add(length, static_cast<std::uint64_t>(length));
  check_selected_step(t);
  format::quant2 q2;
  q2.sink_tokens = 2;
  test::twin<format::quant2, select::quest> u(c, 2, q2, quest_of(0.25));
  for (const int length : {5, 300, 700}) u.add(length, static_cast<std::uint64_t>(length));
  check_selected_step(u, false);
  select::quest blocks = quest_of(0.25);
  blocks.block_tokens = 16;
  test::twin<format::dense, select::quest> v(c, 2, {}, blocks);
  for (const int length : {5, 300, 700}) v.add(length, static_cast<std::uint64_t>(length));
  check_selected_step(v);
  select::sentence_chunks chunks;
  chunks.budget.ratio = 0.25;
  for (const auto& b : synthetic::boundary_tokens) chunks.boundaries.push_back(select::boundary{b.id, b.weight});
  test::twin<format::dense, select::sentence_chunks> w(c, 2, {}, chunks);
  for (const int length : {5, 300, 700}) w.add(length, static_cast<std::uint64_t>(length));
  for (int step = 0; step < 3; ++step) w.append_step();
  check_selected_step(w);
}

TEST_CASE("GPU selection reads back after the stream of its step is gone", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(64, 4, dtype::bf16, 64);
  test::twin<format::dense, select::quest> t(c, 3, {}, quest_of(0.25));
  for (const int length : {300, 700}) t.add(length, static_cast<std::uint64_t>(length));
  t.attend_both();  // on the default stream: the reference selection
  std::vector<std::vector<std::int32_t>> expected;
  for (std::int32_t b = 0; b < 2; ++b)
    for (int h = 0; h < c.num_kv_heads; ++h) expected.push_back(t.device.engine().selection().selected_pages(b, h));
  // The same step on a stream of the caller's, destroyed before the selection is read (as an
  // engine or a benchmark tears down its stream): the read-back must not touch that stream.
  cudaStream_t stream = nullptr;
  KVMOSAIC_CUDA_CHECK(cudaStreamCreate(&stream));
  t.device.engine().set_stream(stream);
  t.attend_both();
  t.device.engine().set_stream(nullptr);
  KVMOSAIC_CUDA_CHECK(cudaStreamDestroy(stream));
  std::size_t i = 0;
  for (std::int32_t b = 0; b < 2; ++b)
    for (int h = 0; h < c.num_kv_heads; ++h) REQUIRE(t.device.engine().selection().selected_pages(b, h) == expected[i++]);
}

namespace {

select::sentence_chunks chunks_of(double ratio) {
  select::sentence_chunks s;
  s.budget.ratio = ratio;
  for (const auto& b : synthetic::boundary_tokens) s.boundaries.push_back(select::boundary{b.id, b.weight});
  return s;
}

/// The device closed the host's chunks, for every sequence.
template <class Format>
void check_chunk_counts(test::twin<Format, select::sentence_chunks>& t) {
  for (const sequence_id seq : t.seqs)
    REQUIRE(t.device.engine().selection().chunk_count(t.device.slot(seq)) == static_cast<std::int32_t>(t.host.chunks(seq).size()));
}

}  // namespace

TEST_CASE("GPU sentence_chunks: the host's chunks and rows, and exact attention over them", "[gpu][select][chunks]") {
  if (!gpu_available()) return;
  for (const int page : {64, 16})
    for (const dtype storage : {dtype::bf16, dtype::f16})
      for (const int head_dim : {64, 128, 256})
        for (const int group : {1, 4, 8})
          for (const double ratio : {1.0 / 16, 1.0 / 4}) {
            CAPTURE(page, to_string(storage), head_dim, group, ratio);
            const cache_config c = small_config(head_dim, group, storage, page);
            select::sentence_chunks s = chunks_of(ratio);
            s.combine = group == 4 ? group_combine::sum : group_combine::max;
            test::twin<format::dense, select::sentence_chunks> t(c, 23 + head_dim + group, {}, s);
            for (const int length : {1, 10, 23, page, 3 * page + 5, 40 * page + 17})
              t.add(length, static_cast<std::uint64_t>(length));
            check_chunk_counts(t);
            check_selected_step(t);
            for (int step = 0; step < 24; ++step) t.append_step();  // closes chunks one token at a time
            check_chunk_counts(t);
            check_selected_step(t);
          }
  SECTION("bitmap_tiles and quant2 with sinks, and the portable kernel") {
    const cache_config c = small_config(128, 4, dtype::bf16, 64);
    format::bitmap_tiles bt;
    bt.s_k = bt.s_v = 0.7;
    test::twin<format::bitmap_tiles, select::sentence_chunks> t(c, 29, bt, chunks_of(1.0 / 8));
    format::quant2 q2;
    q2.sink_tokens = 4;
    test::twin<format::quant2, select::sentence_chunks> u(c, 29, q2, chunks_of(1.0 / 8));
    test::twin<format::dense, select::sentence_chunks> v(c, 29, {}, chunks_of(1.0 / 8));
    v.device.engine().use_portable_kernel();
    for (const int length : {30, 700, 3000}) {
      t.add(length, static_cast<std::uint64_t>(length));
      u.add(length, static_cast<std::uint64_t>(length));
      v.add(length, static_cast<std::uint64_t>(length));
    }
    check_selected_step(t);
    check_selected_step(u, false);
    check_selected_step(v);
    for (int step = 0; step < 20; ++step) {
      t.append_step();
      u.append_step();
    }
    check_chunk_counts(t);
    check_chunk_counts(u);
    check_selected_step(t);
    check_selected_step(u, false);
  }
  SECTION("forks copy their chunks; removed sequences free theirs") {
    const cache_config c = small_config(128, 4, dtype::bf16, 64);
    test::twin<format::dense, select::sentence_chunks> t(c, 31, {}, chunks_of(1.0 / 8));
    t.add(2000, 1);
    t.add(500, 2);
    const sequence_id host_child = t.host.fork_sequence(t.seqs[0]);
    const sequence_id device_child = t.device.fork_sequence(t.seqs[0]);
    REQUIRE(host_child == device_child);
    t.seqs.push_back(host_child);
    t.streams.push_back(1);  // the child continues the parent's stream
    for (int step = 0; step < 30; ++step) t.append_step();
    check_chunk_counts(t);
    check_selected_step(t);
    t.host.remove_sequence(t.seqs[1]);
    t.device.remove_sequence(t.seqs[1]);
    t.seqs.erase(t.seqs.begin() + 1);
    t.streams.erase(t.streams.begin() + 1);
    t.add(900, 3);  // reuses the freed slot
    check_chunk_counts(t);
    check_selected_step(t);
  }
}

// --- Reliability (test/gpu/reliability.hpp) -----------------------------------------------------

TEST_CASE("GPU selectors: every operation is all or nothing when any CUDA call inside it fails",
          "[gpu][select][reliability][faults][sanitize]") {
  if (!gpu_available()) return;
  test::reliability::check_every_operation_all_or_nothing<format::dense, select::quest>();
  test::reliability::check_every_operation_all_or_nothing<format::dense, select::sentence_chunks>();
}
