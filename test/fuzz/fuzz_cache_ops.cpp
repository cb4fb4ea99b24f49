// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the fuzzer's bytes are decoded into a small host cache (any format and
// selector, head_dim 64, 1-2 KV heads, small pools) and a sequence of operations on it (add,
// prefill and chunked prefill, append, attend, fork, remove, set_budget, invalid calls), run
// through fuzz/cache_ops_harness.hpp: every operation against the shadow model (gauge, pages,
// reference counts, lengths), every output against the one-shot-prefilled cache (bitwise) and
// finite, dense outputs also against the fp64 oracle. Rejected calls must throw a kvmosaic::error and change nothing. Anything
// else aborts: a harness failure (its message names the operations), another exception, a crash
// or a sanitizer finding. Token values come from a generator seeded by the input, scaled by
// 2^-6 to 2^6 (finite, within every storage dtype's range).
//
// Caches that evict (select::all with compact::repack or compact::hole_fill, every format) also
// take evict (a whole page, a random share of the live sealed tokens, one position that may be
// invalid, a list with a position twice, a removed sequence) and compact (one sequence or all),
// checked by the harness against its model of slots and compaction passes; their quant2 takes
// max_reencodes 1, 0, 2 or 255 from the shape byte's bits 5-6.
//
// Input layout: byte 0 picks the cache type (0-8: every format and selector with compact::none,
// as before caches that evict were added, so the committed corpus keeps its meaning; 9-14, then
// modulo 15: the caches that evict), bytes 1-5 the configuration, then one operation per group of
// 4 bytes (kind, two parameters, a seed byte), at most 64 operations.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <type_traits>
#include <vector>

#include "fuzz/cache_ops_harness.hpp"
#include "kvmosaic/kvmosaic.hpp"

using namespace kvmosaic;

