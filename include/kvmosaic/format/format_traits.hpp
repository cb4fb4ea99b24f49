// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a storage format is, and what it must provide.
///
/// A format is a small policy struct in `kvmosaic::format` (e.g. `format::dense`) that carries its
/// own parameters (a sparsity, a partition size) and declares `using policy_category = format_tag;`. Everything the library does with a format goes
/// through `kvmosaic::format_traits<Format>`, which a format specializes. The unspecialized primary
/// template is a `static_assert`, so using a type that is not a format fails with one sentence.
///
/// A specialization provides (see `format/dense.hpp` for the reference implementation):
///
///   static constexpr const char* name;                  // "dense", "bitmap_tiles", ...
///   static std::string describe(const Format&);         // name plus parameters, for reports
///   static void validate(const Format&, const page_shape&);  // throws kvmosaic::invalid_argument
///   // Exact byte accounting: bytes of one page (page_size tokens) of one KV head, everything
///   // counted (values, bitmaps, offsets, scales, sums, padding).
///   static std::size_t k_page_bytes(const Format&, const page_shape&);
///   static std::size_t v_page_bytes(const Format&, const page_shape&);
///   // Host reference, rows are float values already rounded to the storage dtype, [n][head_dim]:
///   static void encode_k(const Format&, const page_shape&, const float* rows, std::byte* page);
///   static void encode_v(const Format&, const page_shape&, const float* rows, std::byte* page);
///   static void decode_k(const Format&, const page_shape&, const std::byte* page, int n, float* rows);
///   static void decode_v(const Format&, const page_shape&, const std::byte* page, int n, float* rows);
///   // Host attend primitives on the stored form, for the first n tokens of a page and the G query
///   // heads of one KV head (q already multiplied by the softmax scale):
///   static void score(const Format&, const page_shape&, const std::byte* k_page, int n,
///                     const float* q /*[G][D]*/, int G, float* logits /*[G][n]*/);
///   static void accumulate(const Format&, const page_shape&, const std::byte* v_page, int n,
///                          const float* p /*[G][n]*/, int G, float* o /*[G][D], += */);
///
/// Optional: a format whose K pruning can weigh channels (output-aware scores) declares
///   static constexpr bool has_key_weights = true;
///   static void encode_k(const Format&, const page_shape&, const float* rows, const float* weights
///                        /*[head_dim] or null*/, std::byte* page);
/// and `cache::set_key_weights` becomes available for it.
///
/// Optional: a format whose pages are stored in a basis of their own segment (a run of
/// `segment_pages` pages of one sequence; format::packed_bitmap) declares
///   static constexpr bool has_segments = true;
///   using segment = ...;  // what one KV head's pages of a segment share (bases, strategy)
///   static int segment_pages(const Format&, const page_shape&);
///   static int basis_dim(const Format&, const page_shape&);      // channels of the segment space
///   static std::size_t segment_bytes(const Format&, const page_shape&);  // per segment, KV head
///   static segment plan_segment(const Format&, const page_shape&, const float* k, const float* v,
///                               std::int64_t n);                 // fit to a segment's rows
///   static void enter_segment(const Format&, const page_shape&, const segment&, const float* q,
///                             int G, float* q_basis /*[G][basis_dim]*/);
///   static void leave_segment(const Format&, const page_shape&, const segment&,
///                             const float* o_basis /*[G][basis_dim]*/, int G, float* o /*[G][D]*/);
/// and takes `const segment&` after the shape in encode_k/v, decode_k/v, score and accumulate,
/// whose queries and outputs are in the segment's space. The host engine keeps the segments per
/// sequence (planned when a segment's first page is sealed, from the rows it has of that segment),
/// folds each segment's pages into a state of its own and merges it back after `leave_segment`.
///
/// A format with segments may plan them from sums of their rows in one order that every backend
/// follows (so that a device can compute the sums and the host only the rest), declaring
///   static std::size_t segment_sum_count(const Format&, const page_shape&);  // doubles a segment
///   static constexpr int segment_sum_tile_rows;    // rows a tile's sums run over from zero
///   static void segment_sums(const Format&, const page_shape&, const float* k, const float* v,
///                            std::int64_t n, double* out);  // the tiles' sums added in order
///   static bool plan_reads_rows(const Format&);     // the plan needs the rows besides their sums
///   static segment plan_segment_from_sums(const Format&, const page_shape&, const double* sums,
///                                         std::int64_t n, const float* k, const float* v);
/// and the device part computes the sums itself (cuda/format/device_format.cuh).
///
/// Optional, for a format with segments: block keys in the format's own compressed space (the
/// mean key of a block of tokens, which `select::mean_keys` scores; MosaicKV's per-block keys,
/// channel-compressed with the keys) declares
///   static constexpr bool has_block_keys = true;
///   static std::size_t block_key_bytes(const Format&, const page_shape&);   // one block, KV head
///   static int block_key_values(const Format&, const page_shape&);          // N, the pairs it holds
///   static void encode_block_key(const Format&, const page_shape&, const segment&,
///                                const float* mean /*[D], fp32*/, std::byte* key);
///   static void block_key_query(const Format&, const page_shape&, const segment&, const float* q,
///                               int G, float* q_key /*[G][basis_dim]*/);
///   static float score_block_key(const Format&, const page_shape&, const float* q_key /*[basis_dim]*/,
///                                const std::byte* key);
/// in one fp32 order that every backend follows; the engines then keep those instead of 16-bit
/// dense mean rows. A block key is N (channel, value) pairs of the segment's rotated space laid
/// out as `block_key_layout` says, and scored as q'[channel] x value summed over the pairs in
/// their stored order by fused multiply-adds from 0: one thread's chain, the order the CUDA
/// engine's generic scoring kernel follows (`score_block_keys_kernel`, a thread per key).
///
/// Encoding always sees complete pages (page_size tokens): partial pages stay in the dense tail.
/// The CUDA parts (device encode, block-level attend collectives) are specialized in
/// `kvmosaic/cuda/` on the same tag.

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"

