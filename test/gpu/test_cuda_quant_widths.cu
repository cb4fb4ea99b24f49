// SPDX-License-Identifier: Apache-2.0
// format::quant4 and V partitioned per token (format::quant<Bits, value_axis::head_dim>) on the
// CUDA backend against the host backend, as test_cuda_quant2.cu checks quant2: the device encoder
// writes the host's bytes exactly, and the attention on the codes (sm_90 pipeline and the portable
// kernel) equals the host's Eq. 4 within fp32 rounding and its effect on the 8-bit p (or p') grid,
// and exact attention on the decoded values within the bound the 8-bit steps predict
// (test/support/quant_bound.hpp). The kernels are compiled for four shapes, not every one: the
// quant2 tests cover the shape dispatch, and these formats share it.

#include <algorithm>

#include "../support/quant_bound.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::gpu_available;
using test::small_config;

namespace {

using shapes = backend::cuda_for<kernel_shape<dtype::bf16, 128, 4>, kernel_shape<dtype::f16, 64, 1>,
                                 kernel_shape<dtype::bf16, 256, 8>, kernel_shape<dtype::f16, 128, 3>>;
using quant2_v_token = format::quant<2, format::value_axis::head_dim>;
using quant4_v_token = format::quant<4, format::value_axis::head_dim>;

template <class F>
F make(int partition, format::rounding mode, int sinks) {
  F f;
  f.partition = partition;
  f.mode = mode;
  f.seed = 7;
  f.sink_tokens = sinks;
  return f;
}

/// Attends on both backends; checks the GPU against the host and against exact attention on the
/// values the host's pages decode to.
template <class Twin>
void check_attention(Twin& t, bool report = false) {
  const typename Twin::step_outputs step = t.attend_both();
  const int hq = t.config.num_q_heads(), d = t.config.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::size_t per_seq = static_cast<std::size_t>(hq) * d;
  double worst_twin = 0, worst_exact = 0;  // |difference| / bound
  for (std::size_t b = 0; b < t.seqs.size(); ++b) {
    const int length = static_cast<int>(t.host.length(t.seqs[b]));
    CAPTURE(b, length);
    const auto decoded = test::quant_decoded(
        t.host, t.seqs[b], test::rounded(synthetic::generate_kv(t.generator, t.streams[b], length), t.config.storage));
    const std::vector<float> qb(step.q.begin() + static_cast<std::ptrdiff_t>(b * per_seq),
                                step.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_seq));
    const auto exact = test::exact(qb, decoded, scale);
    const test::quant_bounds bounds = test::quant_attention_bounds(t.host, t.seqs[b], qb, decoded, scale);
    for (std::size_t i = 0; i < per_seq; ++i) {
      const float g = step.gpu[b * per_seq + i], h = step.host[b * per_seq + i];
      INFO("element " << i << ": gpu " << g << ", host " << h << ", exact " << exact[i]);
      REQUIRE(std::isfinite(g));  // every output written (the buffer was poisoned with NaN)
      REQUIRE(std::abs(g - h) <= bounds.vs_twin[i]);
      REQUIRE(std::abs(g - exact[i]) <= bounds.vs_exact[i]);
      worst_twin = std::max(worst_twin, std::abs(g - h) / bounds.vs_twin[i]);
      worst_exact = std::max(worst_exact, std::abs(g - exact[i]) / bounds.vs_exact[i]);
    }
  }
  if (report) WARN("largest fraction of the bound used: gpu vs host " << worst_twin << ", gpu vs exact " << worst_exact);
}

}  // namespace

TEMPLATE_TEST_CASE("GPU quant4 and V per token: device encode writes the host's bytes, attention on codes equals the host's",
                   "[gpu][quant]", format::quant4, quant2_v_token, quant4_v_token) {
  if (!gpu_available()) return;
  struct shape {
    int head_dim, group;
    dtype storage;
  };
  const shape s = GENERATE(shape{128, 4, dtype::bf16}, shape{64, 1, dtype::f16}, shape{256, 8, dtype::bf16},
                           shape{128, 3, dtype::f16});
  const int partition = GENERATE(32, 64, 128);
  if (partition > s.head_dim) return;
  const auto mode = GENERATE(format::rounding::stochastic, format::rounding::nearest);
  const int page_size = partition == 128 ? 128 : GENERATE(64, 128);
  const bool portable = GENERATE(false, true);
  CAPTURE(s.head_dim, s.group, to_string(s.storage), partition, mode == format::rounding::stochastic, page_size, portable);
  test::twin<TestType, select::all, shapes> t(small_config(s.head_dim, s.group, s.storage, page_size), 13,
                                              make<TestType>(partition, mode, 0));
  if (portable) t.device.engine().use_portable_kernel();
  // Lengths in the tail only, ending mid-partition, at page boundaries, and several pages.
  for (int length : {1, 7, partition + 5, page_size - 1, page_size, page_size + 1, 3 * page_size + 3, 700})
    t.add(length, t.seqs.size());
  t.check_storage();
  check_attention(t);
  for (int step = 0; step < 3; ++step) t.append_step();  // completes pages from the tail
  t.check_storage();
  check_attention(t);
}

TEMPLATE_TEST_CASE("GPU quant4 and V per token with sink tokens and a recent window, batch 16, long sequences",
                   "[gpu][quant][sinks]", format::quant4, quant4_v_token) {
  if (!gpu_available()) return;
  const bool portable = GENERATE(false, true);
  const int recent = GENERATE(0, 48);  // sinks alone: the kernel masks them; with a window: row masks
  CAPTURE(portable, recent);
  cache_config c = small_config(128, 4, dtype::bf16, 64);
  c.max_sequences = 16;
  c.max_pages = 16 * 70;
  TestType f = make<TestType>(64, format::rounding::nearest, 4);
  f.recent_tokens = recent;
  test::twin<TestType, select::all, shapes> t(c, 21, f);
  if (portable) t.device.engine().use_portable_kernel();
  for (int b = 0; b < 16; ++b) t.add(1 + (b * 293) % 4000, static_cast<std::uint64_t>(b));
  t.check_storage();
  check_attention(t, /*report=*/true);
  for (int step = 0; step < 65; ++step) t.append_step();  // every sequence seals a page
  t.check_storage();
  check_attention(t, /*report=*/true);
}
