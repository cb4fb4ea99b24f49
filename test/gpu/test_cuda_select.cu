// SPDX-License-Identifier: Apache-2.0
// select::quest on the CUDA backend, over dense, bitmap_tiles and quant2: the device keeps the
// host's key bounds, its scoring and top-k choose the pages the host chooses (the same fp32
// order, so the same set), and attention over them matches the host and fp64 exact attention over
// exactly the tokens read. A budget of the whole context reproduces select::all bit for bit.

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;
using test::small_config;

namespace {

using ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

select::quest quest_of(double ratio) {
  select::quest s;
  s.budget.ratio = ratio;
  return s;
}

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
template <class Format>
void check_selected_step(test::twin<Format, select::quest>& t, bool check_exact = true) {
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
    CAPTURE(b, length);
    const auto kept = t.kept_values(test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), t.config.storage));
    for (int h = 0; h < t.config.num_kv_heads; ++h) {
      CAPTURE(h);
      // The device's pages are the host's selection, page for page.
      std::vector<std::int32_t> expected;
      for (const auto& [from, to] : t.host.selected_ranges(seq, h))
        for (std::int64_t first = from; first < to; first += t.config.page_size)
          expected.push_back(t.host.pages(seq)[static_cast<std::size_t>(first / t.config.page_size)]);
      REQUIRE(t.device.engine().selected_pages(static_cast<std::int32_t>(b), h) == expected);
      ranges read = t.host.selected_ranges(seq, h);
      if (sealed < length) read.emplace_back(sealed, length);
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

template <class Format>
void run_selection_matrix(const Format& format, bool check_exact, int page_size) {
  for (const dtype storage : {dtype::bf16, dtype::f16})
    for (const int head_dim : {64, 128, 256})
      for (const int group : {1, 3, 8})
        for (const double ratio : {1.0 / 16, 1.0 / 4}) {
          CAPTURE(to_string(storage), head_dim, group, ratio);
          const cache_config c = small_config(head_dim, group, storage, page_size);
          select::quest s = quest_of(ratio);
          s.combine = group == 3 ? group_combine::sum : group_combine::max;
          test::twin<Format, select::quest> t(c, 41 + head_dim + group, format, s);
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
  select::quest none;
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

TEST_CASE("GPU quest keeps the host's key bounds and rejects sub-page blocks", "[gpu][select][quest]") {
  if (!gpu_available()) return;
  const cache_config c = small_config(128, 4, dtype::f16, 64);
  test::twin<format::bitmap_tiles, select::quest> t(c, 3, format::bitmap_tiles{}, quest_of(0.25));
  t.add(3000, 1);
  t.append_step();
  const std::size_t bytes = t.host.engine().page_bounds_bytes();
  std::vector<std::byte> device_bounds(bytes);
  for (const page_id page : t.host.pages(t.seqs[0])) {
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(device_bounds.data(), t.device.engine().bounds_data() + page * bytes, bytes,
                                   cudaMemcpyDeviceToHost));
    REQUIRE(std::memcmp(device_bounds.data(), t.host.engine().page_bounds(page, 0, 0), bytes) == 0);
  }
  select::quest sub_page;
  sub_page.block_tokens = 16;
  CHECK_THROWS_WITH((cache<format::dense, select::quest, compact::none, backend::cuda>(c, {}, sub_page)),
                    Catch::Contains("block_tokens"));
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
}
