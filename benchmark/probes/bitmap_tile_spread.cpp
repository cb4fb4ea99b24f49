// SPDX-License-Identifier: Apache-2.0
//
// Probe (host only, not part of the build): how long a warp's bitmap_tiles K expansion runs in
// each K layout, on the synthetic generator's K (which has outlier channels, as models' K does).
// A warp of the sm_90 kernel expands 32 tiles, one per lane, and runs as long as its fullest:
// the paper's layout gives it 32 channel tiles (one channel, 64 tokens), K along channels 32 row
// tiles (16 tokens x 2 halves of 128 channels). Prints the mean kept count per tile and the mean
// per-warp fullest tile, per page of 64 tokens.
//
//   g++ -std=c++17 -O2 -Iinclude -isystem /usr/include/eigen3 benchmark/probes/bitmap_tile_spread.cpp && ./a.out
//
// Output (2026-11-22): benchmark/results/h100-2026-11-22h/bitmap_tile_spread.txt.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

int main() {
  constexpr int head_dim = 128, page = 64, pages = 64, tokens = page * pages;
  for (const float sparsity : {0.5f, 0.7f}) {
    synthetic::kv_config cfg;
    cfg.num_kv_heads = 1;
    cfg.head_dim = head_dim;
    const auto kv = synthetic::generate_kv(cfg, 11, tokens);
    const int keep = detail::kept_per_vector(sparsity, head_dim);
    std::vector<unsigned char> kept(static_cast<std::size_t>(tokens) * head_dim, 0);
    std::vector<int> index;
    for (int t = 0; t < tokens; ++t) {
      detail::largest_magnitudes(kv.k.data() + static_cast<std::size_t>(t) * head_dim, head_dim, keep, index);
      for (const int c : index) kept[static_cast<std::size_t>(t) * head_dim + c] = 1;
    }
    const auto at = [&](int p, int t, int c) { return kept[static_cast<std::size_t>(p * page + t) * head_dim + c]; };
    double mean = 0, channel_tiles = 0, row_tiles = 0;
    for (int p = 0; p < pages; ++p)
      for (int warp = 0; warp < 4; ++warp) {
        int fullest_channel = 0, fullest_row = 0;
        for (int c = 32 * warp; c < 32 * warp + 32; ++c) {  // channel tiles: one channel, 64 tokens
          int n = 0;
          for (int t = 0; t < page; ++t) n += at(p, t, c);
          fullest_channel = std::max(fullest_channel, n);
          mean += n;
        }
        for (int t = 16 * warp; t < 16 * warp + 16; ++t)  // row tiles: one token, 64 channels
          for (int half = 0; half < 2; ++half) {
            int n = 0;
            for (int c = 64 * half; c < 64 * half + 64; ++c) n += at(p, t, c);
            fullest_row = std::max(fullest_row, n);
          }
        channel_tiles += fullest_channel;
        row_tiles += fullest_row;
      }
    std::printf("s = %.1f (keep %d of %d): mean kept per tile %.1f; per-warp fullest tile: channel tiles (paper) %.1f, row tiles (K along channels) %.1f\n",
                sparsity, keep, head_dim, mean / (pages * head_dim), channel_tiles / (pages * 4), row_tiles / (pages * 4));
  }
  return 0;
}
