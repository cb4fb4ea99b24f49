// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Seeded, reproducible synthetic KV caches for tests, demos and benchmarks.
///
/// Real KV caches have a shape that compression methods rely on, and a generator that produces
/// i.i.d. gaussians would make every method look either perfect or useless. This generator
/// reproduces the statistics the source papers describe:
///
/// * Keys have a few *outlier channels* per head: channels whose magnitude is many times that of
///   the others and whose sign/mean is the same for every token (the KIVI observation that the
///   MUSTAFAR paper builds on when it prunes the key cache per token: magnitude pruning keeps the
///   outlier elements). The remaining channels are roughly gaussian around a small per-channel mean.
/// * Values have no outlier channels: every channel has about the same magnitude (MUSTAFAR's
///   "more uniform distribution" of the value cache), with a per-token scale that varies.
/// * Keys and queries are rotated with RoPE (GPT-NeoX layout: channel i pairs with i + D/2).
/// * Neighbouring tokens are correlated (a slowly drifting per-head "topic" plus a per-sentence
///   component), so pages and sentences are coherent units, which block and sentence selectors
///   (Quest-style pages, SentKVCompress sentence chunks) exploit.
/// * Attention is peaky, not flat: the first tokens are attention sinks, some tokens (boundary
///   tokens above all) are persistent heavy hitters, and every query retrieves a few regions of the
///   past plus its recent neighbourhood. The defaults give, with softmax scale 1/sqrt(head_dim),
///   tens to a few hundred effective tokens at 8K-32K context (see `test/unit/test_synthetic.cpp`).
/// * Token ids have sentence structure: sentences of varying length end in a boundary token
///   (period, question mark, ...) with a semantic weight S(b), the input of SentKVCompress's
///   sentence split (its Algorithm 2).
///
/// Reproducibility: every number is a pure function of (seed, sequence, token, head, channel) computed
/// with a counter-based hash (splitmix64 finalizer), never with `std::*_distribution`, whose output
/// is implementation-defined. A prefix or any window of a sequence therefore holds exactly the values
/// of the full sequence, and appending tokens one at a time sees the same data as a prefill. The bulk
/// per-element noise uses only integer arithmetic and one IEEE multiplication, so it is bitwise
/// identical everywhere; the few values that go through `std::log`/`std::cos`/`std::sin`/`std::exp`
/// (gaussians of the per-head structure, RoPE angles) can differ by an ulp between C libraries.
///
/// Host-only standard C++17.

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"

namespace kvmosaic::synthetic {

/// Shape and statistics of a synthetic KV stream. Model-like properties (which channels are outliers,
/// per-channel means and scales, sink and heavy-hitter directions, each query head's mix) depend on
/// `seed` only; the content of a sequence (tokens, topics, noise, which tokens are heavy hitters)
/// depends on `seed` and the sequence number. The defaults are tuned for head_dim 128 and give
/// realistic attention at 1K-32K context (see `generate_query` for measured entropies); queries are
/// scaled by sqrt(128 / head_dim) so that head_dim 64 and 256 give similar attention.
struct kv_config {
  /// Number of KV heads.
  int num_kv_heads = 8;
  /// Query heads per KV head (GQA group size); query head q belongs to KV head q / group_size.
  int group_size = 4;
  /// Channels per head; must be even (RoPE pairs channel i with i + head_dim / 2).
  int head_dim = 128;
  /// Root of all randomness.
  std::uint64_t seed = 0x6b766d6f73616963ULL;

  /// Key outlier channels per KV head (MUSTAFAR/KIVI: the key cache has a few channels of large,
  /// consistent magnitude). They are chosen per head as whole RoPE pairs (both channels of a pair,
  /// so RoPE keeps the magnitude in those channels) among the lower-frequency pairs; an odd count
  /// adds one channel of one more pair. 0 to head_dim.
  int outlier_channels = 4;
  /// Magnitude of the outlier channels relative to the others: their mean is about
  /// 0.75 * outlier_scale (sign fixed per channel) and their spread 0.35 * outlier_scale, against
  /// unit spread and a small mean in the other channels.
  float outlier_scale = 8.0f;
  /// RoPE base; keys and queries are rotated with angle position * rope_theta^(-2i/head_dim) on the
  /// pair (i, i + head_dim/2).
  double rope_theta = 10000.0;

  /// Attention sinks: token t < sink_tokens gets a component of per-channel RMS
  /// sink_strength / (1 + t) along the head's sink direction, which every query contains. Token 0 is
  /// the strongest sink, as in StreamingLLM-style observations.
  float sink_strength = 4.0f;
  /// Number of leading tokens that act as sinks.
  int sink_tokens = 4;
  /// Values of the sink tokens are scaled by this (sinks absorb attention but carry little content).
  float sink_value_scale = 0.25f;

  /// Heavy hitters (H2O): a token that is one gets a component along the head's heavy-hitter
  /// direction, which every query of the head contains, so it draws attention at every decode
  /// step. Its per-channel RMS is heavy_hitter_strength * (0.25 + 0.75 u), u uniform.
  float heavy_hitter_strength = 3.0f;
  /// Probability (per token and KV head) that an ordinary token is a heavy hitter.
  float heavy_hitter_rate = 1.0f / 512.0f;
  /// Probability (per token and KV head) that a boundary token (sentence end) is a heavy hitter;
  /// punctuation draws disproportionate attention in real models.
  float boundary_heavy_hitter_rate = 0.15f;

  /// Tokens between the knots of the slowly drifting per-head topic vector (linear interpolation
  /// between gaussian knots, renormalized to unit variance). Gives page-level locality.
  int topic_span = 64;
  /// Weight of the topic component in the (pre-RoPE, centred, per-channel-scaled) key.
  float topic_weight = 0.6f;
  /// Weight of the per-sentence component (constant within a sentence): sentences are coherent.
  float sentence_weight = 0.45f;
  /// Weight of the per-token noise. topic^2 + sentence^2 + noise^2 ~ 1 keeps unit channel spread.
  float noise_weight = 0.65f;
  /// Weight of the (separate) topic component in values; the rest is per-token noise.
  float value_topic_weight = 0.5f;
  /// Log-standard deviation of the per-(token, head) value scale.
  float value_token_spread = 0.25f;

