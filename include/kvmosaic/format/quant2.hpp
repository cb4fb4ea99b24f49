// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::quant2`: HACK's asymmetric 2-bit quantization with attention computed on the codes
/// (Zhang et al., "HACK: Homomorphic Acceleration via Compression of the Key-Value Cache for
/// Disaggregated LLM Inference", sections 5.2-5.3 and 6). Host part: encode, decode, and the host
/// attend on codes (the reference the CUDA kernels will be tested against).
///
/// Quantization: each partition of `partition` (Pi) elements keeps a min m and a scale
/// s >= (max - m) / 3 (both 16-bit floats, as the paper stores them, in the cache's storage dtype:
/// f16 or bf16, so any value the cache stores has a representable range) and codes c in {0..3}
/// with x ~ m + s c. m is the partition's min rounded toward -infinity and s the smallest
/// storage value with m + 3 s >= max (evaluated in fp64): every value lies in [m, m + 3 s], and
/// the codes are computed against the stored m and s (`quant2_range`). K is partitioned along
/// head_dim for each token, V along tokens for each channel (each product's inner dimension,
/// Fig. 7). Rounding is stochastic (to floor(t) + 1 with
/// probability frac(t), t = (x - m) / s, unbiased) or to nearest. The stochastic noise is a
/// counter-based hash of (seed, the element's index in its page, its value, its partition's m and
/// s): a pure function of the data, so the host and the device draw the same codes with no
/// stream of positions, and different seeds give independent roundings.
///
/// Summation elimination (5.3): each partition stores its code sum, so no step re-sums the cache.
/// Requantization elimination (5.3): V partitions run along tokens, and the newest ones stay
/// 16-bit until complete. Here the dense tail plays that part: a page is encoded when it is full,
/// and page_size must be a multiple of Pi, so a sealed page holds whole V partitions. (The paper
/// keeps at most Pi - 1 tokens unquantized; we keep up to page_size - 1.) Optional sink tokens
/// stay 16-bit (`sink_tokens`; not in the paper: our addition, for StreamingLLM's attention sinks).
///
/// Attention on codes (Eq. 4): for a partition of an inner product sum_k (m_a + s_a a_k)
/// (m_b + s_b b_k) = Pi m_a m_b + m_a s_b sum(b) + s_a m_b sum(a) + s_a s_b sum(a b): q is
/// quantized to 8 bits per partition of Pi channels (round to nearest, min and scale in fp32:
/// q is transient), the softmax numerators p to 8 bits per partition of Pi tokens, and only the
/// integer products sum(a b) touch the codes; sum(b) comes from the page.
///
/// Non-finite values and NaN: a partition holding a NaN or an infinity (only a NaN or infinite
/// input stores one: finite inputs saturate, core/dtype.hpp) stores NaN as its min and scale and
/// code 0 for every element. The outputs that read it (a K partition: every query head of its KV
/// head; a V partition: its channel of those heads), and those of a query head with a NaN in q,
/// are unspecified: NaN on the host backend (as dense attention's), NaN or another value on
/// CUDA (its split merge does not propagate NaN). Other heads and sequences are unaffected, and
/// every float-to-integer conversion is clamped first (NaN to code 0): no input is undefined
/// behaviour, host or device.
///
/// Page layout (one head, K or V): [mins: partitions x 16-bit][scales: partitions x 16-bit]
/// [code sums: partitions x u8 (u16 at Pi = 128)][codes: 2 bits each] padded to 16 bytes. V
/// partition c * (page_size / Pi) + j holds tokens j Pi .. of channel c; K partition the same
/// (K per channel) or t * (head_dim / Pi) + j, channels j Pi .. of token t (K per token). The
/// codes are not stored partition by partition: they form the int8 tensor-core operand the CUDA
/// kernel multiplies (K as [tokens][channels], V as [channels][tokens], in 16 x 32 tiles; see
/// `quant2_code_bit`), so a warp unpacks them with shifts and masks. At Pi = 64, head_dim 128,
/// pages of 64: 2688 bytes per page, 16.4% of dense.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"

