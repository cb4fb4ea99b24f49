// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::quant<Bits, ValueAxis>` (`quant2`, `quant4`): HACK's asymmetric quantization with
/// attention computed on the codes (Zhang et al., "HACK: Homomorphic Acceleration via Compression
/// of the Key-Value Cache for Disaggregated LLM Inference", sections 5.2-5.3 and 6), at 2 bits
/// (the paper's width) or 4 (HACK's section 8 names wider codes as future work; KIVI's 4-bit
/// recipe is about lossless on a real model, docs/quantization.md). Host part: encode, decode,
/// and the host attend on codes (the reference the CUDA kernels are tested against).
///
/// Quantization: each partition of `partition` (Pi) elements keeps a min m and a scale
/// s >= (max - m) / L, L = 2^Bits - 1 (both 16-bit floats, as the paper stores them, in the
/// cache's storage dtype: f16 or bf16, so any value the cache stores has a representable range)
/// and codes c in {0..L} with x ~ m + s c. m is the partition's min rounded toward -infinity and
/// s the smallest storage value with m + L s >= max (evaluated in fp64): every value lies in
/// [m, m + L s], and the codes are computed against the stored m and s (`quant_range`). K is
/// partitioned per channel along tokens (`key_axis::tokens`, the default) or per token along
/// head_dim; V per channel along tokens (`value_axis::tokens`, the paper's Fig. 7: each
/// product's inner dimension) or per token along head_dim (`value_axis::head_dim`, KIVI's
/// choice). Rounding is to nearest or stochastic (to floor(t) + 1 with probability frac(t),
/// t = (x - m) / s, unbiased). The stochastic noise is a counter-based hash of (seed, the
/// element's index in its page, its value, its partition's m and s): a pure function of the
/// data, so the host and the device draw the same codes with no stream of positions, and
/// different seeds give independent roundings.
///
/// Summation elimination (5.3): each partition stores its code sum, so no step re-sums the cache.
/// Requantization elimination (5.3): V partitions run along tokens, and the newest ones stay
/// 16-bit until complete. Here the dense tail plays that part: a page is encoded when it is full,
/// and page_size must be a multiple of Pi, so a sealed page holds whole V partitions. (The paper
/// keeps at most Pi - 1 tokens unquantized; we keep up to page_size - 1.) Optional sink tokens
/// stay 16-bit (`sink_tokens`; not in the paper: our addition, for StreamingLLM's attention sinks).
///
/// Attention on codes (Eq. 4, which holds for any code width): for a partition of an inner
/// product sum_k (m_a + s_a a_k) (m_b + s_b b_k) = Pi m_a m_b + m_a s_b sum(b) + s_a m_b sum(a) +
/// s_a s_b sum(a b): q is quantized to 8 bits per partition of Pi channels (round to nearest, min
/// and scale in fp32: q is transient), the softmax numerators p to 8 bits per partition of Pi
/// tokens, and only the integer products sum(a b) touch the codes; sum(b) comes from the page.
/// Where a partition of the cache does not run along the product's inner dimension (K per
/// channel for q.k, V per token for p.v), its scales are folded into the transient operand
/// before that is quantized: q' = q s_K per channel, p' = p s_V per token and channel group, and
/// the mins contribute one term per (head, group); the page then stores the code sums along the
/// inner dimension instead (docs/quantization.md works both out).
///
/// Non-finite values and NaN: a partition holding a NaN or an infinity (only a NaN or infinite
/// input stores one: finite inputs saturate, core/dtype.hpp) stores NaN as its min and scale and
/// code 0 for every element. The outputs that read it (a K partition: every query head of its KV
/// head; a V partition: its channel (or, per token, its channel group) of those heads), and those
/// of a query head with a NaN in q, are unspecified: NaN on the host backend (as dense
/// attention's), NaN or another value on CUDA (its split merge does not propagate NaN). Other
/// heads and sequences are unaffected, and every float-to-integer conversion is clamped first (NaN
/// to code 0): no input is undefined behaviour, host or device.
///
/// Page layout (one head, K or V): [mins: partitions x 16-bit][scales: partitions x 16-bit]
/// [code sums: partitions x u8 (u16 where Pi L > 255)][codes: Bits each] padded to 16 bytes.
/// Partition c * (page_size / Pi) + j of a page partitioned along tokens holds tokens j Pi .. of
/// channel c; partition t * (head_dim / Pi) + j of one along head_dim holds channels j Pi .. of
/// token t. The codes are not stored partition by partition: they form the int8 tensor-core
/// operand the CUDA kernel multiplies (K as [tokens][channels], V as [channels][tokens], in
/// 16 x 32 tiles; see `quant_code_bit`), so a warp unpacks them with shifts and masks. At Pi = 64,
/// head_dim 128, pages of 64: 2688 bytes per page at 2 bits (16.4% of dense), 4864 at 4 (29.7%).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"