  /// Retrieval targets per query head: past tokens whose (rotated, centred) key the query contains,
  /// so the query attends to them and their neighbourhood. Target 0 is shared by the query heads of
  /// a GQA group. Targets stay fixed for `query_drift` consecutive decode positions.
  int retrieval_targets = 4;
  /// Decode positions during which a query head keeps its retrieval targets.
  int query_drift = 32;
  /// Per-channel RMS of each retrieval component of the query (before the per-head mix).
  float retrieval_strength = 0.5f;
  /// Per-channel RMS of the recency component: the current position's topic and sentence, rotated
  /// to the current position, so recent tokens (same sentence, same topic) get more attention.
  float recency_strength = 1.1f;
  /// Distance scale (tokens) of the recency component: RoPE pairs turning faster than about one
  /// radian per `recency_reach` tokens are down-weighted in it, so recency covers a neighbourhood of
  /// roughly this size instead of spiking on the previous token.
  float recency_reach = 16.0f;
  /// Per-channel RMS of the sink component of the query.
  float query_sink_strength = 0.22f;
  /// Per-channel RMS of the heavy-hitter component of the query.
  float query_heavy_hitter_strength = 0.22f;
  /// Weight of the key mean (rotated to the query position) in the query: queries share the keys'
  /// outlier channels, which adds a smooth relative-position bias.
  float query_mean_weight = 0.03f;
  /// Per-channel RMS of gaussian noise in the query.
  float query_noise = 0.3f;
  /// Each query head scales each of its sink / heavy-hitter / retrieval / recency components by its
  /// own factor in [1 - head_variation, 1 + head_variation), fixed by the seed: heads differ, some
  /// leaning on sinks, others on recent or retrieved tokens.
  float head_variation = 0.15f;

  /// Vocabulary size for ordinary token ids (drawn from [100, vocab_size), small ids more often).
  /// Must exceed every boundary id (29991).
  int vocab_size = 32000;
  /// Shortest sentence in tokens, boundary token included.
  int min_sentence_len = 4;
  /// Longest sentence in tokens. Lengths are min + floor((max - min + 1) * u1 * u2), mean about
  /// min + (max - min) / 4 (~23 tokens with the defaults), skewed towards short sentences.
  int max_sentence_len = 80;
};

/// A boundary token and its semantic weight S(b) in [0, 1]: how strongly it ends a semantic unit.
/// SentKVCompress (Algorithm 2) splits at the boundary token b within +-delta of the ideal end that
/// maximizes 0.7 S(b) + 0.3 (1 - |ideal_end - b| / delta), so stronger delimiters win over closer ones.
struct boundary_token {
  /// Token id (the id of that punctuation in the 32000-token LLaMA-2 SentencePiece vocabulary).
  std::int32_t id;
  /// Semantic weight S(b).
  float weight;
};

/// The boundary tokens and their weights. SentKVCompress names periods, question marks and
/// exclamation marks as boundaries and gives per-model weights only in a figure; these weights are
/// ours: full stops strongest, then ?, !, line breaks, semicolons and colons.
inline constexpr std::array<boundary_token, 6> boundary_tokens{{
    {29889, 1.00f},  // "."
    {29973, 0.95f},  // "?"
    {29991, 0.90f},  // "!"
    {13, 0.80f},     // "\n" (<0x0A>)
    {29936, 0.60f},  // ";"
    {29901, 0.50f},  // ":"
}};

/// Comma token id: appears inside sentences, is not a boundary.
inline constexpr std::int32_t comma_token_id = 29892;

/// Whether `id` is one of `boundary_tokens`.
constexpr bool is_boundary_id(std::int32_t id) noexcept {
  for (const auto& b : boundary_tokens)
    if (b.id == id) return true;
  return false;
}

/// S(b) of token `id`: its weight in `boundary_tokens`, 0 for other tokens.
constexpr float boundary_weight(std::int32_t id) noexcept {
  for (const auto& b : boundary_tokens)
    if (b.id == id) return b.weight;
  return 0.0f;
}

/// Token ids of one sequence with sentence structure: sentences of varying length
/// (`kv_config::min_sentence_len` to `max_sentence_len`), each ending in a boundary token.
/// `is_boundary[t]` is 1 exactly where `ids[t]` is a boundary id.
struct token_stream {
  /// Token id per position.
  std::vector<std::int32_t> ids;
  /// 1 where the token ends a sentence (a boundary token), else 0.
  std::vector<std::uint8_t> is_boundary;
};

/// K and V of a window of one sequence, float, layout [token][kv_head][channel]. Tokens are indexed
/// relative to the window: local token i is sequence position `first_token + i`.
struct kv_data {
  /// Tokens in the window.
  int num_tokens = 0;
  /// KV heads.
  int num_kv_heads = 0;
  /// Channels per head.
  int head_dim = 0;
  /// Sequence position of local token 0.
  int first_token = 0;
  /// Keys (RoPE applied, unless produced by `generate_keys_pre_rope`).
  std::vector<float> k;
  /// Values.
  std::vector<float> v;

