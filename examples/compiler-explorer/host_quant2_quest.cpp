// SPDX-License-Identifier: Apache-2.0
// kvmosaic in Compiler Explorer, 1 of 3: a compressed KV cache on the CPU, run in the browser.
//
//   Language:  C++
//   Compiler:  x86-64 gcc 12.2 (or newer)
//   Flags:     -std=c++17 -O2
//   Libraries: Eigen 3.4.0
//   Output:    Output... > Execute the code (the table appears in the Output pane)
//   Header:    the #include below; replace OWNER/REPO with kvmosaic's GitHub path
//              (README.md, "Try it in Compiler Explorer")
//
// One attention layer (2 KV heads, 4 query heads each, head_dim 128, pages of 64 tokens) holds
// 4096 tokens of synthetic K and V with the statistics the compression papers rely on (outlier
// key channels, attention sinks, heavy hitters). Four caches of the same tokens attend the same
// query; each output is compared with fp64 exact attention over the unrounded data:
//   dense / all     bf16 pages, every token read: the baseline (bf16 rounding only);
//   quant2 / all    HACK's 2-bit codes (partitions of 64, nearest rounding, 4 sink tokens kept
//                   16-bit), every token read;
//   dense / quest   bf16 pages; Quest ranks blocks of 16 tokens by their key bounds and reads
//                   the best 1/8 of the context, plus the open tail;
//   quant2 / quest  both.
// Try: another budget (quest.budget.ratio), whole-page blocks (quest.block_tokens = 0), HACK's
// own settings (quant2.mode = kvmosaic::format::rounding::stochastic; quant2.sink_tokens = 0),
// or a partition of 32 or 128.
#include <https://raw.githubusercontent.com/OWNER/REPO/main/single_include/kvmosaic/kvmosaic.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

constexpr int tokens = 4096, kv_heads = 2, group = 4, head_dim = 128;
constexpr int q_heads = kv_heads * group;

// Builds one cache, prefills the sequence, attends one query, and prints a row of the table.
template <class Format, class Selector>
void row(const char* name, const Format& format, const Selector& selector, const kvmosaic::synthetic::kv_data& kv,
         const std::vector<float>& q, const std::vector<double>& exact) {
  kvmosaic::cache_config config;
  config.num_kv_heads = kv_heads;
  config.group_size = group;
  config.head_dim = head_dim;
  config.max_pages = tokens / 64;
  kvmosaic::cache<Format, Selector> cache(config, format, selector);

  const kvmosaic::sequence_id seq = cache.add_sequence();
  cache.prefill(seq, kvmosaic::tensor_view<const float, 3>(kv.k.data(), tokens, kv_heads, head_dim),
                kvmosaic::tensor_view<const float, 3>(kv.v.data(), tokens, kv_heads, head_dim));

  std::vector<float> out(q.size());
  cache.attend(kvmosaic::span<const kvmosaic::sequence_id>(&seq, 1),
               kvmosaic::tensor_view<const float, 3>(q.data(), 1, q_heads, head_dim),
               kvmosaic::tensor_view<float, 3>(out.data(), 1, q_heads, head_dim));

  double read = tokens;  // tokens attended per KV head
  if constexpr (!kvmosaic::selector_traits<Selector>::reads_all_pages)
    read = cache.selection(seq).tokens_read;
  const kvmosaic::memory_stats m = cache.sequence_memory(seq);
  const kvmosaic::host::fidelity f = kvmosaic::host::compare(out.data(), exact.data(), exact.size());
  std::printf("%-15s %12.1f %12.4f %8.3f %14.3e %10.5f\n", name, m.bytes_per_token(),
              m.compression_ratio(), read / tokens, f.rel_l2_error, f.cosine);
}

}  // namespace

int main() {
  // Synthetic K and V ([token][kv_head][channel]) of sequence 0, and the query of the next
  // position ([q_head][channel]).
  kvmosaic::synthetic::kv_config generator;
  generator.num_kv_heads = kv_heads;
  generator.group_size = group;
  generator.head_dim = head_dim;
  const kvmosaic::synthetic::kv_data kv = kvmosaic::synthetic::generate_kv(generator, 0, tokens);
  const std::vector<float> q = kvmosaic::synthetic::generate_query(generator, 0, tokens);

  // The reference: fp64 softmax(q k^T / sqrt(d)) v over every token, unrounded.
  const std::vector<double> exact = kvmosaic::host::exact_attention(
      kvmosaic::tensor_view<const float, 2>(q.data(), q_heads, head_dim),
      kvmosaic::tensor_view<const float, 3>(kv.k.data(), tokens, kv_heads, head_dim),
      kvmosaic::tensor_view<const float, 3>(kv.v.data(), tokens, kv_heads, head_dim),
      1.0 / std::sqrt(static_cast<double>(head_dim)));

  kvmosaic::format::quant2 quant2;  // 2 bits per element; defaults: partitions of 64, nearest
                                    // rounding, the first 4 tokens kept 16-bit too
  kvmosaic::select::quest quest;    // key min/max per block of 16 tokens, best blocks read
  quest.budget.ratio = 1.0 / 8;     // tokens read per KV head, besides the tail

  std::printf("kvmosaic %s: %d tokens, %d KV heads x %d query heads, head_dim %d, pages of 64\n",
              kvmosaic::version_string(), tokens, kv_heads, group, head_dim);
  std::printf("%-15s %12s %12s %8s %14s %10s\n", "format/select", "bytes/token", "compression",
              "read", "rel L2 error", "cosine");
  row("dense/all", kvmosaic::format::dense{}, kvmosaic::select::all{}, kv, q, exact);
  row("quant2/all", quant2, kvmosaic::select::all{}, kv, q, exact);
  row("dense/quest", kvmosaic::format::dense{}, quest, kv, q, exact);
  row("quant2/quest", quant2, quest, kv, q, exact);
  // compression: stored bytes over the same tokens as bf16 K and V (quest's bounds included);
  // read: tokens attended over tokens stored. Quest keeps every token and reads fewer: it saves
  // bandwidth per step, not memory.
  return 0;
}