namespace kvmosaic {
namespace format {

/// Along which axis K is partitioned.
enum class key_axis {
  head_dim,  ///< per token, Pi channels a partition: the paper's layout (the product's inner dimension)
  tokens,    ///< per channel, Pi tokens a partition: one range per channel, so outlier channels
             ///< do not stretch their neighbours' steps; the scales are folded into q
};

/// Along which axis V is partitioned.
enum class value_axis {
  tokens,    ///< per channel, Pi tokens a partition: the paper's layout (the product's inner dimension)
  head_dim,  ///< per token, Pi channels a partition (KIVI's choice): one range per token, so a
             ///< token's outlier channel does not stretch other tokens' steps; the scales are
             ///< folded into p, quantized per (token partition, channel group)
};

/// How a quantized format rounds a value to a code.
enum class rounding {
  stochastic,  ///< up with probability frac(t): unbiased (the paper's choice)
  nearest,     ///< to the nearest code (the default: a third of the loss on a real model, docs/defaults.md)
};

/// HACK's KV quantization with attention on the codes, `Bits` (2 or 4) bits a code, V partitioned
/// along `ValueAxis`. Both are template parameters because they change the kernel (its unpacking
/// and its p.v product), not only the bytes: a cache compiles the kernels of its own choice only.
/// Cost per page: Bits bits per element plus 5-6 bytes (min, scale, code sum) per partition of
/// `partition` elements; at Pi = 64, 16.4% of dense at 2 bits and 29.7% at 4.
template <int Bits, value_axis ValueAxis = value_axis::tokens>
struct quant {
  static_assert(Bits == 2 || Bits == 4, "kvmosaic::format::quant<Bits>: Bits (the code width) must be 2 or 4");
  static_assert(ValueAxis == value_axis::tokens || ValueAxis == value_axis::head_dim,
                "kvmosaic::format::quant<Bits, ValueAxis>: ValueAxis must be value_axis::tokens or value_axis::head_dim");
  using policy_category = format_tag;
  static constexpr int bits = Bits;                  ///< bits a code
  static constexpr int levels = (1 << Bits) - 1;     ///< L: the largest code
  static constexpr value_axis v_axis = ValueAxis;    ///< how V is partitioned (see value_axis)

  int partition = 64;                        ///< Pi: elements per partition, 32, 64 or 128
  rounding mode = rounding::nearest;         ///< HACK rounds stochastically; see docs/defaults.md
  std::uint64_t seed = 0;                    ///< seed of the stochastic rounding
  key_axis k_axis = key_axis::tokens;        ///< how K is partitioned (see key_axis)
  /// Attention sinks kept 16-bit: the first `sink_tokens` (0 to 16) tokens of every sequence are
  /// stored as dense rows too once the sequence's first page is sealed, and attended exactly;
  /// in that page they are masked, and quantized as copies of the first token after them so that
  /// their large values do not stretch the partitions' ranges. Cost: sink_tokens dense rows per
  /// sequence. Default 4 (StreamingLLM's count; HACK keeps none): docs/defaults.md.
  int sink_tokens = 4;
  /// The recent window kept 16-bit (0 to 1024; 0: only the dense tail): the last `recent_tokens`
  /// sealed tokens of every sequence are also kept as dense rows in a ring in its tail slot and
  /// attended exactly in place of their masked page copies, so the latest page_size - 1 +
  /// recent_tokens tokens or more are exact (KIVI keeps 128, MUSTAFAR 32). Cost: recent_tokens
  /// dense rows per sequence, written when a page is sealed. Not with a compactor that frees
  /// memory (the cache rejects it), hence 0 by default; 128 is worth setting where no compactor
  /// frees memory (docs/defaults.md).
  int recent_tokens = 0;
  /// Compaction passes that may re-encode a page (0 to 255): a pass quantizes the moved rows'
  /// dequantized values again, on the grid of their new partition, which adds error each time a
  /// partition's members change. A pass leaves alone every page up to the last one re-encoded this
  /// many times (its dead rows stay masked; pages that empty entirely are still freed at once), so
  /// no token is re-encoded more than this. 0: compaction never re-encodes (memory comes back by
  /// whole pages only). Cost of more: more memory freed under scattered eviction, more error
  /// (docs/eviction.md, "quant2 and re-encoding").
  int max_reencodes = 1;
};

/// HACK's 2-bit codes, V per channel: the paper's format.
using quant2 = quant<2>;
/// 4-bit codes, V per channel.
using quant4 = quant<4>;

/// True for every `quant<Bits, ValueAxis>` (quant2, quant4, either V axis): formats whose pages
/// hold codes, compared within the 8-bit bound and re-encoded by compaction.
template <class Format>
struct is_quant : std::false_type {};
template <int Bits, value_axis ValueAxis>
struct is_quant<quant<Bits, ValueAxis>> : std::true_type {};
template <class Format>
inline constexpr bool is_quant_v = is_quant<Format>::value;

}  // namespace format

namespace detail {

/// splitmix64's finalizer: a bijective 64-bit mix (Steele et al.), the counter-based generator of
/// the stochastic rounding (host and device compute it the same way).
KVMOSAIC_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform in [0, 1) with 24 bits, from the seed and a 64-bit key.
KVMOSAIC_HOST_DEVICE inline float rounding_noise(std::uint64_t seed, std::uint64_t key) {
  return static_cast<float>(mix64(mix64(seed) ^ key) >> 40) * (1.0f / 16777216.0f);
}

/// The extent of a partition's values, added in element order: lo and hi as std::min and
/// std::max keep them (the first of equals, so the same signed zero on host and device), and
/// whether every value is finite.
struct quant_extent {
  float lo, hi;
  bool finite;