  /// Offset of (token, head, channel) in `k` and `v`.
  std::size_t index(int token, int head, int channel) const noexcept {
    return (static_cast<std::size_t>(token) * static_cast<std::size_t>(num_kv_heads) +
            static_cast<std::size_t>(head)) *
               static_cast<std::size_t>(head_dim) +
           static_cast<std::size_t>(channel);
  }
  /// Key element of local token `token`.
  float& k_at(int token, int head, int channel) noexcept { return k[index(token, head, channel)]; }
  /// Key element of local token `token`.
  float k_at(int token, int head, int channel) const noexcept { return k[index(token, head, channel)]; }
  /// Value element of local token `token`.
  float& v_at(int token, int head, int channel) noexcept { return v[index(token, head, channel)]; }
  /// Value element of local token `token`.
  float v_at(int token, int head, int channel) const noexcept { return v[index(token, head, channel)]; }
  /// The head_dim keys of (token, head), contiguous.
  float* k_row(int token, int head) noexcept { return k.data() + index(token, head, 0); }
  /// The head_dim keys of (token, head), contiguous.
  const float* k_row(int token, int head) const noexcept { return k.data() + index(token, head, 0); }
  /// The head_dim values of (token, head), contiguous.
  float* v_row(int token, int head) noexcept { return v.data() + index(token, head, 0); }
  /// The head_dim values of (token, head), contiguous.
  const float* v_row(int token, int head) const noexcept { return v.data() + index(token, head, 0); }
};

namespace detail {

/// splitmix64 increment (2^64 / golden ratio).
inline constexpr std::uint64_t golden = 0x9e3779b97f4a7c15ULL;

/// splitmix64 finalizer: a bijective 64-bit mix with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Hash of the pair (h, x); chaining it hashes a tuple (seed, stream, a, b, ...).
constexpr std::uint64_t combine(std::uint64_t h, std::uint64_t x) noexcept {
  return mix64(h ^ mix64(x + golden));
}

/// Hash of element `i` of the family keyed by `base` (the splitmix64 sequence seeded at `base`).
constexpr std::uint64_t element(std::uint64_t base, std::uint64_t i) noexcept {
  return mix64(base + (i + 1) * golden);
}

/// Independent streams of randomness, one per quantity.
enum stream : std::uint64_t {
  s_outlier = 0x5100,
  s_kmean,
  s_ksig,
  s_vmean,
  s_vsig,
  s_sink_dir,
  s_hh_dir,
  s_personality,
  s_sentence,
  s_token,
  s_ktopic,
  s_vtopic,
  s_ksentence,
  s_knoise,
  s_vnoise,
  s_vscale,
  s_heavy,
  s_target,
  s_qnoise,
};

/// Uniform double in [0, 1) from the top 53 bits of `h`: k * 2^-53, exact (no rounding anywhere).
constexpr double uniform53(std::uint64_t h) noexcept {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

/// Standard normal by Box-Muller (cosine branch) from the hash `h`; uses log/sqrt/cos.
inline double box_muller(std::uint64_t h) noexcept {
  const double u1 = 1.0 - uniform53(h);  // (0, 1], exact
  const double u2 = uniform53(mix64(h + golden));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// Cheap gaussian-like variate with mean 0 and variance ~1: the sum of the four 16-bit fields of `h`
/// (Irwin-Hall, n = 4), centred and scaled. Integer arithmetic and one multiplication, so bitwise
/// reproducible without libm; bounded by +-3.46.
constexpr double fast_normal(std::uint64_t h) noexcept {
  const std::int64_t s = static_cast<std::int64_t>((h & 0xffffu) + ((h >> 16) & 0xffffu) +
                                                   ((h >> 32) & 0xffffu) + (h >> 48));
  return static_cast<double>(s - 131070) * (1.7320508075688772 / 65536.0);
}

/// Checks `cfg` (throws `kvmosaic::invalid_argument`).
inline void validate(const kv_config& cfg, const char* where) {
  using kvmosaic::detail::require;
  require(cfg.num_kv_heads >= 1, where, "num_kv_heads", cfg.num_kv_heads, ">= 1");
  require(cfg.group_size >= 1, where, "group_size", cfg.group_size, ">= 1");
  require(cfg.head_dim >= 2 && cfg.head_dim % 2 == 0, where, "head_dim", cfg.head_dim,
          "an even number >= 2");
  require(cfg.outlier_channels >= 0 && cfg.outlier_channels <= cfg.head_dim, where,
          "outlier_channels", cfg.outlier_channels, "0 to head_dim");
  require(cfg.rope_theta > 1.0, where, "rope_theta", cfg.rope_theta, "> 1");
  require(cfg.sink_tokens >= 0, where, "sink_tokens", cfg.sink_tokens, ">= 0");
  require(cfg.topic_span >= 1, where, "topic_span", cfg.topic_span, ">= 1");
  require(cfg.retrieval_targets >= 0, where, "retrieval_targets", cfg.retrieval_targets, ">= 0");
  require(cfg.query_drift >= 1, where, "query_drift", cfg.query_drift, ">= 1");
  require(cfg.vocab_size > 29991, where, "vocab_size", cfg.vocab_size, "> 29991");
  require(cfg.min_sentence_len >= 1, where, "min_sentence_len", cfg.min_sentence_len, ">= 1");
  require(cfg.max_sentence_len >= cfg.min_sentence_len, where, "max_sentence_len",
          cfg.max_sentence_len, ">= min_sentence_len");
}

/// The seed-dependent ("model") part of the generator: per-head channel statistics and directions.
struct head_model {
  int heads = 0;                 ///< KV heads
  int dim = 0;                   ///< head_dim
  int pairs = 0;                 ///< head_dim / 2 RoPE pairs
  std::vector<double> inv_freq;  ///< [pair] RoPE angular frequency
  std::vector<double> kmu;       ///< [head][channel] key mean (large in outlier channels)
  std::vector<double> ksig;      ///< [head][channel] key spread (large in outlier channels)
  std::vector<double> vmu;       ///< [head][channel] value mean (small)
  std::vector<double> vsig;      ///< [head][channel] value spread (0.85 to 1.15)
  std::vector<double> sink_dir;  ///< [head][channel] sink direction, |x|^2 = dim
  std::vector<double> hh_dir;    ///< [head][channel] heavy-hitter direction, |x|^2 = dim
  std::vector<int> outliers;     ///< [head][i] outlier channels, ascending
  int outliers_per_head = 0;     ///< kv_config::outlier_channels
};

/// Scales `x[0, n)` so that its squared norm is n (per-element RMS 1); leaves a zero vector alone.
inline void normalize_rms(double* x, int n) noexcept {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  if (s <= 0.0) return;
  const double f = std::sqrt(static_cast<double>(n) / s);
  for (int i = 0; i < n; ++i) x[i] *= f;
}

/// Builds the model part of `cfg`.
inline head_model make_model(const kv_config& cfg) {
  head_model m;
  const int H = cfg.num_kv_heads, D = cfg.head_dim, P = D / 2;
  m.heads = H;
  m.dim = D;
  m.pairs = P;
  m.inv_freq.resize(static_cast<std::size_t>(P));
  for (int j = 0; j < P; ++j)
    m.inv_freq[static_cast<std::size_t>(j)] =
        std::pow(cfg.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
  const std::size_t HD = static_cast<std::size_t>(H) * static_cast<std::size_t>(D);
  m.kmu.assign(HD, 0.0);
  m.ksig.assign(HD, 0.0);
  m.vmu.assign(HD, 0.0);
  m.vsig.assign(HD, 0.0);
  m.sink_dir.assign(HD, 0.0);
  m.hh_dir.assign(HD, 0.0);
  m.outliers_per_head = cfg.outlier_channels;
  m.outliers.reserve(static_cast<std::size_t>(H) * static_cast<std::size_t>(cfg.outlier_channels));
  const std::uint64_t seed = cfg.seed;
  const double oscale = static_cast<double>(cfg.outlier_scale);
  std::vector<int> cand;
  std::vector<int> chosen;
  for (int h = 0; h < H; ++h) {
    const std::size_t row = static_cast<std::size_t>(h) * static_cast<std::size_t>(D);
    const std::uint64_t hk = combine(combine(seed, s_kmean), static_cast<std::uint64_t>(h));
    const std::uint64_t hs = combine(combine(seed, s_ksig), static_cast<std::uint64_t>(h));
    const std::uint64_t hvm = combine(combine(seed, s_vmean), static_cast<std::uint64_t>(h));
    const std::uint64_t hvs = combine(combine(seed, s_vsig), static_cast<std::uint64_t>(h));
    const std::uint64_t hsd = combine(combine(seed, s_sink_dir), static_cast<std::uint64_t>(h));
    const std::uint64_t hhd = combine(combine(seed, s_hh_dir), static_cast<std::uint64_t>(h));
    for (int c = 0; c < D; ++c) {
      const auto uc = static_cast<std::uint64_t>(c);
      m.kmu[row + uc] = 0.3 * box_muller(element(hk, uc));
      m.ksig[row + uc] = 0.8 + 0.4 * uniform53(element(hs, uc));
      m.vmu[row + uc] = 0.2 * box_muller(element(hvm, uc));
      m.vsig[row + uc] = 0.85 + 0.3 * uniform53(element(hvs, uc));
      m.sink_dir[row + uc] = box_muller(element(hsd, uc));
      m.hh_dir[row + uc] = box_muller(element(hhd, uc));
    }
    normalize_rms(&m.sink_dir[row], D);
    {  // make the heavy-hitter direction orthogonal to the sink direction
      double dot = 0.0;
      for (int c = 0; c < D; ++c) dot += m.hh_dir[row + static_cast<std::size_t>(c)] * m.sink_dir[row + static_cast<std::size_t>(c)];
      dot /= static_cast<double>(D);
      for (int c = 0; c < D; ++c) m.hh_dir[row + static_cast<std::size_t>(c)] -= dot * m.sink_dir[row + static_cast<std::size_t>(c)];
    }
    normalize_rms(&m.hh_dir[row], D);

    // Outlier channels: whole RoPE pairs drawn (partial Fisher-Yates) from the pairs
    // [D/4, 3D/8), i.e. the lower-frequency half but not its slowest part, so that RoPE keeps their
    // magnitude in those channels and their mean turns slowly; all pairs if that range is too small.
    const int n_out = cfg.outlier_channels;
    const int n_pairs = (n_out + 1) / 2;
    int lo = P / 2, hi = (3 * P) / 4;
    if (hi - lo < n_pairs) {
      lo = 0;
      hi = P;
    }
    cand.clear();
    for (int j = lo; j < hi; ++j) cand.push_back(j);
    const std::uint64_t ho = combine(combine(seed, s_outlier), static_cast<std::uint64_t>(h));
    chosen.clear();
    for (int i = 0; i < n_pairs; ++i) {
      const auto left = static_cast<std::uint64_t>(static_cast<int>(cand.size()) - i);
      const int pick = i + static_cast<int>(element(ho, static_cast<std::uint64_t>(i)) % left);
      std::swap(cand[static_cast<std::size_t>(i)], cand[static_cast<std::size_t>(pick)]);
      const int j = cand[static_cast<std::size_t>(i)];
      if (2 * (i + 1) <= n_out) {
        chosen.push_back(j);
        chosen.push_back(j + P);
      } else {  // odd count: one channel of the last pair
        chosen.push_back((element(ho, 1000u + static_cast<std::uint64_t>(i)) & 1u) ? j + P : j);
      }
    }
    std::sort(chosen.begin(), chosen.end());
    for (int c : chosen) {
      const auto uc = static_cast<std::uint64_t>(c);
      const std::uint64_t hc = element(ho, 2000u + uc);
      const double sign = (hc & 1u) ? 1.0 : -1.0;
      m.kmu[row + uc] = sign * 0.75 * oscale * (0.8 + 0.4 * uniform53(mix64(hc)));
      m.ksig[row + uc] = 0.35 * oscale;
      m.outliers.push_back(c);
    }
  }
  return m;
}

/// Length of sentence `s` of sequence `seq`.
inline int sentence_length(const kv_config& cfg, std::uint64_t seq, std::uint64_t s) noexcept {
  const std::uint64_t h = combine(combine(combine(cfg.seed, s_sentence), seq), s);
  const double u = uniform53(h) * uniform53(mix64(h));
  const int span = cfg.max_sentence_len - cfg.min_sentence_len + 1;
  return cfg.min_sentence_len + static_cast<int>(static_cast<double>(span) * u);
}

/// Sentence starts of one sequence, generated lazily from token 0 (sentence lengths are hashed by
/// sentence index, so walking from 0 is the only way to place a token in its sentence; it is cheap).
class sentence_map {
 public:
  sentence_map(const kv_config& cfg, std::uint64_t seq) : cfg_(&cfg), seq_(seq), starts_{0} {}

  /// Makes sure the sentence containing token `t` is known.
  void extend_to(int t) {
    while (starts_.back() <= t)
      starts_.push_back(starts_.back() +
                        sentence_length(*cfg_, seq_, static_cast<std::uint64_t>(starts_.size() - 1)));
  }
  /// Index of the sentence containing token `t` (after `extend_to(t)`).
  int sentence_of(int t) const noexcept {
    return static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), t) - starts_.begin()) -
           1;
  }
  /// First token of sentence `s` (s may be one past the last complete sentence known).
  int start(int s) const noexcept { return starts_[static_cast<std::size_t>(s)]; }

 private:
  const kv_config* cfg_;
  std::uint64_t seq_;
  std::vector<int> starts_;
};

/// Id of token `t` of sequence `seq`; `last` says whether it ends its sentence.
inline std::int32_t token_id(const kv_config& cfg, std::uint64_t seq, int t, bool last) noexcept {
  const std::uint64_t h =
      combine(combine(combine(cfg.seed, s_token), seq), static_cast<std::uint64_t>(t));
  if (last) {
    // Sentence ends: . 66%, ? 8%, ! 5%, newline 12%, ; 5%, : 4%.
    constexpr std::array<std::uint32_t, 6> cumulative{{660, 740, 790, 910, 960, 1000}};
    const auto r = static_cast<std::uint32_t>(h % 1000u);
    for (std::size_t i = 0; i < cumulative.size(); ++i)
      if (r < cumulative[i]) return boundary_tokens[i].id;
    return boundary_tokens[0].id;
  }
  if (h % 100u < 6u) return comma_token_id;
  const double u = uniform53(mix64(h));
  auto id = static_cast<std::int32_t>(100 + static_cast<int>(static_cast<double>(cfg.vocab_size - 100) *
                                                              (u * u * u)));
  if (is_boundary_id(id) || id == comma_token_id) id -= 7;  // keep ordinary ids ordinary
  return id;
}

/// Gaussian knot `knot` of the topic path of (sequence, head), written to out[0, D).
inline void topic_knot(const kv_config& cfg, std::uint64_t stream_id, std::uint64_t seq, int knot,
                       int head, double* out) noexcept {
  const std::uint64_t b = combine(combine(combine(combine(cfg.seed, stream_id), seq),
                                          static_cast<std::uint64_t>(knot)),
                                  static_cast<std::uint64_t>(head));
  for (int c = 0; c < cfg.head_dim; ++c) out[c] = box_muller(element(b, static_cast<std::uint64_t>(c)));
}

/// Per-sentence key component of (sequence, sentence, head), written to out[0, D).
inline void sentence_vector(const kv_config& cfg, std::uint64_t seq, int sentence, int head,
                            double* out) noexcept {
  const std::uint64_t b = combine(combine(combine(combine(cfg.seed, s_ksentence), seq),
                                          static_cast<std::uint64_t>(sentence)),
                                  static_cast<std::uint64_t>(head));
  for (int c = 0; c < cfg.head_dim; ++c) out[c] = fast_normal(element(b, static_cast<std::uint64_t>(c)));
}

/// Interpolation weights (a, b) of the knots around token offset r within a topic span: linear
/// interpolation renormalized so the interpolated gaussian keeps unit variance.
inline void topic_weights(int r, int span, double& a, double& b) noexcept {
  const double w = static_cast<double>(r) / static_cast<double>(span);
  const double f = 1.0 / std::sqrt((1.0 - w) * (1.0 - w) + w * w);
  a = (1.0 - w) * f;
  b = w * f;
}

/// Hash base of the key noise of (sequence, token, head); channel c uses element(base, c).
inline std::uint64_t key_noise_base(const kv_config& cfg, std::uint64_t seq, int t, int h) noexcept {
  return combine(combine(combine(combine(cfg.seed, s_knoise), seq), static_cast<std::uint64_t>(t)),
                 static_cast<std::uint64_t>(h));
}

/// Heavy-hitter strength (per-channel RMS of the heavy-hitter component) of (token, head); 0 if the
/// token is not a heavy hitter.
inline double heavy_hitter(const kv_config& cfg, std::uint64_t seq, int t, int h, bool boundary) noexcept {
  if (t < cfg.sink_tokens) return 0.0;
  const std::uint64_t x = combine(combine(combine(combine(cfg.seed, s_heavy), seq), static_cast<std::uint64_t>(t)),
                                  static_cast<std::uint64_t>(h));
  const double rate = boundary ? static_cast<double>(cfg.boundary_heavy_hitter_rate)
                               : static_cast<double>(cfg.heavy_hitter_rate);
  if (uniform53(x) >= rate) return 0.0;
  return static_cast<double>(cfg.heavy_hitter_strength) * (0.25 + 0.75 * uniform53(mix64(x)));
}

/// Sink strength (per-channel RMS of the sink component) of token t.
inline double sink_weight(const kv_config& cfg, int t) noexcept {
  return t < cfg.sink_tokens ? static_cast<double>(cfg.sink_strength) / (1.0 + static_cast<double>(t)) : 0.0;
}

/// Rotates x (D values, NeoX half-split pairs) by the angles whose cosines/sines are given per pair.
inline void rotate(double* x, const double* cs, const double* sn, int pairs) noexcept {
  for (int j = 0; j < pairs; ++j) {
    const double a = x[j], b = x[j + pairs];
    x[j] = a * cs[j] - b * sn[j];
    x[j + pairs] = a * sn[j] + b * cs[j];
  }
}

/// cos/sin of position * inv_freq[j] for every pair j.
inline void rope_angles(const head_model& m, int position, double* cs, double* sn) noexcept {
  for (int j = 0; j < m.pairs; ++j) {
    const double ang = static_cast<double>(position) * m.inv_freq[static_cast<std::size_t>(j)];
    cs[j] = std::cos(ang);
    sn[j] = std::sin(ang);
  }
}

/// One pre-RoPE key element without the sink/heavy-hitter components (shared by the bulk generator
/// and the query's retrieval targets so both compute the same number).
inline double key_element(double mu, double sig, double tw, double topic, double sw, double sent,
                          double nw, double noise) noexcept {
  return mu + sig * (tw * topic + sw * sent + nw * noise);
}

/// Generates K (rotated if `rope`, else pre-RoPE) and V for tokens [first, first + n).
inline kv_data generate(const kv_config& cfg, std::uint64_t seq, int first, int n, bool rope,
                        const char* where) {
  validate(cfg, where);
  kvmosaic::detail::require(first >= 0, where, "first_token", first, ">= 0");
  kvmosaic::detail::require(n >= 0 && n <= INT_MAX - first, where, "num_tokens", n,
                            ">= 0, first_token + num_tokens <= INT_MAX");
  const head_model m = make_model(cfg);
  const int H = cfg.num_kv_heads, D = cfg.head_dim, P = D / 2;
  const auto uD = static_cast<std::size_t>(D);
  const std::size_t HD = static_cast<std::size_t>(H) * uD;
  kv_data out;
  out.num_tokens = n;
  out.num_kv_heads = H;
  out.head_dim = D;
  out.first_token = first;
  out.k.resize(static_cast<std::size_t>(n) * HD);
  out.v.resize(static_cast<std::size_t>(n) * HD);
  if (n == 0) return out;
  const int last = first + n - 1;

  const int span = cfg.topic_span;
  const int knot0 = first / span, knot1 = last / span + 1;
  const auto nknots = static_cast<std::size_t>(knot1 - knot0 + 1);
  std::vector<double> ktopic(nknots * HD), vtopic(nknots * HD);
  for (int kk = knot0; kk <= knot1; ++kk)
    for (int h = 0; h < H; ++h) {
      const std::size_t off = static_cast<std::size_t>(kk - knot0) * HD + static_cast<std::size_t>(h) * uD;
      topic_knot(cfg, s_ktopic, seq, kk, h, &ktopic[off]);
      topic_knot(cfg, s_vtopic, seq, kk, h, &vtopic[off]);
    }
  std::vector<double> wa(static_cast<std::size_t>(span)), wb(static_cast<std::size_t>(span));
  for (int r = 0; r < span; ++r) topic_weights(r, span, wa[static_cast<std::size_t>(r)], wb[static_cast<std::size_t>(r)]);

  sentence_map sm(cfg, seq);
  sm.extend_to(last);
  int sent = sm.sentence_of(first);
  std::vector<double> svec(HD);
  for (int h = 0; h < H; ++h) sentence_vector(cfg, seq, sent, h, &svec[static_cast<std::size_t>(h) * uD]);

  const std::uint64_t vnoise_key = combine(combine(cfg.seed, s_vnoise), seq);
  const std::uint64_t vscale_key = combine(combine(cfg.seed, s_vscale), seq);
  const double tw = cfg.topic_weight, sw = cfg.sentence_weight, nw = cfg.noise_weight;
  const double vtw = cfg.value_topic_weight;
  const double vnw = std::sqrt(std::max(0.0, 1.0 - vtw * vtw));
  std::vector<double> cs(static_cast<std::size_t>(P)), sn(static_cast<std::size_t>(P));
  std::vector<double> x(uD), e(uD);

  for (int t = first; t <= last; ++t) {
    while (sm.start(sent + 1) <= t) {
      ++sent;
      for (int h = 0; h < H; ++h) sentence_vector(cfg, seq, sent, h, &svec[static_cast<std::size_t>(h) * uD]);
    }
    const bool boundary = (sm.start(sent + 1) - 1 == t);
    rope_angles(m, t, cs.data(), sn.data());
    const std::size_t kn = static_cast<std::size_t>(t / span - knot0) * HD;
    const double a = wa[static_cast<std::size_t>(t % span)], b = wb[static_cast<std::size_t>(t % span)];
    const double sink = sink_weight(cfg, t);
    for (int h = 0; h < H; ++h) {
      const std::size_t hrow = static_cast<std::size_t>(h) * uD;
      const double* ka = &ktopic[kn + hrow];
      const double* kb = &ktopic[kn + HD + hrow];
      const double* va = &vtopic[kn + hrow];
      const double* vb = &vtopic[kn + HD + hrow];
      const double* sv = &svec[hrow];
      const double* kmu = &m.kmu[hrow];
      const double* ksig = &m.ksig[hrow];
      const std::uint64_t nb = key_noise_base(cfg, seq, t, h);
      for (int c = 0; c < D; ++c) {
        const double topic = a * ka[c] + b * kb[c];
        x[static_cast<std::size_t>(c)] = key_element(kmu[c], ksig[c], tw, topic, sw, sv[c], nw,
                                                     fast_normal(element(nb, static_cast<std::uint64_t>(c))));
      }
      const double hh = heavy_hitter(cfg, seq, t, h, boundary);
      if (sink != 0.0 || hh != 0.0) {
        // Sink / heavy-hitter components live in the rotated frame (queries contain the same fixed
        // vectors, so the match does not decay with distance); the pre-RoPE key holds them
        // counter-rotated by the token's position.
        for (int c = 0; c < D; ++c)
          e[static_cast<std::size_t>(c)] = sink * m.sink_dir[hrow + static_cast<std::size_t>(c)] +
                                           hh * m.hh_dir[hrow + static_cast<std::size_t>(c)];
        for (int j = 0; j < P; ++j) {  // rotate by -t
          const double p = e[static_cast<std::size_t>(j)], q = e[static_cast<std::size_t>(j + P)];
          e[static_cast<std::size_t>(j)] = p * cs[static_cast<std::size_t>(j)] + q * sn[static_cast<std::size_t>(j)];
          e[static_cast<std::size_t>(j + P)] = -p * sn[static_cast<std::size_t>(j)] + q * cs[static_cast<std::size_t>(j)];
        }
        for (int c = 0; c < D; ++c) x[static_cast<std::size_t>(c)] += e[static_cast<std::size_t>(c)];
      }
      float* kout = out.k.data() + static_cast<std::size_t>(t - first) * HD + hrow;
      if (rope) {
        for (int j = 0; j < P; ++j) {
          const auto uj = static_cast<std::size_t>(j);
          const double p = x[uj], q = x[uj + static_cast<std::size_t>(P)];
          kout[j] = static_cast<float>(p * cs[uj] - q * sn[uj]);
          kout[j + P] = static_cast<float>(p * sn[uj] + q * cs[uj]);
        }
      } else {
        for (int c = 0; c < D; ++c) kout[c] = static_cast<float>(x[static_cast<std::size_t>(c)]);
      }

      // Values: per-(token, head) scale times (small mean + spread * (topic + noise)).
      const std::uint64_t vkey = combine(combine(vscale_key, static_cast<std::uint64_t>(t)), static_cast<std::uint64_t>(h));
      double scale = std::exp(static_cast<double>(cfg.value_token_spread) * fast_normal(vkey));
      if (t < cfg.sink_tokens) scale *= static_cast<double>(cfg.sink_value_scale);
      const std::uint64_t vb_hash =
          combine(combine(vnoise_key, static_cast<std::uint64_t>(t)), static_cast<std::uint64_t>(h));
      const double* vmu = &m.vmu[hrow];
      const double* vsig = &m.vsig[hrow];
      float* vout = out.v.data() + static_cast<std::size_t>(t - first) * HD + hrow;
      for (int c = 0; c < D; ++c) {
        const double topic = a * va[c] + b * vb[c];
        const double noise = fast_normal(element(vb_hash, static_cast<std::uint64_t>(c)));
        vout[c] = static_cast<float>(scale * (vmu[c] + vsig[c] * (vtw * topic + vnw * noise)));
      }
    }
  }
  return out;
}

}  // namespace detail

/// Token ids [0, num_tokens) of sequence `sequence`: sentences of min_sentence_len to
/// max_sentence_len tokens (mean ~23 with the defaults), each ending in a boundary token drawn from
/// `boundary_tokens` (. 66%, newline 12%, ? 8%, ! 5%, ; 5%, : 4%); inside sentences ~6% commas and
/// ordinary ids from [100, vocab_size), small (frequent) ids more likely. A prefix of a longer
/// stream equals the shorter stream.
inline token_stream generate_tokens(const kv_config& cfg, std::uint64_t sequence, int num_tokens) {
  detail::validate(cfg, "synthetic::generate_tokens");
  kvmosaic::detail::require(num_tokens >= 0, "synthetic::generate_tokens", "num_tokens", num_tokens, ">= 0");
  token_stream ts;
  ts.ids.resize(static_cast<std::size_t>(num_tokens));
  ts.is_boundary.resize(static_cast<std::size_t>(num_tokens));
  if (num_tokens == 0) return ts;
  detail::sentence_map sm(cfg, sequence);
  sm.extend_to(num_tokens - 1);
  int sent = 0;
  for (int t = 0; t < num_tokens; ++t) {
    while (sm.start(sent + 1) <= t) ++sent;
    const bool last = (sm.start(sent + 1) - 1 == t);
    const std::int32_t id = detail::token_id(cfg, sequence, t, last);
    ts.ids[static_cast<std::size_t>(t)] = id;
    ts.is_boundary[static_cast<std::size_t>(t)] = last ? 1 : 0;
  }
  return ts;
}

/// K (RoPE applied) and V of tokens [first_token, first_token + num_tokens) of sequence `sequence`,
/// bitwise equal to the same slice of a longer generation.
///
/// Pre-RoPE key of token t, head h, channel c:
///   mean[h][c] + spread[h][c] * (topic_weight * topic(t) + sentence_weight * sentence(t)
///                                + noise_weight * noise(t))
/// plus, counter-rotated by t, the sink component (t < sink_tokens) and the heavy-hitter component.
/// mean/spread are large in the outlier channels (MUSTAFAR/KIVI channel outliers), small/unit
/// elsewhere. Values: scale(t, h) * (small mean + spread in [0.85, 1.15] * (topic + noise)), no
/// outlier channels (MUSTAFAR: uniform value magnitudes).
inline kv_data generate_kv(const kv_config& cfg, std::uint64_t sequence, int first_token, int num_tokens) {
  return detail::generate(cfg, sequence, first_token, num_tokens, true, "synthetic::generate_kv");
}

/// K (RoPE applied) and V of tokens [0, num_tokens) of sequence `sequence`.
inline kv_data generate_kv(const kv_config& cfg, std::uint64_t sequence, int num_tokens) {
  return generate_kv(cfg, sequence, 0, num_tokens);
}

/// Like `generate_kv`, but `k` holds the keys before RoPE (for checking rotations: each pair
/// (i, i + head_dim/2) of `generate_kv`'s key has the norm of the same pair here). `v` is identical.
inline kv_data generate_keys_pre_rope(const kv_config& cfg, std::uint64_t sequence, int first_token,
                                      int num_tokens) {
  return detail::generate(cfg, sequence, first_token, num_tokens, false, "synthetic::generate_keys_pre_rope");
}

/// The key outlier channels of KV head `head`, ascending (`outlier_channels` of them).
inline std::vector<int> outlier_channel_list(const kv_config& cfg, int head) {
  detail::validate(cfg, "synthetic::outlier_channel_list");
  kvmosaic::detail::require(head >= 0 && head < cfg.num_kv_heads, "synthetic::outlier_channel_list", "head",
                            head, "0 to num_kv_heads - 1");
  const detail::head_model m = detail::make_model(cfg);
  const auto per = static_cast<std::size_t>(m.outliers_per_head);
  return std::vector<int>(m.outliers.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(head)),
                          m.outliers.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(head + 1)));
}