namespace kvmosaic {

/// Geometry of one page of one KV head: what every format's byte accounting depends on.
struct page_shape {
  int page_size = 64;       ///< tokens per page
  int head_dim = 128;       ///< channels per head
  dtype storage = dtype::bf16;  ///< 16-bit element type of uncompressed values
};

template <class Format>
struct format_traits {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this type is not a storage format: use one of kvmosaic::format::dense, or "
                "specialize kvmosaic::format_traits<YourFormat> as described in "
                "kvmosaic/format/format_traits.hpp");
};

namespace detail {
/// format_traits<Format>::has_key_weights, false when a format does not declare it.
template <class Traits, class = void>
struct key_weights_of {
  static constexpr bool value = false;
};
template <class Traits>
struct key_weights_of<Traits, std::void_t<decltype(Traits::has_key_weights)>> {
  static constexpr bool value = Traits::has_key_weights;
};

/// format_traits<Format>::has_segments, false when a format does not declare it.
template <class Traits, class = void>
struct segments_of {
  static constexpr bool value = false;
};
template <class Traits>
struct segments_of<Traits, std::void_t<decltype(Traits::has_segments)>> {
  static constexpr bool value = Traits::has_segments;
};
}  // namespace detail

/// True when a format stores its pages in per-segment bases (`format_traits::has_segments`).
template <class Format>
inline constexpr bool has_segments_v = detail::segments_of<format_traits<Format>>::value;

namespace detail {
/// format_traits<Format>::segment_sum_count exists (a format with segments whose plan is made
/// of sums a device may compute: `plan_segment_from_sums`).
template <class Traits, class = void>
struct segment_sums_of : std::false_type {};
template <class Traits>
struct segment_sums_of<Traits, std::void_t<decltype(&Traits::segment_sum_count)>> : std::true_type {};
}  // namespace detail

/// True when a format with segments plans them from sums of their rows that a device may compute
/// (`format_traits::segment_sums`, `plan_segment_from_sums`).
template <class Format>
inline constexpr bool has_segment_sums_v = has_segments_v<Format> && detail::segment_sums_of<format_traits<Format>>::value;

namespace detail {
/// format_traits<Format>::segment_search_sum_count exists (a format whose plan reads rows, from
/// sums of them a device may compute: `search_segment_from_sums`).
template <class Traits, class = void>
struct segment_search_sums_of : std::false_type {};
template <class Traits>
struct segment_search_sums_of<Traits, std::void_t<decltype(&Traits::segment_search_sum_count)>> : std::true_type {};
}  // namespace detail

/// True when a format planned from sums (`has_segment_sums_v`) makes the part of its plan that
/// reads rows from other sums of them that a device may compute (`format_traits::
/// segment_search_sum_count`, `search_segment_from_sums`).
template <class Format>
inline constexpr bool has_segment_search_sums_v = has_segment_sums_v<Format> && detail::segment_search_sums_of<format_traits<Format>>::value;

namespace detail {
/// The segment type of a format with segments; an empty struct for the others.
struct no_segment {};
template <class Format, bool = has_segments_v<Format>>
struct segment_type {
  using type = no_segment;
};
template <class Format>
struct segment_type<Format, true> {
  using type = typename format_traits<Format>::segment;
};
}  // namespace detail

namespace detail {
/// format_traits<Format>::has_block_keys, false when a format does not declare it.
template <class Traits, class = void>
struct block_keys_of {
  static constexpr bool value = false;
};
template <class Traits>
struct block_keys_of<Traits, std::void_t<decltype(Traits::has_block_keys)>> {
  static constexpr bool value = Traits::has_block_keys;
};
}  // namespace detail

/// Where a block key's parts lie (formats with `has_block_keys`): its N 8-bit channel indices
/// from byte 0, padded to 16 bytes, then its N values in the storage dtype, padded to 16 bytes,
/// so that both parts are 16-byte aligned and a reader loads 8 pairs by two vector loads.
struct block_key_layout {
  int values;  ///< N, the (channel, value) pairs
  KVMOSAIC_HOST_DEVICE constexpr int values_offset() const noexcept { return (values + 15) / 16 * 16; }
  KVMOSAIC_HOST_DEVICE constexpr int bytes() const noexcept { return values_offset() + (2 * values + 15) / 16 * 16; }
};