  KVMOSAIC_HOST_DEVICE explicit quant_extent(float first) : lo(first), hi(first), finite(is_finite(first)) {}
  KVMOSAIC_HOST_DEVICE void add(float v) {
    lo = v < lo ? v : lo;
    hi = hi < v ? v : hi;
    finite = finite && is_finite(v);
  }
  KVMOSAIC_HOST_DEVICE static bool is_finite(float v) { return (float_bits(v) & 0x7fffffffu) < 0x7f800000u; }
};

/// A partition's stored min and scale: their bits in the storage dtype and their values.
struct quant_range_bits {
  std::uint16_t min_bits, scale_bits;
  float min, scale;
};

/// The stored min and scale of a partition with extent `e`, in the 16-bit storage dtype
/// `storage`, for codes 0..`levels`: m = lo rounded toward -infinity, s = the smallest storage
/// value with L s >= hi - m
/// (compared in fp64: exact unless hi and m differ in magnitude by more than 2^40, where the
/// rounding is below 2^-52 of the range), so every value lies in [m, m + 3 s] and a range up to
/// twice the dtype's largest value is representable. lo and hi are first clamped to the dtype's
/// finite range (the cache stores values already saturated to it; a raw float beyond it gets code
/// 0 or L). A non-finite value gives NaN for both. The codes are computed against these stored
/// values. Host and device compute it the same way (IEEE fp64 subtraction and division, no
/// contraction), so the bytes are the same.
KVMOSAIC_HOST_DEVICE inline quant_range_bits quant_range(const quant_extent& e, dtype storage, int levels) {
  quant_range_bits r{};
  if (!e.finite) {
    r.min_bits = r.scale_bits = storage == dtype::f16 ? std::uint16_t{0x7e00u} : std::uint16_t{0x7fc0u};
    r.min = r.scale = storage_value(r.min_bits, storage);
    return r;
  }
  const float top = storage_max(storage);
  const float lo = e.lo < -top ? -top : (e.lo > top ? top : e.lo);
  const float hi = e.hi < -top ? -top : (e.hi > top ? top : e.hi);
  r.min_bits = storage_bits_down(lo, storage);
  r.min = storage_value(r.min_bits, storage);
  const double range = static_cast<double>(hi) - static_cast<double>(r.min);  // >= 0, at most 2 top
  r.scale_bits = storage_bits_up(static_cast<float>(range / levels), storage);
  while (levels * static_cast<double>(storage_value(r.scale_bits, storage)) < range)
    r.scale_bits = storage_next_up(r.scale_bits);  // at most one step: the float rounding above
  r.scale = storage_value(r.scale_bits, storage);
  return r;
}

/// The code (0..`levels`) of v in a partition with stored min m and scale s (`quant_range`). Stochastic:
/// up with probability frac((v - m) / s), the noise a hash of (seed, the element's index in its
/// page, v, m, s); nearest: to the nearest code. One function for host and device: no product
/// feeds a sum here, so no compiler contracts an operation and both round alike. The code is
/// clamped to 0..L before the conversion to int; a NaN (v, m or s NaN) gives 0.
KVMOSAIC_HOST_DEVICE inline int quant_code(int levels, bool stochastic, std::uint64_t seed, std::uint64_t element_index, float v,
                                            float m, float s) {
  const float t = s > 0.0f ? (v - m) / s : 0.0f;
  float c;
  if (!stochastic) {
    c = floorf(t + 0.5f);
  } else {
    const std::uint64_t range_key =
        mix64((static_cast<std::uint64_t>(detail::float_bits(m)) << 32) | detail::float_bits(s));
    const std::uint64_t key = element_index ^ (static_cast<std::uint64_t>(detail::float_bits(v)) << 32) ^ range_key;
    const float below = floorf(t);
    c = below + (rounding_noise(seed, key) < t - below ? 1.0f : 0.0f);
  }
  return c >= static_cast<float>(levels) ? levels : (c > 0.0f ? static_cast<int>(c) : 0);
}

/// Bit of the code at (row, col) of a page's code matrix with `cols` columns, `bits` (2 or 4)
/// bits a code. The matrix is stored in tiles of 16 rows x 32 columns, row-major over tiles,
/// 64 bits bytes a tile. Register s (0..3) of lane 4 g + q's int8 A fragment of an m16n8k32
/// tensor-core product (PTX ISA, "mma.m16n8k32") holds in its byte b the code at row g + 8 (s % 2),
/// column 16 (s / 2) + 4 q + b. A lane's bits / 2 words are adjacent; a word packs 8 / bits
/// registers, register s in word s / (8 / bits) at bits (s % (8 / bits)) bits of every byte, so
/// `(word >> bits i) & mask` (mask 0x03030303 or 0x0f0f0f0f) is a register: a warp unpacks 16
/// codes per lane with four shift-and-mask pairs and no shuffles. At 2 bits a tile is one word per
/// lane.
KVMOSAIC_HOST_DEVICE constexpr std::size_t quant_code_bit(int bits, int cols, int row, int col) {
  const int tile = row / 16 * (cols / 32) + col / 32;
  const int r = row % 16, c = col % 32;
  const int lane = r % 8 * 4 + c % 16 / 4, s = r / 8 + 2 * (c / 16);
  const int per_word = 8 / bits;
  return static_cast<std::size_t>(tile) * 64 * bits * 8 + static_cast<std::size_t>(lane) * bits * 16 +
         static_cast<std::size_t>(s / per_word) * 32 + (c % 4) * 8 + static_cast<std::size_t>(s % per_word) * bits;
}

/// Geometry of one quantized page (one head, K or V): the byte layout, how partition elements map
/// to (token, channel), and how those map to the code matrix. The codes form the A operand of the
/// attention products on tensor cores: K as [tokens][channels] (S^T = K Q^T, an inner product
/// over channels), V as [channels][tokens] (O^T = V^T P^T, over tokens).
struct quant_layout {
  int partitions;     ///< partitions in the page
  int partition;      ///< Pi
  int bits;           ///< bits a code: 2 or 4
  int sum_bytes;      ///< 1 or 2: enough for Pi L
  int page_size;
  int head_dim;
  bool along_tokens;  ///< partitions run along tokens, one channel each (K and V per channel)
  bool is_key;        ///< code matrix rows are tokens (K) rather than channels (V)
  dtype storage;      ///< the dtype of the mins and scales: the cache's storage dtype (f16 or bf16)

