// SPDX-License-Identifier: Apache-2.0
#pragma once
// format::packed_bitmap's GPU test helper: one record written by the device encoder against the
// host encoder's record of the same row, within the bounds their fp32 rotations and 16-bit
// roundings allow.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <vector>

#include "../support/packed_bound.hpp"
#include "kvmosaic/kvmosaic.hpp"

namespace kvmosaic::test {

/// Record r of the host's page bytes `hp` and of the device's `dp`, both encoding row x (d
/// values) in the basis `basis` ([d][kept]) with strategy `st`: the same groups unless the fp64
/// energies of the groups that differ tie within twice the error either backend's fp32 energies
/// may have, and the values of the groups both keep within 2 gamma_D sum_c |x_c B_cj| (each
/// backend's fp32 product against the exact one) plus one 16-bit step. `x_step`: the backends
/// encoded rows that may each differ from x by that relative step per channel (rows decoded by
/// each backend and rounded to 16 bits, for a compaction), which moves y_j by up to
/// x_step sum_c |x_c B_cj| more. Returns whether the groups differ.
inline bool check_record(const float* x, int d, const std::vector<float>& basis, const kvmosaic::detail::packed_strategy& st,
                         const kvmosaic::detail::packed_geometry& g, const std::byte* hp, const std::byte* dp, int r,
                         dtype storage, double x_step = 0.0) {
  // One 16-bit step: relative for normal numbers, the subnormal spacing below them.
  const double step = storage == dtype::bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
  const double spacing = storage == dtype::bf16 ? std::ldexp(1.0, -133) : std::ldexp(1.0, -24);
  std::vector<int> host_groups, device_groups;
  for (int j = 0; j < g.kept / st.group; ++j) {
    if ((g.bitmap(hp, r)[j / 32] >> (j % 32)) & 1u) host_groups.push_back(j);
    if ((g.bitmap(dp, r)[j / 32] >> (j % 32)) & 1u) device_groups.push_back(j);
  }
  REQUIRE(static_cast<int>(device_groups.size()) == st.retained / st.group);
  std::vector<float> hv(static_cast<std::size_t>(st.retained)), dv(hv.size());
  kvmosaic::detail::load_dense_rows(storage, hp + g.values_offset(r), hv.size(), hv.data());
  kvmosaic::detail::load_dense_rows(storage, dp + g.values_offset(r), dv.size(), dv.data());
  // sum_c |x_c B_cj|: what both y_j errors scale with.
  const auto magnitude = [&](int j) {
    double m = 0;
    for (int c = 0; c < d; ++c) m += std::abs(static_cast<double>(x[c]) * basis[static_cast<std::size_t>(c) * g.kept + j]);
    return m;
  };
  if (host_groups != device_groups) {
    const std::vector<double> y = test::rotate(x, basis, d, g.kept);
    const auto energy = [&](int j) {
      double e = 0;
      for (int c = 0; c < st.group; ++c) e += y[static_cast<std::size_t>(j * st.group + c)] * y[static_cast<std::size_t>(j * st.group + c)];
      return e;
    };
    // How far either backend's fp32 energy of group j may be from the exact one: each y_i within
    // delta_i = (gamma_D + x_step) sum_c |x_c B_ci| of it, then the sum of g squares.
    const auto energy_error = [&](int j) {
      double e = 0;
      for (int i = j * st.group; i < (j + 1) * st.group; ++i) {
        const double delta = (test::gamma(d) + x_step) * magnitude(i);
        e += 2 * std::abs(y[static_cast<std::size_t>(i)]) * delta + delta * delta +
             test::gamma(st.group + 1) * y[static_cast<std::size_t>(i)] * y[static_cast<std::size_t>(i)];
      }
      return e;
    };
    std::vector<int> only_host, only_device;
    std::set_difference(host_groups.begin(), host_groups.end(), device_groups.begin(), device_groups.end(), std::back_inserter(only_host));
    std::set_difference(device_groups.begin(), device_groups.end(), host_groups.begin(), host_groups.end(), std::back_inserter(only_device));
    for (const int a : only_host)
      for (const int c : only_device) REQUIRE(std::abs(energy(a) - energy(c)) <= 2 * (energy_error(a) + energy_error(c)));
    return true;
  }
  for (std::size_t v = 0; v < hv.size(); ++v) {
    // Each backend's fp32 y_j is within (gamma_D + x_step) sum_c |x_c B_cj| of the exact one;
    // then each rounds to 16 bits.
    const int j = host_groups[v / static_cast<std::size_t>(st.group)] * st.group + static_cast<int>(v) % st.group;
    INFO("value " << v << ": host " << hv[v] << ", device " << dv[v]);
    REQUIRE(std::abs(hv[v] - dv[v]) <= (2 * test::gamma(d) + 2 * x_step) * magnitude(j) + step * std::max(std::abs(hv[v]), std::abs(dv[v])) + spacing);
  }
  return false;
}

}  // namespace kvmosaic::test