/// Applies RoPE in place to `x` (head_dim values, GPT-NeoX half-split pairs (i, i + head_dim/2)) at
/// `position` with base `cfg.rope_theta`: the rotation the generator applies to keys and queries
/// (same angles, computed in double, rounded to float once).
inline void apply_rope(const kv_config& cfg, int position, float* x) {
  detail::validate(cfg, "synthetic::apply_rope");
  const int D = cfg.head_dim, P = D / 2;
  std::vector<double> y(static_cast<std::size_t>(D));
  for (int c = 0; c < D; ++c) y[static_cast<std::size_t>(c)] = static_cast<double>(x[c]);
  for (int j = 0; j < P; ++j) {
    const double ang = static_cast<double>(position) *
                       std::pow(cfg.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(D));
    const double cs = std::cos(ang), sn = std::sin(ang);
    const double a = y[static_cast<std::size_t>(j)], b = y[static_cast<std::size_t>(j + P)];
    y[static_cast<std::size_t>(j)] = a * cs - b * sn;
    y[static_cast<std::size_t>(j + P)] = a * sn + b * cs;
  }
  for (int c = 0; c < D; ++c) x[c] = static_cast<float>(y[static_cast<std::size_t>(c)]);
}

/// Softmax scale the statistics are tuned for: 1 / sqrt(head_dim).
inline double softmax_scale(const kv_config& cfg) noexcept {
  return 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
}