  int levels() const { return (1 << bits) - 1; }
  std::size_t scales_at() const { return static_cast<std::size_t>(partitions) * 2; }
  std::size_t sums_at() const { return static_cast<std::size_t>(partitions) * 4; }
  std::size_t codes_at() const { return sums_at() + static_cast<std::size_t>(partitions) * sum_bytes; }
  std::size_t bytes() const {
    return (codes_at() + static_cast<std::size_t>(partitions) * partition * bits / 8 + 15) / 16 * 16;
  }
  /// Element i of partition `part`: (token, channel).
  void element(int part, int i, int& token, int& channel) const {
    if (along_tokens) {
      const int per_channel = page_size / partition;
      channel = part / per_channel;
      token = part % per_channel * partition + i;
    } else {
      const int per_token = head_dim / partition;
      token = part / per_token;
      channel = part % per_token * partition + i;
    }
  }
  /// The partition of (token, channel): `element`'s inverse.
  int partition_of(int token, int channel) const {
    return along_tokens ? channel * (page_size / partition) + token / partition
                        : token * (head_dim / partition) + channel / partition;
  }
  /// Bit of the code of (token, channel), counted from codes_at().
  std::size_t code_bit(int token, int channel) const {
    return is_key ? quant_code_bit(bits, head_dim, token, channel) : quant_code_bit(bits, page_size, channel, token);
  }
};

/// Bytes of a code sum of `partition` codes of `bits` bits: 1 while Pi L fits a byte, else 2.
KVMOSAIC_HOST_DEVICE constexpr int quant_sum_bytes(int bits, int partition) {
  return partition * ((1 << bits) - 1) > 255 ? 2 : 1;
}

template <int Bits, format::value_axis V>
quant_layout quant_layout_of(const format::quant<Bits, V>& f, const page_shape& shape, bool is_key) {
  return quant_layout{shape.page_size * shape.head_dim / f.partition,
                      f.partition,
                      Bits,
                      quant_sum_bytes(Bits, f.partition),
                      shape.page_size,
                      shape.head_dim,
                      is_key ? f.k_axis == format::key_axis::tokens : V == format::value_axis::tokens,
                      is_key,
                      shape.storage};
}

/// Quantizes `count` values x[i * stride] (one partition) into `codes` (0..L) against the stored
/// min and scale (`quant_range`, in `storage`); returns them. `key` numbers the elements within
/// the page. A partition with a non-finite value gets code 0 everywhere (and NaN min and scale).
template <int Bits, format::value_axis V>
quant_range_bits quantize_partition(const format::quant<Bits, V>& f, dtype storage, const float* x, int count, int stride,
                                    std::uint64_t key, std::uint8_t* codes) {
  constexpr int levels = format::quant<Bits, V>::levels;
  quant_extent extent(x[0]);
  for (int i = 1; i < count; ++i) extent.add(x[static_cast<std::size_t>(i) * stride]);
  const quant_range_bits range = quant_range(extent, storage, levels);
  const bool stochastic = f.mode == format::rounding::stochastic;
  for (int i = 0; i < count; ++i) {
    const float v = x[static_cast<std::size_t>(i) * stride];
    const std::uint64_t index = key + static_cast<std::uint64_t>(i);
    codes[i] = extent.finite ? static_cast<std::uint8_t>(quant_code(levels, stochastic, f.seed, index, v, range.min, range.scale))
                             : std::uint8_t{0};
  }
  return range;
}

/// Encodes rows [page_size][head_dim] into a K (`is_key`) or V page: each partition quantized
/// (`quantize_partition`), its min, scale and code sum stored, its codes placed in the code matrix.
template <int Bits, format::value_axis V>
void encode_quant_page(const format::quant<Bits, V>& f, const page_shape& shape, const float* rows, bool is_key,
                       std::byte* page) {
  const quant_layout layout = quant_layout_of(f, shape, is_key);
  const int d = shape.head_dim, pi = f.partition;
  std::memset(page, 0, layout.bytes());
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(pi));
  for (int part = 0; part < layout.partitions; ++part) {
    int token = 0, channel = 0;
    layout.element(part, 0, token, channel);
    const float* first = rows + static_cast<std::size_t>(token) * d + channel;
    const int stride = layout.along_tokens ? d : 1;
    const quant_range_bits range =
        quantize_partition(f, shape.storage, first, pi, stride, static_cast<std::uint64_t>(part) * pi, codes.data());
    std::memcpy(page + static_cast<std::size_t>(part) * 2, &range.min_bits, 2);
    std::memcpy(page + layout.scales_at() + static_cast<std::size_t>(part) * 2, &range.scale_bits, 2);
    unsigned sum = 0;
    for (int i = 0; i < pi; ++i) {
      sum += codes[static_cast<std::size_t>(i)];
      layout.element(part, i, token, channel);
      const std::size_t bit = layout.code_bit(token, channel);
      page[layout.codes_at() + bit / 8] |= static_cast<std::byte>(codes[static_cast<std::size_t>(i)] << (bit % 8));
    }
    if (layout.sum_bytes == 1) {
      page[layout.sums_at() + static_cast<std::size_t>(part)] = static_cast<std::byte>(sum);
    } else {
      const auto sum16 = static_cast<std::uint16_t>(sum);
      std::memcpy(page + layout.sums_at() + static_cast<std::size_t>(part) * 2, &sum16, 2);
    }
  }
}

/// The stored form of one page, read back: mins, scales, code sums and codes, as numbers.
struct quant_page_view {
  quant_layout layout;
  const std::byte* page;
  float min(int part) const { return load(page + static_cast<std::size_t>(part) * 2); }
  float scale(int part) const { return load(page + layout.scales_at() + static_cast<std::size_t>(part) * 2); }
  unsigned code_sum(int part) const {
    if (layout.sum_bytes == 1) return static_cast<unsigned>(page[layout.sums_at() + static_cast<std::size_t>(part)]);
    std::uint16_t sum16;
    std::memcpy(&sum16, page + layout.sums_at() + static_cast<std::size_t>(part) * 2, 2);
    return sum16;
  }
  /// The code of (token, channel).
  int code_at(int token, int channel) const {
    const std::size_t bit = layout.code_bit(token, channel);
    return (static_cast<int>(page[layout.codes_at() + bit / 8]) >> (bit % 8)) & layout.levels();
  }
  /// The code of element i of partition `part`.
  int code(int part, int i) const {
    int token = 0, channel = 0;
    layout.element(part, i, token, channel);
    return code_at(token, channel);
  }
  /// A min or scale, in the layout's storage dtype.
  float load(const std::byte* at) const {
    std::uint16_t bits;
    std::memcpy(&bits, at, 2);
    return storage_value(bits, layout.storage);
  }
};

/// The reciprocal of an 8-bit grid's step, 0 below the smallest normal float (a step of
/// subnormal softmax weights, whose reciprocal may overflow; every value then gets code 0 and the
/// error is below the step times 255, itself subnormal). The device computes the same.
inline float quantize8_inverse(float step) { return step >= 1.17549435e-38f ? 1.0f / step : 0.0f; }

/// 8-bit asymmetric quantization of a transient operand (q, or the softmax numerators), round to
/// nearest: x ~ m + s a, a in 0..255. Returns sum(a). A NaN among the values makes m and s NaN
/// (and every code 0), so what is computed from them is NaN; codes are clamped to 0..255 before
/// the conversion to int.
inline unsigned quantize8(const float* x, int count, int stride, float& m, float& s, int* a) {
  float lo = x[0], hi = x[0];
  bool nan = std::isnan(x[0]);
  for (int i = 1; i < count; ++i) {
    const float v = x[static_cast<std::size_t>(i) * stride];
    nan = nan || std::isnan(v);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  if (nan) {
    m = s = std::numeric_limits<float>::quiet_NaN();
    // An index loop, not std::fill over [a, a + count): g++ 13 cannot bound a pointer range of
    // an int count and warns (-Wstringop-overflow) where this is inlined.
    for (int i = 0; i < count; ++i) a[i] = 0;
    return 0;
  }
  m = lo;
  // A product, one reciprocal and one fused multiply-add per value, no division: what the
  // device kernels compute, rounding for rounding (fma is correctly rounded on both sides).
  s = (hi - lo) * (1.0f / 255.0f);
  const float inverse = quantize8_inverse(s);
  const float bias = std::fma(-lo, inverse, 0.5f);  // code = floor((x - lo) / s + 1/2)
  unsigned sum = 0;
  for (int i = 0; i < count; ++i) {
    const float y = std::fma(x[static_cast<std::size_t>(i) * stride], inverse, bias);
    a[i] = static_cast<int>(std::floor(std::fmin(std::fmax(y, 0.0f), 255.0f)));  // NaN (inf x) -> 0
    sum += static_cast<unsigned>(a[i]);
  }
  return sum;
}

/// The code sums a product needs where the page is not partitioned along the product's inner
/// dimension, in place of the per-partition sums (same count, same width):
///  - K per channel (q.k runs over channels): sums[t * (head_dim / Pi) + p] = the codes of token
///    t, channels p Pi ..;
///  - V per token (p.v runs over tokens): sums[c * (page_size / Pi) + j] = the codes of channel c,
///    tokens j Pi ..
/// Either is the sum over the other axis's partition, indexed as that axis's partitions are.
inline void store_inner_code_sums(const quant_layout& layout, std::byte* page) {
  const quant_page_view view{layout, page};
  const int d = layout.head_dim, pi = layout.partition;
  std::vector<unsigned> sums(static_cast<std::size_t>(layout.partitions), 0u);
  for (int c = 0; c < d; ++c)
    for (int t = 0; t < layout.page_size; ++t) {
      const int index = layout.is_key ? t * (d / pi) + c / pi : c * (layout.page_size / pi) + t / pi;
      sums[static_cast<std::size_t>(index)] += static_cast<unsigned>(view.code_at(t, c));
    }
  for (int i = 0; i < layout.partitions; ++i) {
    if (layout.sum_bytes == 1) {
      page[layout.sums_at() + static_cast<std::size_t>(i)] = static_cast<std::byte>(sums[static_cast<std::size_t>(i)]);
    } else {
      const auto sum16 = static_cast<std::uint16_t>(sums[static_cast<std::size_t>(i)]);
      std::memcpy(page + layout.sums_at() + static_cast<std::size_t>(i) * 2, &sum16, 2);
    }
  }
}

/// Eq. 4 for one partition: sum_k (m_a + s_a a_k)(m_b + s_b b_k) from the integer dot sum(a b),
/// the code sums and the partition length.
inline double homomorphic_dot(int length, double m_a, double s_a, double sum_a, double m_b, double s_b, double sum_b,
                              double dot) {
  return length * m_a * m_b + m_a * s_b * sum_b + s_a * m_b * sum_a + s_a * s_b * dot;
}

/// Unpacks every code of a page into a byte matrix, row-major: K as [page_size][head_dim]
/// (tokens x channels), V as [head_dim][page_size] (channels x tokens), the code matrix of
/// `quant_code_bit`: one shift and mask of a stored word gives four adjacent codes of a row.
/// Cost: per 16 codes bits / 2 loads, four shifts and four 4-byte stores; no allocation.
inline void quant_unpack_codes(const quant_layout& layout, const std::byte* page, std::uint8_t* out) {
  const int rows = layout.is_key ? layout.page_size : layout.head_dim;
  const int cols = layout.is_key ? layout.head_dim : layout.page_size;
  const int tiles_per_row = cols / 32, tiles = rows / 16 * tiles_per_row;
  const int bits = layout.bits, per_word = 8 / bits, words = bits / 2;
  const std::uint32_t mask = bits == 2 ? 0x03030303u : 0x0f0f0f0fu;
  const std::byte* codes = page + layout.codes_at();
  for (int tile = 0; tile < tiles; ++tile) {
    const int r0 = tile / tiles_per_row * 16, c0 = tile % tiles_per_row * 32;
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, q = lane % 4;
      for (int w = 0; w < words; ++w) {
        std::uint32_t word;
        std::memcpy(&word, codes + (static_cast<std::size_t>(tile) * 32 + static_cast<std::size_t>(lane)) * words * 4 +
                               static_cast<std::size_t>(w) * 4, 4);
        for (int i = 0; i < per_word; ++i) {
          const int s = w * per_word + i;
          const std::uint32_t four = (word >> (bits * i)) & mask;  // bytes b = 0..3: columns 4 q + b
          std::memcpy(out + static_cast<std::size_t>(r0 + g + 8 * (s % 2)) * cols + c0 + 16 * (s / 2) + 4 * q, &four, 4);
        }
      }
    }
  }
}

/// sum_i a[i] b[i] over `count` bytes: the integer dot product of Eq. 4 (8-bit q or p codes
/// times 2- or 4-bit codes; at most 255 x 15 x 256, exact in int). Written for the vectorizer.
inline int byte_dot(const std::uint8_t* a, const std::uint8_t* b, int count) noexcept {
  int dot = 0;
  for (int i = 0; i < count; ++i) dot += static_cast<int>(a[i]) * static_cast<int>(b[i]);
  return dot;
}

/// Per-thread working memory of the host attend on codes, reused across pages and calls (no
/// allocation once it has grown to a page's size).
struct quant_host_scratch {
  std::vector<std::uint8_t> codes;  ///< the page's code matrix (`quant_unpack_codes`)
  std::vector<float> mins, scales;  ///< every partition's stored min and scale, as floats
  std::vector<int> a;               ///< 8-bit codes of q, q' or p, as quantize8 writes them
  std::vector<std::uint8_t> a8;     ///< the same as bytes, for `byte_dot`
  std::vector<float> folded, m_a, s_a;
  std::vector<unsigned> sum_a;