/// True when a format keeps the mean key of a block in its own compressed space
/// (`format_traits::has_block_keys`).
template <class Format>
inline constexpr bool has_block_keys_v = detail::block_keys_of<format_traits<Format>>::value;

/// True when a format prunes K with per-channel weights (`cache::set_key_weights`).
template <class Format>
inline constexpr bool has_key_weights_v = detail::key_weights_of<format_traits<Format>>::value;

namespace detail {
/// Whether a compaction that moves a token into another page compresses it again (the page is
/// re-encoded, which can change stored values: counted as `compaction_report::pages_reencoded`).
/// False for formats whose pages hold each token's record as it is (format::dense,
/// format::bitmap_tiles); a format says so by specializing this to false.
template <class Format>
struct reencodes_moved_rows : std::true_type {};
template <class Format>
inline constexpr bool reencodes_moved_rows_v = reencodes_moved_rows<Format>::value;

/// How a compaction encodes the pages it writes, on both backends: `format`, the format it
/// encodes moved rows with (the cache's own unless its encoder has a mode that suits
/// already-decoded rows better); `key_weights`, whether a format with K weights prunes them with
/// the sequence's weights (else by plain magnitudes); and `limit`, the passes that may re-encode
/// one page of a format that `reencodes_moved_rows` (the cache leaves alone every page up to the
/// last one that reached it). A format states its own by specializing this (format::quant2:
/// nearest rounding, `max_reencodes`; format::bitmap_tiles: plain magnitudes).
template <class Format>
struct reencoding {
  static Format format(const Format& f) { return f; }
  static constexpr bool key_weights = true;
  static int limit(const Format&) noexcept { return 255; }
};

/// format_traits<Format>::sink_rows(format), 0 when a format does not declare it.
template <class Format, class = void>
struct sink_rows_of {
  static int get(const Format&) { return 0; }
};
template <class Format>
struct sink_rows_of<Format, std::void_t<decltype(format_traits<Format>::sink_rows(std::declval<const Format&>()))>> {
  static int get(const Format& f) { return format_traits<Format>::sink_rows(f); }
};
/// format_traits<Format>::window_rows(format), 0 when a format does not declare it.
template <class Format, class = void>
struct window_rows_of {
  static int get(const Format&) { return 0; }
};
template <class Format>
struct window_rows_of<Format, std::void_t<decltype(format_traits<Format>::window_rows(std::declval<const Format&>()))>> {
  static int get(const Format& f) { return format_traits<Format>::window_rows(f); }
};

/// Whether a format's encoder must not see the sink rows (their copies in the first page are
/// replaced by the first row after them before encoding): true for a format whose records span
/// several tokens, where one sink's large values would stretch its neighbours' ranges
/// (format::quant2's partitions). False by default: a per-token record of a sink is masked and
/// harms nobody.
template <class Format>
struct hides_sink_rows : std::false_type {};
template <class Format>
inline constexpr bool hides_sink_rows_v = hides_sink_rows<Format>::value;
}  // namespace detail

/// Most sink tokens a format keeps exact (`sink_tokens` of every built-in format).
inline constexpr int max_sink_tokens = 16;
/// Most recent-window tokens a format keeps exact (`recent_tokens` of every built-in format).
inline constexpr int max_recent_tokens = 1024;

/// The leading tokens of every sequence a format keeps as exact 16-bit rows besides its pages
/// (attention sinks, `sink_tokens`): copied into the sequence's tail slot when its first page is
/// sealed, masked out of that page, and always attended.
template <class Format>
int sink_rows(const Format& format) {
  return detail::sink_rows_of<Format>::get(format);
}

/// The most recent sealed tokens a format keeps as exact 16-bit rows besides its pages (the
/// recent window, `recent_tokens`, the dense tail not counted): a ring of that many rows in the
/// sequence's tail slot, written as pages are sealed; their page copies are masked.
template <class Format>
int window_rows(const Format& format) {
  return detail::window_rows_of<Format>::get(format);
}

/// Every exact row a sequence's tail slot can hold besides its tail: sinks plus the window.
template <class Format>
int exact_rows(const Format& format) {
  return sink_rows(format) + window_rows(format);
}

namespace detail {
/// Checks a format's `sink_tokens` and `recent_tokens` (throws `invalid_argument` naming them).
inline void validate_exact_tokens(const char* where, int sink_tokens, int recent_tokens) {
  require(sink_tokens >= 0 && sink_tokens <= max_sink_tokens, where, "sink_tokens", sink_tokens, "0 to 16");
  require(recent_tokens >= 0 && recent_tokens <= max_recent_tokens, where, "recent_tokens", recent_tokens, "0 to 1024");
}
/// ", sinks S, recent W" for a format's `describe` (empty for zeros).
inline std::string describe_exact_tokens(int sink_tokens, int recent_tokens) {
  std::string text;
  if (sink_tokens > 0) text += ",sinks" + std::to_string(sink_tokens);
  if (recent_tokens > 0) text += ",recent" + std::to_string(recent_tokens);
  return text;
}
}  // namespace detail

}  // namespace kvmosaic