/// Queries of the decode step at `position` (the position of the token being decoded; it attends to
/// the cached tokens [0, position), optionally plus itself), all num_kv_heads * group_size query
/// heads, layout [q_head][channel] with q_head = kv_head * group_size + g. RoPE at `position`.
///
/// Each query head mixes, with per-head factors in [1 - head_variation, 1 + head_variation) fixed by
/// the seed (some heads lean on sinks, others on retrieval or recency):
/// * the head's sink and heavy-hitter directions (fixed in the rotated frame, projected out of
///   everything else): sinks and heavy hitters get high scores at every step;
/// * `retrieval_targets` keys of past tokens, centred and divided by the per-channel key variance
///   (a matched filter, so outlier channels do not swamp the match) and rotated to their own
///   positions. Even-numbered targets are uniform over the past, odd-numbered ones lie 128 to 2176
///   tokens back; all stay fixed for `query_drift` steps. The query retrieves those tokens and,
///   through the topic/sentence correlation, their neighbourhood (a few pages, a sentence);
/// * the topic and sentence of `position` (slow RoPE pairs weighted up, see `recency_reach`)
///   rotated to `position`: recency bias over the current sentence and the last tens of tokens;
/// * a little of the key mean and gaussian noise.
/// Everything is scaled by sqrt(128 / head_dim).
///
/// With the defaults (D = 128, 8 KV heads x 4) the mean attention entropy over query heads at
/// position 8192 is about 3.5-3.8 nats (30-45 effective tokens; single heads 4 to ~700), at 32768
/// about 4.7-5.4 nats (110-220 effective tokens); top-256 tokens hold ~90% (8K) / ~80% (32K) of the
/// mass, the first 4 tokens 5-20%, heavy hitters a large share of the rest.
inline std::vector<float> generate_query(const kv_config& cfg, std::uint64_t sequence, int position) {
  const char* where = "synthetic::generate_query";
  detail::validate(cfg, where);
  kvmosaic::detail::require(position >= 0, where, "position", position, ">= 0");
  using namespace detail;
  const head_model m = make_model(cfg);
  const int H = cfg.num_kv_heads, G = cfg.group_size, D = cfg.head_dim, P = D / 2;
  const auto uD = static_cast<std::size_t>(D);
  const int span = cfg.topic_span;
  const double tw = cfg.topic_weight, sw = cfg.sentence_weight, nw = cfg.noise_weight;
  const double qscale = std::sqrt(128.0 / static_cast<double>(D));
  std::vector<float> q(static_cast<std::size_t>(H) * static_cast<std::size_t>(G) * uD);

  sentence_map sm(cfg, sequence);
  sm.extend_to(position);
  std::vector<double> cs_p(static_cast<std::size_t>(P)), sn_p(static_cast<std::size_t>(P));
  std::vector<double> cs_t(static_cast<std::size_t>(P)), sn_t(static_cast<std::size_t>(P));
  rope_angles(m, position, cs_p.data(), sn_p.data());
  std::vector<double> ka(uD), kb(uD), sv(uD), rec(uD), mean(uD), acc(uD), tmp(uD);

  // Retrieval targets: epoch-based so they stay put for query_drift steps.
  const int epoch = position / cfg.query_drift;
  const int p0 = epoch * cfg.query_drift;
  const int range = p0 > 0 ? p0 : position;
  const std::uint64_t tkey = combine(combine(cfg.seed, s_target), sequence);
  constexpr int recent_gap = 128, recent_window = 2048;  // "recent" targets: [range-2176, range-128)
  const double recency_reach = static_cast<double>(cfg.recency_reach);

  for (int h = 0; h < H; ++h) {
    const std::size_t hrow = static_cast<std::size_t>(h) * uD;
    // Recency: topic and sentence component of the current position, rotated to it.
    {
      double a = 0, b = 0;
      topic_weights(position % span, span, a, b);
      topic_knot(cfg, s_ktopic, sequence, position / span, h, ka.data());
      topic_knot(cfg, s_ktopic, sequence, position / span + 1, h, kb.data());
      sentence_vector(cfg, sequence, sm.sentence_of(position), h, sv.data());
      for (int c = 0; c < D; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        rec[uc] = (tw * (a * ka[uc] + b * kb[uc]) + sw * sv[uc]) / m.ksig[hrow + uc];
      }
      // Down-weight the fast-rotating pairs: a match through them dies within a few tokens, which
      // would make recency a single-token spike; the slow pairs carry the neighbourhood.
      for (int j = 0; j < P; ++j) {
        const double w = 1.0 / (1.0 + recency_reach * m.inv_freq[static_cast<std::size_t>(j)]);
        rec[static_cast<std::size_t>(j)] *= w;
        rec[static_cast<std::size_t>(j + P)] *= w;
      }
      normalize_rms(rec.data(), D);
      rotate(rec.data(), cs_p.data(), sn_p.data(), P);
      for (int c = 0; c < D; ++c) mean[static_cast<std::size_t>(c)] = m.kmu[hrow + static_cast<std::size_t>(c)];
      rotate(mean.data(), cs_p.data(), sn_p.data(), P);
    }
    for (int g = 0; g < G; ++g) {
      const int qh = h * G + g;
      const std::uint64_t pers = combine(combine(cfg.seed, s_personality), static_cast<std::uint64_t>(qh));
      const double hv = static_cast<double>(cfg.head_variation);
      const double f_sink = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 0));
      const double f_hh = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 1));
      const double f_ret = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 2));
      const double f_rec = 1.0 - hv + 2.0 * hv * uniform53(element(pers, 3));
      const double a_sink = cfg.query_sink_strength * f_sink, a_hh = cfg.query_heavy_hitter_strength * f_hh;
      const double a_rec = cfg.recency_strength * f_rec;
      for (int c = 0; c < D; ++c) {
        const auto uc = static_cast<std::size_t>(c);
        acc[uc] = a_rec * rec[uc] + static_cast<double>(cfg.query_mean_weight) * mean[uc];
      }
      // Noise, rotated to the position.
      const std::uint64_t nb = combine(combine(combine(combine(cfg.seed, s_qnoise), sequence),
                                               static_cast<std::uint64_t>(position)),
                                       static_cast<std::uint64_t>(qh));
      for (int c = 0; c < D; ++c)
        tmp[static_cast<std::size_t>(c)] =
            box_muller(element(nb, static_cast<std::uint64_t>(c))) / m.ksig[hrow + static_cast<std::size_t>(c)];
      rotate(tmp.data(), cs_p.data(), sn_p.data(), P);
      for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += static_cast<double>(cfg.query_noise) * tmp[static_cast<std::size_t>(c)];
      // Retrieval targets.
      if (range > 0) {
        for (int r = 0; r < cfg.retrieval_targets; ++r) {
          const std::uint64_t th = r == 0 ? combine(combine(combine(tkey, static_cast<std::uint64_t>(h)), static_cast<std::uint64_t>(epoch)), 0u)
                                          : combine(combine(combine(tkey, (std::uint64_t{1} << 32) + static_cast<std::uint64_t>(qh)),
                                                            static_cast<std::uint64_t>(epoch)),
                                                    static_cast<std::uint64_t>(r));
          const double u = uniform53(th);
          int t;
          if (r % 2 == 0 || range <= 2 * recent_gap) {  // anywhere in the past
            t = static_cast<int>(u * static_cast<double>(range));
          } else {  // the recent past, beyond the reach of the recency component
            const int window = std::min(range - recent_gap, recent_window);
            t = range - recent_gap - 1 - static_cast<int>(u * static_cast<double>(window));
          }
          const double weight = cfg.retrieval_strength * f_ret * (0.8 + 0.4 * uniform53(mix64(th))) *
                                std::max(0.25, 1.0 - 0.15 * r);
          double a = 0, b = 0;
          topic_weights(t % span, span, a, b);
          topic_knot(cfg, s_ktopic, sequence, t / span, h, ka.data());
          topic_knot(cfg, s_ktopic, sequence, t / span + 1, h, kb.data());
          sentence_vector(cfg, sequence, sm.sentence_of(t), h, sv.data());
          const std::uint64_t kn = key_noise_base(cfg, sequence, t, h);
          for (int c = 0; c < D; ++c) {
            const auto uc = static_cast<std::size_t>(c);
            const double topic = a * ka[uc] + b * kb[uc];
            // Matched filter: the centred key divided by its per-channel variance (the key is
            // mean + ksig * z, so this is z / ksig); outlier channels weigh less.
            tmp[uc] = key_element(0.0, 1.0, tw, topic, sw, sv[uc], nw,
                                  fast_normal(element(kn, static_cast<std::uint64_t>(c)))) /
                      m.ksig[hrow + uc];
          }
          normalize_rms(tmp.data(), D);
          rope_angles(m, t, cs_t.data(), sn_t.data());
          rotate(tmp.data(), cs_t.data(), sn_t.data(), P);
          for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += weight * tmp[static_cast<std::size_t>(c)];
        }
      }
      // Sinks and heavy hitters: project those directions out of the rest and add them with their
      // own weights, so their scores do not depend on chance overlaps with the other components.
      const double* sd = &m.sink_dir[hrow];
      const double* hd = &m.hh_dir[hrow];
      double ds = 0.0, dh = 0.0;
      for (int c = 0; c < D; ++c) {
        ds += acc[static_cast<std::size_t>(c)] * sd[c];
        dh += acc[static_cast<std::size_t>(c)] * hd[c];
      }
      ds = a_sink - ds / static_cast<double>(D);
      dh = a_hh - dh / static_cast<double>(D);
      for (int c = 0; c < D; ++c) acc[static_cast<std::size_t>(c)] += ds * sd[c] + dh * hd[c];
      float* qo = &q[static_cast<std::size_t>(qh) * uD];
      for (int c = 0; c < D; ++c) qo[c] = static_cast<float>(qscale * acc[static_cast<std::size_t>(c)]);
    }
  }
  return q;
}

}  // namespace kvmosaic::synthetic