  /// Unpacks the codes, mins and scales of `page`.
  void load(const quant_page_view& view) {
    const quant_layout& l = view.layout;
    codes.resize(static_cast<std::size_t>(l.page_size) * l.head_dim);
    quant_unpack_codes(l, view.page, codes.data());
    mins.resize(static_cast<std::size_t>(l.partitions));
    scales.resize(mins.size());
    for (int part = 0; part < l.partitions; ++part) {
      mins[static_cast<std::size_t>(part)] = view.min(part);
      scales[static_cast<std::size_t>(part)] = view.scale(part);
    }
  }
  /// Sizes the 8-bit operand buffers for `count` values and `parts` partitions of them.
  void size_operands(int count, int parts) {
    a.resize(static_cast<std::size_t>(count));
    a8.resize(a.size());
    folded.resize(a.size());
    m_a.resize(static_cast<std::size_t>(parts));
    s_a.resize(m_a.size());
    sum_a.resize(m_a.size());
  }
  /// Copies a[from, from + count) into a8 (every code is 0..255).
  void to_bytes(int from, int count) {
    for (int i = from; i < from + count; ++i) a8[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(a[static_cast<std::size_t>(i)]);
  }
};

inline quant_host_scratch& quant_scratch() {
  thread_local quant_host_scratch scratch;
  return scratch;
}

}  // namespace detail

namespace detail {
/// The name a quantized format goes by in messages: format::quant2, format::quant4, and
/// format::quant<B, value_axis::head_dim> for V per token.
template <int Bits, format::value_axis V>
constexpr const char* quant_where() {
  if constexpr (V == format::value_axis::tokens) return Bits == 2 ? "format::quant2" : "format::quant4";
  else return Bits == 2 ? "format::quant<2, value_axis::head_dim>" : "format::quant<4, value_axis::head_dim>";
}
}  // namespace detail

template <int Bits, format::value_axis V>
struct format_traits<format::quant<Bits, V>> {
  using format_type = format::quant<Bits, V>;
  static constexpr const char* name = Bits == 2 ? "quant2" : "quant4";