namespace {

/// Reads bytes from the input, then zeros once it is exhausted.
struct byte_reader {
  const std::uint8_t* data;
  std::size_t size, at = 0;
  std::uint8_t next() { return at < size ? data[at++] : 0; }
  bool done() const { return at >= size; }
};

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Rows of n tokens: values uniform in [-2, 2) times 2^scale_exp, ids in 0..15 (1-3 boundaries).
test::ops::rows make_rows(std::uint64_t seed, std::int64_t n, std::size_t row, int scale_exp) {
  test::ops::rows r;
  r.n = n;
  const float scale = std::ldexp(1.0f, scale_exp);
  std::uint64_t state = mix(seed);
  const auto uniform = [&] {
    state = mix(state);
    return (static_cast<float>(state >> 40) * (1.0f / 16777216.0f) * 4.0f - 2.0f) * scale;
  };
  for (std::int64_t t = 0; t < n; ++t)
    for (std::size_t x = 0; x < row; ++x) {
      r.k.push_back(uniform());
      r.v.push_back(uniform());
    }
  for (std::int64_t t = 0; t < n; ++t) {
    state = mix(state);
    r.ids.push_back(static_cast<std::int32_t>(state % 16));
  }
  return r;
}

select::token_budget budget_of(std::uint8_t b) {
  select::token_budget budget;
  if (b & 1)
    budget.tokens = (b >> 1) % 4 == 3 ? 100000 : (b >> 1) % 64;
  else
    budget.ratio = static_cast<double>((b >> 1) % 9) / 8.0;
  return budget;
}

format::dense format_of(byte_reader&, format::dense*) { return {}; }
format::bitmap_tiles format_of(byte_reader& in, format::bitmap_tiles*) {
  const std::uint8_t b = in.next();
  format::bitmap_tiles f;
  f.s_k = static_cast<float>(b % 4) * 0.25f;
  f.s_v = static_cast<float>((b >> 2) % 4) * 0.25f;
  f.k_layout = (b >> 4) & 1 ? format::bitmap_k_layout::along_tokens : format::bitmap_k_layout::along_channels;
  return f;
}
format::quant2 format_of(byte_reader& in, format::quant2*) {
  const std::uint8_t b = in.next();
  format::quant2 f;
  f.partition = 32;
  f.mode = b & 1 ? format::rounding::nearest : format::rounding::stochastic;
  f.k_axis = (b >> 1) & 1 ? format::key_axis::head_dim : format::key_axis::tokens;
  f.sink_tokens = (b >> 2) % 3 == 2 ? 4 : 0;
  f.seed = b >> 4;
  return f;
}
int page_of(std::uint8_t b, format::dense*) { return b & 1 ? 32 : 16; }
int page_of(std::uint8_t, format::bitmap_tiles*) { return 64; }
int page_of(std::uint8_t b, format::quant2*) { return b & 1 ? 64 : 32; }

select::all selector_of(byte_reader&, int, select::all*) { return {}; }
select::quest selector_of(byte_reader& in, int page, select::quest*) {
  const std::uint8_t b = in.next();
  select::quest s;
  s.budget = budget_of(in.next());
  const int blocks[] = {0, 8, 16, 0};
  s.block_tokens = blocks[b % 4] > page ? 0 : blocks[b % 4];
  s.combine = (b >> 2) & 1 ? group_combine::sum : group_combine::max;
  return s;
}
select::sentence_chunks selector_of(byte_reader& in, int, select::sentence_chunks*) {
  const std::uint8_t b = in.next();
  select::sentence_chunks s;
  s.budget = budget_of(in.next());
  s.target_length = 1 + b % 12;
  s.window = 1 + (b >> 4) % 6;
  s.combine = (b >> 3) & 1 ? group_combine::sum : group_combine::max;
  s.boundaries = {{1, 1.0f}, {2, 0.5f}, {3, 0.0f}};
  return s;
}

/// The positions an evict operation names for sequence `s` (parameter byte `b`, seed byte `x`).
std::vector<std::int64_t> eviction_list(const test::ops::shadow_model::sequence& s, int page, int sinks, std::uint8_t b,
                                        std::uint8_t x, std::uint64_t seed) {
  std::vector<std::int64_t> out;
  switch (b % 4) {
    case 0: {  // every live token of one page
      const std::size_t pages = s.slots.size() / static_cast<std::size_t>(page);
      if (pages == 0) break;
      const std::size_t pg = x % pages;
      for (int t = 0; t < page; ++t) {
        const std::int64_t p = s.slots[pg * static_cast<std::size_t>(page) + static_cast<std::size_t>(t)];
        if (p >= sinks) out.push_back(p);
      }
      break;
    }
    case 1:  // a random share of the live sealed tokens (1/8 to 7/8)
    case 3: {  // the same, with its first position listed twice
      const std::uint64_t share = 1 + (b >> 2) % 7;
      for (std::int64_t p = sinks; p < s.sealed; ++p)
        if (!s.evicted[static_cast<std::size_t>(p)] && mix(seed ^ static_cast<std::uint64_t>(p)) % 8 < share) out.push_back(p);
      if (b % 4 == 3 && !out.empty()) out.push_back(out.front());
      break;
    }
    default:  // one position in [-1, length]: below, in the sealed tokens, the open tail, or beyond
      out.push_back(static_cast<std::int64_t>(x) % (s.length() + 2) - 1);
  }
  return out;
}

template <class F, class S, class C = compact::none>
void run(byte_reader& in) {
  using Cache = cache<F, S, C>;
  constexpr bool evicts = compactor_traits<C>::frees_memory;
  cache_config c;
  const std::uint8_t shape = in.next(), pool = in.next();
  c.num_kv_heads = 1 + (shape & 1);
  c.group_size = 1 << ((shape >> 1) % 3);
  c.head_dim = 64;
  c.page_size = page_of(shape >> 3, static_cast<F*>(nullptr));
  c.storage = (shape >> 4) & 1 ? dtype::f16 : dtype::bf16;
  c.max_pages = 1 + pool % 12;
  c.max_sequences = 1 + (pool >> 4) % 4;
  F f = format_of(in, static_cast<F*>(nullptr));
  if constexpr (evicts && std::is_same<F, format::quant2>::value) {  // the shape byte's free bits
    const int limits[] = {1, 0, 2, 255};
    f.max_reencodes = limits[(shape >> 5) % 4];
  }
  const S s = selector_of(in, c.page_size, static_cast<S*>(nullptr));
  // The fp64 oracle costs most with the pruning and decoding references; the fuzzer keeps it for
  // dense (and the one-shot reference for every format), the [random] test runs it everywhere.
  test::ops::check_options options;
  options.oracle = std::is_same<F, format::dense>::value;
  test::ops::harness<Cache> h(c, f, s, options);
  const int P = c.page_size;
  const std::size_t row = h.row();
  const auto live = [&] { return h.model().live().size(); };
  for (int op = 0; op < 64 && !in.done(); ++op) {
    const std::uint8_t raw_kind = in.next(), a = in.next(), b = in.next(), seed_byte = in.next();
    const int kind = evicts ? raw_kind % 12 : raw_kind % 10;  // 10: evict, 11: compact
    const std::uint64_t seed = (static_cast<std::uint64_t>(op) << 8) | seed_byte;
    const int scale_exp = static_cast<int>(seed_byte % 13) - 6;
    if (live() == 0 || kind == 0) {
      h.add_sequence();
      continue;
    }
    const std::size_t i = a % live();
    switch (kind) {
      case 1:
      case 2: {  // prefill; into a non-empty sequence, a chunk of a chunked prefill
        const std::int64_t sizes[] = {1, P - 1, P, P + 1, 2 * P + 3, 1 + b % (3 * P)};
        h.prefill(i, make_rows(seed, sizes[b % 6], row, scale_exp));
        break;
      }
      case 3: {  // append to a run of distinct sequences starting at i
        std::vector<std::size_t> which;
        for (std::size_t x = 0; x < 1 + b % live(); ++x) which.push_back((i + x) % live());
        h.append(which, make_rows(seed, static_cast<std::int64_t>(which.size()), row, scale_exp));
        break;
      }
      case 4:
      case 5: {  // attend over a run of distinct sequences
        std::vector<std::size_t> which;
        for (std::size_t x = 0; x < 1 + b % live(); ++x) which.push_back((i + x) % live());
        const test::ops::rows q = make_rows(seed ^ 0x5151, static_cast<std::int64_t>(which.size()) * c.group_size, row,
                                            scale_exp / 2);
        h.attend(which, q.k);
        break;
      }
      case 6: h.fork(i); break;
      case 7: h.remove(i); break;
      case 10:
        if constexpr (evicts) {
          if (b % 16 == 15 && !h.model().removed().empty()) {
            h.evict_stale(a % h.model().removed().size());
            break;
          }
          h.evict(i, eviction_list(h.model().live()[i], P, sink_rows(f), b, seed_byte, seed));
        }
        break;
      case 11:
        if constexpr (evicts) {
          if (b & 1)
            h.compact_all();
          else
            h.compact(i);
        }
        break;
      case 8: {
        select::token_budget budget = budget_of(b);
        if (a % 8 == 7) budget.ratio = 1.5;  // invalid
        h.set_budget(budget);
        break;
      }
      default:
        switch (b % 3) {
          case 0: h.append_duplicate(i, make_rows(seed, 2, row, scale_exp)); break;
          case 1: h.prefill_empty(i); break;
          default:
            if (!h.model().removed().empty())
              h.use_stale_id(a % h.model().removed().size(), make_rows(seed, 1 + b % (P + 1), row, scale_exp));
        }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  byte_reader in{data, size};
  try {
    const std::uint8_t type = in.next();
    switch (type < 9 ? type : type % 15) {
      case 0: run<format::dense, select::all>(in); break;
      case 1: run<format::dense, select::quest>(in); break;
      case 2: run<format::dense, select::sentence_chunks>(in); break;
      case 3: run<format::bitmap_tiles, select::all>(in); break;
      case 4: run<format::bitmap_tiles, select::quest>(in); break;
      case 5: run<format::bitmap_tiles, select::sentence_chunks>(in); break;
      case 6: run<format::quant2, select::all>(in); break;
      case 7: run<format::quant2, select::quest>(in); break;
      case 8: run<format::quant2, select::sentence_chunks>(in); break;
      case 9: run<format::dense, select::all, compact::repack>(in); break;
      case 10: run<format::dense, select::all, compact::hole_fill>(in); break;
      case 11: run<format::bitmap_tiles, select::all, compact::repack>(in); break;
      case 12: run<format::bitmap_tiles, select::all, compact::hole_fill>(in); break;
      case 13: run<format::quant2, select::all, compact::repack>(in); break;
      default: run<format::quant2, select::all, compact::hole_fill>(in); break;
    }
  } catch (const test::ops::failure& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::abort();
  }
  return 0;
}