namespace kvmosaic {
namespace format {

/// Along which axis quant2 partitions K (V is always partitioned along tokens, per channel).
enum class key_axis {
  head_dim,  ///< per token, Pi channels a partition: the paper's layout (the product's inner dimension)
  tokens,    ///< per channel, Pi tokens a partition: one range per channel, so outlier channels
             ///< do not stretch their neighbours' steps; the scales are folded into q
};

/// How quant2 rounds a value to a code.
enum class rounding {
  stochastic,  ///< up with probability frac(t): unbiased (the paper's choice)
  nearest,     ///< to the nearest code (the default: a third of the loss on a real model, docs/defaults.md)
};

/// HACK's 2-bit KV quantization with attention on the codes. Cost per page: 2 bits per element
/// plus 4-6 bytes (min, scale, code sum) per partition of `partition` elements.
struct quant2 {
  using policy_category = format_tag;
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
struct quant2_extent {
  float lo, hi;
  bool finite;

  KVMOSAIC_HOST_DEVICE explicit quant2_extent(float first) : lo(first), hi(first), finite(is_finite(first)) {}
  KVMOSAIC_HOST_DEVICE void add(float v) {
    lo = v < lo ? v : lo;
    hi = hi < v ? v : hi;
    finite = finite && is_finite(v);
  }
  KVMOSAIC_HOST_DEVICE static bool is_finite(float v) { return (float_bits(v) & 0x7fffffffu) < 0x7f800000u; }
};

/// A partition's stored min and scale: their bits in the storage dtype and their values.
struct quant2_range_bits {
  std::uint16_t min_bits, scale_bits;
  float min, scale;
};

/// The stored min and scale of a partition with extent `e`, in the 16-bit storage dtype
/// `storage`: m = lo rounded toward -infinity, s = the smallest storage value with 3 s >= hi - m
/// (compared in fp64: exact unless hi and m differ in magnitude by more than 2^40, where the
/// rounding is below 2^-52 of the range), so every value lies in [m, m + 3 s] and a range up to
/// twice the dtype's largest value is representable. lo and hi are first clamped to the dtype's
/// finite range (the cache stores values already saturated to it; a raw float beyond it gets code
/// 0 or 3). A non-finite value gives NaN for both. The codes are computed against these stored
/// values. Host and device compute it the same way (IEEE fp64 subtraction and division, no
/// contraction), so the bytes are the same.
KVMOSAIC_HOST_DEVICE inline quant2_range_bits quant2_range(const quant2_extent& e, dtype storage) {
  quant2_range_bits r{};
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
  r.scale_bits = storage_bits_up(static_cast<float>(range / 3.0), storage);
  while (3.0 * static_cast<double>(storage_value(r.scale_bits, storage)) < range)
    r.scale_bits = storage_next_up(r.scale_bits);  // at most one step: the float rounding above
  r.scale = storage_value(r.scale_bits, storage);
  return r;
}

/// The 2-bit code of v in a partition with stored min m and scale s (`quant2_range`). Stochastic:
/// up with probability frac((v - m) / s), the noise a hash of (seed, the element's index in its
/// page, v, m, s); nearest: to the nearest code. One function for host and device: no product
/// feeds a sum here, so no compiler contracts an operation and both round alike. The code is
/// clamped to 0..3 before the conversion to int; a NaN (v, m or s NaN) gives 0.
KVMOSAIC_HOST_DEVICE inline int quant2_code(bool stochastic, std::uint64_t seed, std::uint64_t element_index, float v,
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
  return c >= 3.0f ? 3 : (c > 0.0f ? static_cast<int>(c) : 0);
}

/// Bit of the code at (row, col) of a page's code matrix with `cols` columns. The matrix is
/// stored in tiles of 16 rows x 32 columns, row-major over tiles, 128 bytes a tile. Within a tile,
/// the 32-bit word of lane 4 g + q holds in byte b, bits 2 s and 2 s + 1, the code at row
/// g + 8 (s % 2), column 16 (s / 2) + 4 q + b: `(word >> 2 s) & 0x03030303` is then register s of
/// that lane's int8 A fragment of an m16n8k32 tensor-core product (PTX ISA, "mma.m16n8k32"), so
/// a warp unpacks 16 codes per lane with four shift-and-mask pairs and no shuffles.
KVMOSAIC_HOST_DEVICE constexpr std::size_t quant2_code_bit(int cols, int row, int col) {
  const int tile = row / 16 * (cols / 32) + col / 32;
  const int r = row % 16, c = col % 32;
  const int lane = r % 8 * 4 + c % 16 / 4, s = r / 8 + 2 * (c / 16);
  return static_cast<std::size_t>(tile) * 1024 + static_cast<std::size_t>(lane) * 32 + (c % 4) * 8 + s * 2;
}

/// Geometry of one quant2 page (one head, K or V): the byte layout, how partition elements map to
/// (token, channel), and how those map to the code matrix. The codes form the A operand of the
/// attention products on tensor cores: K as [tokens][channels] (S^T = K Q^T, an inner product
/// over channels), V as [channels][tokens] (O^T = V^T P^T, over tokens).
struct quant2_layout {
  int partitions;     ///< partitions in the page
  int partition;      ///< Pi
  int sum_bytes;      ///< 1 or 2
  int page_size;
  int head_dim;
  bool along_tokens;  ///< partitions run along tokens, one channel each (V, and K per channel)
  bool is_key;        ///< code matrix rows are tokens (K) rather than channels (V)
  dtype storage;      ///< the dtype of the mins and scales: the cache's storage dtype (f16 or bf16)