  static std::string describe(const format_type& f) {
    std::string text = std::string(name) + "(pi" + std::to_string(f.partition) + "," +
                       (f.mode == format::rounding::stochastic ? "stochastic" : "nearest") +
                       (f.k_axis == format::key_axis::tokens ? ",k/channel" : ",k/token") +
                       (V == format::value_axis::head_dim ? ",v/token" : "") +
                       detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens);
    if (f.max_reencodes != 1) text += ",reencodes" + std::to_string(f.max_reencodes);
    return text + ")";
  }

  static void validate(const format_type& f, const page_shape& shape) {
    const char* where = detail::quant_where<Bits, V>();
    detail::require(f.partition == 32 || f.partition == 64 || f.partition == 128, where, "partition", f.partition,
                    "32, 64 or 128");
    // q.k runs over channels in groups of Pi with either key axis: K per token partitions them,
    // and K per channel quantizes q' = q s per Pi channels and keeps per-token code sums of Pi
    // channels in the partitions' sum slots (page_size x head_dim / Pi of them). So Pi divides
    // head_dim whatever k_axis is; the CUDA kernels are compiled for Pi <= head_dim alone.
    if (shape.head_dim % f.partition != 0) {
      std::string allowed;
      for (const int pi : {32, 64, 128})
        if (shape.head_dim % pi == 0) allowed += (allowed.empty() ? "" : ", ") + std::to_string(pi);
      const std::size_t last = allowed.rfind(", ");
      if (last != std::string::npos) allowed.replace(last, 2, " or ");
      allowed = (allowed.empty() ? std::string("none") : allowed) + " at head_dim = " + std::to_string(shape.head_dim) +
                " (a divisor of head_dim with either k_axis: q.k sums channels in groups of partition; K per channel "
                "stores per-token code sums of partition channels)";
      detail::require(false, where, "partition", f.partition, allowed.c_str());
    }
    detail::require(shape.page_size % f.partition == 0, where, "page_size", shape.page_size,
                    "a multiple of partition (a sealed page holds whole V partitions)");
    detail::require(shape.storage == dtype::f16 || shape.storage == dtype::bf16, where, "storage",
                    to_string(shape.storage), "f16 or bf16");
    detail::validate_exact_tokens(where, f.sink_tokens, f.recent_tokens);
    detail::require(f.max_reencodes >= 0 && f.max_reencodes <= 255, where, "max_reencodes", f.max_reencodes, "0 to 255");
    // Enumerations arrive from configuration as integers: a value outside the enumerators would
    // otherwise pick a branch silently.
    const int mode = static_cast<int>(f.mode), axis = static_cast<int>(f.k_axis);
    detail::require(f.mode == format::rounding::stochastic || f.mode == format::rounding::nearest, where, "mode", mode,
                    "rounding::stochastic (0) or rounding::nearest (1)");
    detail::require(f.k_axis == format::key_axis::head_dim || f.k_axis == format::key_axis::tokens, where, "k_axis",
                    axis, "key_axis::head_dim (0) or key_axis::tokens (1)");
  }

  /// At most this many sink tokens (StreamingLLM keeps 4); fewer than any partition.
  static constexpr int max_sink_tokens = kvmosaic::max_sink_tokens;
  static int sink_rows(const format_type& f) { return f.sink_tokens; }
  static int window_rows(const format_type& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format_type& f, const page_shape& shape) {
    return detail::quant_layout_of(f, shape, true).bytes();
  }
  static std::size_t v_page_bytes(const format_type& f, const page_shape& shape) { return k_page_bytes(f, shape); }

  static void encode_k(const format_type& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant_page(f, shape, rows, /*is_key=*/true, page);
    if (f.k_axis == format::key_axis::tokens) detail::store_inner_code_sums(detail::quant_layout_of(f, shape, true), page);
  }
  static void encode_v(const format_type& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant_page(f, shape, rows, /*is_key=*/false, page);
    if constexpr (V == format::value_axis::head_dim) detail::store_inner_code_sums(detail::quant_layout_of(f, shape, false), page);
  }
  static void decode_k(const format_type& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/true, rows);
  }
  static void decode_v(const format_type& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/false, rows);
  }

  /// logits[g][t] = q[g] . k[t] on the codes (Eq. 4): q quantized to 8 bits per partition, one
  /// integer dot product per (token, partition) plus the correction terms. The page's codes are
  /// unpacked once for all G query heads. Cost: page_size x head_dim code unpacks, n G D integer
  /// multiply-adds, 4 n G D / Pi floating-point operations; no allocation.
  static void score(const format_type& f, const page_shape& shape, const std::byte* k_page, int n, const float* q,
                    int groups, float* logits) {
    if (f.k_axis == format::key_axis::tokens) {
      score_channel_partitioned(f, shape, k_page, n, q, groups, logits);
      return;
    }
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_token = d / pi;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(d, per_token);
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per_token; ++j)
        s.sum_a[static_cast<std::size_t>(j)] = detail::quantize8(q + static_cast<std::size_t>(g) * d + j * pi, pi, 1,
                                                                 s.m_a[static_cast<std::size_t>(j)], s.s_a[static_cast<std::size_t>(j)],
                                                                 s.a.data() + static_cast<std::size_t>(j) * pi);
      s.to_bytes(0, d);
      for (int t = 0; t < n; ++t) {
        const std::uint8_t* codes = s.codes.data() + static_cast<std::size_t>(t) * d;
        double logit = 0;
        for (int j = 0; j < per_token; ++j) {
          const int part = t * per_token + j;
          const int dot = detail::byte_dot(s.a8.data() + static_cast<std::size_t>(j) * pi, codes + static_cast<std::size_t>(j) * pi, pi);
          logit += detail::homomorphic_dot(pi, s.m_a[static_cast<std::size_t>(j)], s.s_a[static_cast<std::size_t>(j)],
                                           s.sum_a[static_cast<std::size_t>(j)], s.mins[static_cast<std::size_t>(part)],
                                           s.scales[static_cast<std::size_t>(part)], view.code_sum(part), static_cast<double>(dot));
        }
        logits[static_cast<std::size_t>(g) * n + t] = static_cast<float>(logit);
      }
    }
  }

  /// o[g] += sum_t p[g][t] v[t] on the codes (Eq. 4): p quantized to 8 bits per partition of Pi
  /// tokens (V per token: p' = p s_V per partition of Pi tokens and group of Pi channels). Pages
  /// are full (n = page_size): tails are dense. The page's codes are unpacked once for all G query
  /// heads. Cost as `score` (V per token: head_dim / Pi quantizations of p per partition instead of
  /// one).
  static void accumulate(const format_type& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    if constexpr (V == format::value_axis::head_dim) {
      accumulate_token_partitioned(f, shape, v_page, n, p, groups, o);
      return;
    }
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, false), v_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi;
    detail::require(n == shape.page_size, detail::quant_where<Bits, V>(), "accumulate's n", n, "page_size (sealed pages are full)");
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(pi, 1);
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per_channel; ++j) {
        float m_p = 0, s_p = 0;
        const unsigned sum_p = detail::quantize8(p + static_cast<std::size_t>(g) * n + j * pi, pi, 1, m_p, s_p, s.a.data());
        s.to_bytes(0, pi);
        for (int c = 0; c < d; ++c) {
          const int part = c * per_channel + j;
          const int dot = detail::byte_dot(s.a8.data(), s.codes.data() + static_cast<std::size_t>(c) * n + static_cast<std::size_t>(j) * pi, pi);
          o[static_cast<std::size_t>(g) * d + c] += static_cast<float>(detail::homomorphic_dot(
              pi, m_p, s_p, sum_p, s.mins[static_cast<std::size_t>(part)], s.scales[static_cast<std::size_t>(part)],
              view.code_sum(part), static_cast<double>(dot)));
        }
      }
    }
  }

 private:
  /// score with K partitioned along tokens: for the tokens of partition j, k_tc = m_cj + s_cj b_tc,
  /// so q.k_t = sum_c q_c m_cj + sum_c (q_c s_cj) b_tc. The first term is one number per j; the
  /// scales fold into q' = q * s_j, quantized to 8 bits per group of Pi channels, and Eq. 4 runs
  /// over channels with the stored per-token code sums (no m_b term: the mins are in the first).
  static void score_channel_partitioned(const format_type& f, const page_shape& shape, const std::byte* k_page, int n,
                                        const float* q, int groups, float* logits) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi, groups_of_channels = d / pi;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(d, groups_of_channels);
    for (int g = 0; g < groups; ++g) {
      const float* q_g = q + static_cast<std::size_t>(g) * d;
      for (int j = 0; j < per_channel && j * pi < n; ++j) {
        double base = 0;
        for (int c = 0; c < d; ++c) {
          const int part = c * per_channel + j;
          base += static_cast<double>(q_g[c]) * s.mins[static_cast<std::size_t>(part)];
          s.folded[static_cast<std::size_t>(c)] = q_g[c] * s.scales[static_cast<std::size_t>(part)];
        }
        for (int p = 0; p < groups_of_channels; ++p)
          detail::quantize8(s.folded.data() + static_cast<std::size_t>(p) * pi, pi, 1, s.m_a[static_cast<std::size_t>(p)],
                            s.s_a[static_cast<std::size_t>(p)], s.a.data() + static_cast<std::size_t>(p) * pi);
        s.to_bytes(0, d);
        for (int t = j * pi; t < std::min(n, (j + 1) * pi); ++t) {
          const std::uint8_t* codes = s.codes.data() + static_cast<std::size_t>(t) * d;
          double logit = base;
          for (int p = 0; p < groups_of_channels; ++p) {
            const int dot = detail::byte_dot(s.a8.data() + static_cast<std::size_t>(p) * pi, codes + static_cast<std::size_t>(p) * pi, pi);
            logit += static_cast<double>(s.m_a[static_cast<std::size_t>(p)]) * view.code_sum(t * groups_of_channels + p) +
                     static_cast<double>(s.s_a[static_cast<std::size_t>(p)]) * static_cast<double>(dot);
          }
          logits[static_cast<std::size_t>(g) * n + t] = static_cast<float>(logit);
        }
      }
    }
  }

  /// accumulate with V partitioned along head_dim: for the channels of group j, v_tc = m_tj +
  /// s_tj b_tc, so sum_t p_t v_tc = sum_t p_t m_tj + sum_t (p_t s_tj) b_tc. The first term is one
  /// number per (head, token partition, j); the scales fold into p' = p s_j, quantized to 8 bits
  /// per partition of Pi tokens, and Eq. 4 runs over tokens with the stored per-channel code sums
  /// (no m_b term: the mins are in the first).
  static void accumulate_token_partitioned(const format_type& f, const page_shape& shape, const std::byte* v_page, int n,
                                           const float* p, int groups, float* o) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, false), v_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi, channel_groups = d / pi;
    detail::require(n == shape.page_size, detail::quant_where<Bits, V>(), "accumulate's n", n,
                    "page_size (sealed pages are full)");
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    s.size_operands(pi, 1);
    for (int g = 0; g < groups; ++g) {
      const float* p_g = p + static_cast<std::size_t>(g) * n;
      for (int j = 0; j < per_channel; ++j)
        for (int cg = 0; cg < channel_groups; ++cg) {
          double base = 0;
          for (int i = 0; i < pi; ++i) {
            const int t = j * pi + i, part = t * channel_groups + cg;
            base += static_cast<double>(p_g[t]) * s.mins[static_cast<std::size_t>(part)];
            s.folded[static_cast<std::size_t>(i)] = p_g[t] * s.scales[static_cast<std::size_t>(part)];
          }
          float m_p = 0, s_p = 0;
          detail::quantize8(s.folded.data(), pi, 1, m_p, s_p, s.a.data());
          s.to_bytes(0, pi);
          for (int c = cg * pi; c < (cg + 1) * pi; ++c) {
            const int dot = detail::byte_dot(s.a8.data(), s.codes.data() + static_cast<std::size_t>(c) * n + static_cast<std::size_t>(j) * pi, pi);
            o[static_cast<std::size_t>(g) * d + c] +=
                static_cast<float>(base + static_cast<double>(m_p) * view.code_sum(c * per_channel + j) +
                                   static_cast<double>(s_p) * static_cast<double>(dot));
          }
        }
    }
  }

  /// Dequantizes the first n tokens: x = m + s c for every element, from the unpacked codes.
  static void decode(const format_type& f, const page_shape& shape, const std::byte* page, int n, bool is_key,
                     float* rows) {
    const detail::quant_page_view view{detail::quant_layout_of(f, shape, is_key), page};
    const detail::quant_layout& layout = view.layout;
    const int d = shape.head_dim, p = shape.page_size;
    detail::quant_host_scratch& s = detail::quant_scratch();
    s.load(view);
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) {
        // the partition of (t, c) and the code matrix entry
        const int part = layout.partition_of(t, c);
        const int code = s.codes[is_key ? static_cast<std::size_t>(t) * d + c : static_cast<std::size_t>(c) * p + t];
        rows[static_cast<std::size_t>(t) * d + c] =
            s.mins[static_cast<std::size_t>(part)] + s.scales[static_cast<std::size_t>(part)] * static_cast<float>(code);
      }
  }
};

namespace detail {
/// A compaction re-encodes quantized pages from their dequantized rows with nearest rounding
/// whatever the cache's mode (values already on a partition's grid keep their codes when the
/// partition's members are unchanged; a changed partition gains at most half a step of its new
/// grid per element), at most `max_reencodes` times per page (docs/eviction.md, "quant2 and
/// re-encoding").
template <int Bits, format::value_axis V>
struct reencoding<format::quant<Bits, V>> {
  static format::quant<Bits, V> format(const format::quant<Bits, V>& f) {
    format::quant<Bits, V> nearest = f;
    nearest.mode = format::rounding::nearest;
    return nearest;
  }
  static int limit(const format::quant<Bits, V>& f) noexcept { return f.max_reencodes; }
};
/// A quantized format's first page is encoded with its sinks replaced by the first row after
/// them: a sink's large values would stretch the range of every partition it falls in.
template <int Bits, format::value_axis V>
struct hides_sink_rows<format::quant<Bits, V>> : std::true_type {};
}  // namespace detail

}  // namespace kvmosaic