  std::size_t scales_at() const { return static_cast<std::size_t>(partitions) * 2; }
  std::size_t sums_at() const { return static_cast<std::size_t>(partitions) * 4; }
  std::size_t codes_at() const { return sums_at() + static_cast<std::size_t>(partitions) * sum_bytes; }
  std::size_t bytes() const {
    return (codes_at() + static_cast<std::size_t>(partitions) * partition / 4 + 15) / 16 * 16;
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
  /// Bit of the code of (token, channel), counted from codes_at().
  std::size_t code_bit(int token, int channel) const {
    return is_key ? quant2_code_bit(head_dim, token, channel) : quant2_code_bit(page_size, channel, token);
  }
};

inline quant2_layout quant2_layout_of(const format::quant2& f, const page_shape& shape, bool is_key) {
  return quant2_layout{shape.page_size * shape.head_dim / f.partition,
                       f.partition,
                       f.partition * 3 > 255 ? 2 : 1,
                       shape.page_size,
                       shape.head_dim,
                       !is_key || f.k_axis == format::key_axis::tokens,
                       is_key,
                       shape.storage};
}

/// Quantizes `count` values x[i * stride] (one partition) into `codes` (0..3) against the stored
/// min and scale (`quant2_range`, in `storage`); returns them. `key` numbers the elements within
/// the page. A partition with a non-finite value gets code 0 everywhere (and NaN min and scale).
inline quant2_range_bits quantize_partition(const format::quant2& f, dtype storage, const float* x, int count,
                                            int stride, std::uint64_t key, std::uint8_t* codes) {
  quant2_extent extent(x[0]);
  for (int i = 1; i < count; ++i) extent.add(x[static_cast<std::size_t>(i) * stride]);
  const quant2_range_bits range = quant2_range(extent, storage);
  const bool stochastic = f.mode == format::rounding::stochastic;
  for (int i = 0; i < count; ++i) {
    const float v = x[static_cast<std::size_t>(i) * stride];
    const std::uint64_t index = key + static_cast<std::uint64_t>(i);
    codes[i] = extent.finite ? static_cast<std::uint8_t>(quant2_code(stochastic, f.seed, index, v, range.min, range.scale))
                             : std::uint8_t{0};
  }
  return range;
}

/// Encodes rows [page_size][head_dim] into a K (`is_key`) or V page: each partition quantized
/// (`quantize_partition`), its min, scale and code sum stored, its codes placed in the code matrix.
inline void encode_quant2_page(const format::quant2& f, const page_shape& shape, const float* rows, bool is_key,
                               std::byte* page) {
  const quant2_layout layout = quant2_layout_of(f, shape, is_key);
  const int d = shape.head_dim, pi = f.partition;
  std::memset(page, 0, layout.bytes());
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(pi));
  for (int part = 0; part < layout.partitions; ++part) {
    int token = 0, channel = 0;
    layout.element(part, 0, token, channel);
    const float* first = rows + static_cast<std::size_t>(token) * d + channel;
    const int stride = layout.along_tokens ? d : 1;
    const quant2_range_bits range =
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
struct quant2_page_view {
  quant2_layout layout;
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
    return (static_cast<int>(page[layout.codes_at() + bit / 8]) >> (bit % 8)) & 3;
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
    std::fill(a, a + count, 0);
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

/// K partitioned along tokens: the code sums the channel dimension needs (Eq. 4 runs over
/// channels), per token and group of Pi channels, replace the per-partition sums (same count,
/// same width): sums[t * (head_dim / Pi) + p] = sum of the codes of token t, channels p Pi ...
inline void store_token_code_sums(const format::quant2& f, const page_shape& shape, std::byte* page) {
  const quant2_layout layout = quant2_layout_of(f, shape, /*is_key=*/true);
  const quant2_page_view view{layout, page};
  const int d = shape.head_dim, pi = f.partition;
  std::vector<unsigned> sums(static_cast<std::size_t>(layout.partitions), 0u);
  for (int c = 0; c < d; ++c)
    for (int t = 0; t < shape.page_size; ++t)
      sums[static_cast<std::size_t>(t * (d / pi) + c / pi)] += static_cast<unsigned>(view.code_at(t, c));
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
/// `quant2_code_bit`. Each 32-bit word of a tile holds, in its byte b, four codes of one row
/// (one per bit pair s), so one shift and mask gives four adjacent codes of a row. Cost: one
/// load, four shifts and four 4-byte stores per 16 codes; no allocation.
inline void quant2_unpack_codes(const quant2_layout& layout, const std::byte* page, std::uint8_t* out) {
  const int rows = layout.is_key ? layout.page_size : layout.head_dim;
  const int cols = layout.is_key ? layout.head_dim : layout.page_size;
  const int tiles_per_row = cols / 32, tiles = rows / 16 * tiles_per_row;
  const std::byte* codes = page + layout.codes_at();
  for (int tile = 0; tile < tiles; ++tile) {
    const int r0 = tile / tiles_per_row * 16, c0 = tile % tiles_per_row * 32;
    for (int lane = 0; lane < 32; ++lane) {
      std::uint32_t word;
      std::memcpy(&word, codes + static_cast<std::size_t>(tile) * 128 + static_cast<std::size_t>(lane) * 4, 4);
      const int g = lane / 4, q = lane % 4;
      for (int s = 0; s < 4; ++s) {
        const std::uint32_t four = (word >> (2 * s)) & 0x03030303u;  // bytes b = 0..3: columns 4 q + b
        std::memcpy(out + static_cast<std::size_t>(r0 + g + 8 * (s % 2)) * cols + c0 + 16 * (s / 2) + 4 * q, &four, 4);
      }
    }
  }
}

/// sum_i a[i] b[i] over `count` bytes: the integer dot product of Eq. 4 (8-bit q or p codes
/// times 2-bit codes; at most 255 x 3 x 256, exact in int). Written for the vectorizer.
inline int byte_dot(const std::uint8_t* a, const std::uint8_t* b, int count) noexcept {
  int dot = 0;
  for (int i = 0; i < count; ++i) dot += static_cast<int>(a[i]) * static_cast<int>(b[i]);
  return dot;
}

/// Per-thread working memory of the host attend on codes, reused across pages and calls (no
/// allocation once it has grown to a page's size).
struct quant2_host_scratch {
  std::vector<std::uint8_t> codes;  ///< the page's code matrix (`quant2_unpack_codes`)
  std::vector<float> mins, scales;  ///< every partition's stored min and scale, as floats
  std::vector<int> a;               ///< 8-bit codes of q, q' or p, as quantize8 writes them
  std::vector<std::uint8_t> a8;     ///< the same as bytes, for `byte_dot`
  std::vector<float> folded, m_a, s_a;
  std::vector<unsigned> sum_a;

  /// Unpacks the codes, mins and scales of `page`.
  void load(const quant2_page_view& view) {
    const quant2_layout& l = view.layout;
    codes.resize(static_cast<std::size_t>(l.page_size) * l.head_dim);
    quant2_unpack_codes(l, view.page, codes.data());
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

inline quant2_host_scratch& quant2_scratch() {
  thread_local quant2_host_scratch scratch;
  return scratch;
}

}  // namespace detail

template <>
struct format_traits<format::quant2> {
  static constexpr const char* name = "quant2";

  static std::string describe(const format::quant2& f) {
    std::string text = "quant2(pi" + std::to_string(f.partition) + "," +
                       (f.mode == format::rounding::stochastic ? "stochastic" : "nearest") +
                       (f.k_axis == format::key_axis::tokens ? ",k/channel" : ",k/token") +
                       detail::describe_exact_tokens(f.sink_tokens, f.recent_tokens);
    if (f.max_reencodes != 1) text += ",reencodes" + std::to_string(f.max_reencodes);
    return text + ")";
  }

  static void validate(const format::quant2& f, const page_shape& shape) {
    const char* where = "format::quant2";
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
  static int sink_rows(const format::quant2& f) { return f.sink_tokens; }
  static int window_rows(const format::quant2& f) { return f.recent_tokens; }

  static std::size_t k_page_bytes(const format::quant2& f, const page_shape& shape) {
    return detail::quant2_layout_of(f, shape, true).bytes();
  }
  static std::size_t v_page_bytes(const format::quant2& f, const page_shape& shape) { return k_page_bytes(f, shape); }

  static void encode_k(const format::quant2& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant2_page(f, shape, rows, /*is_key=*/true, page);
    if (f.k_axis == format::key_axis::tokens) detail::store_token_code_sums(f, shape, page);
  }
  static void encode_v(const format::quant2& f, const page_shape& shape, const float* rows, std::byte* page) {
    detail::encode_quant2_page(f, shape, rows, /*is_key=*/false, page);
  }
  static void decode_k(const format::quant2& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/true, rows);
  }
  static void decode_v(const format::quant2& f, const page_shape& shape, const std::byte* page, int n, float* rows) {
    decode(f, shape, page, n, /*is_key=*/false, rows);
  }

  /// logits[g][t] = q[g] . k[t] on the codes (Eq. 4): q quantized to 8 bits per partition, one
  /// integer dot product per (token, partition) plus the correction terms. The page's codes are
  /// unpacked once for all G query heads. Cost: page_size x head_dim code unpacks, n G D integer
  /// multiply-adds, 4 n G D / Pi floating-point operations; no allocation.
  static void score(const format::quant2& f, const page_shape& shape, const std::byte* k_page, int n, const float* q,
                    int groups, float* logits) {
    if (f.k_axis == format::key_axis::tokens) {
      score_channel_partitioned(f, shape, k_page, n, q, groups, logits);
      return;
    }
    const detail::quant2_page_view view{detail::quant2_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_token = d / pi;
    detail::quant2_host_scratch& s = detail::quant2_scratch();
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
  /// tokens. Pages are full (n = page_size): tails are dense. The page's codes are unpacked once
  /// for all G query heads. Cost as `score`.
  static void accumulate(const format::quant2& f, const page_shape& shape, const std::byte* v_page, int n,
                         const float* p, int groups, float* o) {
    const detail::quant2_page_view view{detail::quant2_layout_of(f, shape, false), v_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi;
    detail::require(n == shape.page_size, "format::quant2 accumulate", "n", n, "page_size (sealed pages are full)");
    detail::quant2_host_scratch& s = detail::quant2_scratch();
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
  static void score_channel_partitioned(const format::quant2& f, const page_shape& shape, const std::byte* k_page, int n,
                                        const float* q, int groups, float* logits) {
    const detail::quant2_page_view view{detail::quant2_layout_of(f, shape, true), k_page};
    const int d = shape.head_dim, pi = f.partition, per_channel = shape.page_size / pi, groups_of_channels = d / pi;
    detail::quant2_host_scratch& s = detail::quant2_scratch();
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

  /// Dequantizes the first n tokens: x = m + s c for every element, from the unpacked codes.
  static void decode(const format::quant2& f, const page_shape& shape, const std::byte* page, int n, bool is_key,
                     float* rows) {
    const detail::quant2_page_view view{detail::quant2_layout_of(f, shape, is_key), page};
    const detail::quant2_layout& layout = view.layout;
    const int d = shape.head_dim, p = shape.page_size;
    detail::quant2_host_scratch& s = detail::quant2_scratch();
    s.load(view);
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) {
        // the partition of (t, c) (`quant2_layout::element`'s inverse) and the code matrix entry
        const int part = layout.along_tokens ? c * (p / f.partition) + t / f.partition : t * (d / f.partition) + c / f.partition;
        const int code = s.codes[is_key ? static_cast<std::size_t>(t) * d + c : static_cast<std::size_t>(c) * p + t];
        rows[static_cast<std::size_t>(t) * d + c] =
            s.mins[static_cast<std::size_t>(part)] + s.scales[static_cast<std::size_t>(part)] * static_cast<float>(code);
      }
  }
};

namespace detail {
/// A compaction re-encodes quant2 pages from their dequantized rows with nearest rounding whatever
/// the cache's mode (values already on a partition's grid keep their codes when the partition's
/// members are unchanged; a changed partition gains at most half a step of its new grid per
/// element), at most `max_reencodes` times per page (docs/eviction.md, "quant2 and re-encoding").
template <>
struct reencoding<format::quant2> {
  static format::quant2 format(const format::quant2& f) {
    format::quant2 nearest = f;
    nearest.mode = format::rounding::nearest;
    return nearest;
  }
  static int limit(const format::quant2& f) noexcept { return f.max_reencodes; }
};
/// quant2's first page is encoded with its sinks replaced by the first row after them: a sink's
/// large values would stretch the range of every partition it falls in.
template <>
struct hides_sink_rows<format::quant2> : std::true_type {};
}  // namespace detail

}  // namespace kvmosaic
