// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A layer's cache type and policy settings as one string, so that Python (or a config file) can
/// choose them per layer at run time:
///
///     format[:key=value,...]/selector[:key=value,...]/compactor
///
/// e.g. `quant2:partition=64,rounding=nearest,sinks=4/quest:budget=0.125,block=16/none`. Every key
/// is checked: an unknown key, a bad value or an unsupported combination throws
/// `kvmosaic::invalid_argument` naming it and the allowed values. `with_layer_policies` turns a
/// parsed spec into the policy objects and calls a generic function with them, so the caller picks
/// the backend and never repeats the list of supported combinations.

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"

namespace kvmosaic_torch {

/// Throws `kvmosaic::invalid_argument` naming the spec's `parameter`, its `value` and what is allowed.
[[noreturn]] inline void reject(const std::string& parameter, const std::string& value, const std::string& allowed) {
  throw kvmosaic::invalid_argument(
      parameter, kvmosaic::detail::describe("kvmosaic_torch layer spec", parameter.c_str(), value, allowed.c_str()));
}
inline void require(bool ok, const std::string& parameter, const std::string& value, const std::string& allowed) {
  if (!ok) reject(parameter, value, allowed);
}

/// The `key=value` pairs of one policy; each read marks its key used, and `finish` rejects the rest.
class policy_args {
 public:
  policy_args(std::string policy, std::map<std::string, std::string> values)
      : policy_(std::move(policy)), values_(std::move(values)) {}

  bool has(const std::string& key) const { return values_.count(key) != 0; }

  std::string text(const std::string& key, const std::string& fallback, const std::string& allowed) {
    allowed_.push_back(key + " (" + allowed + ")");
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    std::string value = it->second;
    values_.erase(it);
    return value;
  }
  double number(const std::string& key, double fallback, const std::string& allowed) {
    const std::string raw = text(key, "", allowed);
    if (raw.empty()) return fallback;
    char* end = nullptr;
    const double value = std::strtod(raw.c_str(), &end);
    if (end == raw.c_str() || *end != '\0') fail(key, raw, "a number: " + allowed);
    return value;
  }
  std::int64_t integer(const std::string& key, std::int64_t fallback, const std::string& allowed) {
    const double value = number(key, static_cast<double>(fallback), allowed);
    if (value != static_cast<double>(static_cast<std::int64_t>(value))) fail(key, std::to_string(value), "an integer: " + allowed);
    return static_cast<std::int64_t>(value);
  }
  template <class Enum>
  Enum choice(const std::string& key, Enum fallback, const std::vector<std::pair<std::string, Enum>>& names) {
    std::string allowed;
    for (const auto& n : names) allowed += (allowed.empty() ? "" : " or ") + n.first;
    const std::string raw = text(key, "", allowed);
    if (raw.empty()) return fallback;
    for (const auto& n : names)
      if (n.first == raw) return n.second;
    fail(key, raw, allowed);
  }
  /// Throws for the first key nobody read.
  void finish() const {
    if (values_.empty()) return;
    std::string allowed;
    for (const std::string& a : allowed_) allowed += (allowed.empty() ? "" : ", ") + a;
    reject(policy_ + " key", values_.begin()->first, allowed.empty() ? std::string("no keys") : allowed);
  }

 private:
  [[noreturn]] void fail(const std::string& key, const std::string& value, const std::string& allowed) const {
    reject(policy_ + "." + key, value, allowed);
  }

  std::string policy_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> allowed_;
};

/// One part of a spec: `name[:key=value,...]`.
struct policy_spec {
  std::string name;
  std::map<std::string, std::string> values;
};

/// A parsed `format/selector/compactor` string.
struct layer_spec {
  policy_spec format, selector, compactor;
};

namespace detail {

inline std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts(1);
  for (char c : text) {
    if (c == sep) parts.emplace_back();
    else if (c != ' ') parts.back() += c;
  }
  return parts;
}

inline policy_spec parse_policy(const std::string& text, const char* part) {
  policy_spec spec;
  const std::size_t colon = text.find(':');
  spec.name = text.substr(0, colon);
  require(!spec.name.empty(), part, "empty", "a policy name");
  if (colon == std::string::npos) return spec;
  for (const std::string& pair : split(text.substr(colon + 1), ',')) {
    const std::size_t eq = pair.find('=');
    require(eq != std::string::npos && eq > 0, part, pair, "key=value pairs");
    spec.values[pair.substr(0, eq)] = pair.substr(eq + 1);
  }
  return spec;
}

inline kvmosaic::select::token_budget read_budget(policy_args& args, double fallback_ratio) {
  kvmosaic::select::token_budget budget;
  budget.ratio = args.number("budget", fallback_ratio, "fraction of the context in [0, 1]");
  budget.tokens = args.integer("tokens", -1, "absolute budget in tokens; overrides budget");
  return budget;
}

inline kvmosaic::group_combine read_combine(policy_args& args) {
  return args.choice("combine", kvmosaic::group_combine::max,
                     {{"max", kvmosaic::group_combine::max}, {"sum", kvmosaic::group_combine::sum}});
}

}  // namespace detail

/// Parses `format/selector/compactor`; the compactor may be left out (`none`).
inline layer_spec parse_layer_spec(const std::string& text) {
  const std::vector<std::string> parts = detail::split(text, '/');
  require(parts.size() == 2 || parts.size() == 3, "spec", text,
          "format[:k=v,...]/selector[:k=v,...][/compactor], e.g. quant2:partition=64/quest:budget=0.125");
  layer_spec spec;
  spec.format = detail::parse_policy(parts[0], "format");
  spec.selector = detail::parse_policy(parts[1], "selector");
  spec.compactor = detail::parse_policy(parts.size() == 3 ? parts[2] : std::string("none"), "compactor");
  return spec;
}

/// Calls `make(format, selector, compactor)` with the policy objects `spec` names, for every
/// combination the extension compiles: formats dense, bitmap_tiles, quant2; selectors all, quest,
/// sentence_chunks (with compactor none), streaming (with hole_fill or repack), and over dense
/// mean_keys (with none), tova and h2o (with hole_fill or repack) and snapkv (with repack); quant4
/// and V per token (`v_axis=head_dim`, either width) with select::all; and packed_bitmap with
/// select::all and mean_keys, and tova, h2o and snapkv (with repack). Every combination is made for either backend (`make` is the host or the CUDA maker
/// of layer_factory.hpp).
/// The `per_head` key of a keep-less selector (0 or 1): one decision per KV head, each head in
/// pages of its own (`select::per_kv_head`), where the maker compiles such layers (the host's).
template <class Make>
bool per_head(policy_args& args, const Make&) {
  const bool on = args.integer("per_head", 0, "0 (one decision for every KV head) or 1 (one per head)") != 0;
  if (on && !std::decay_t<Make>::per_kv_head_layers)
    reject("per_head", "1", "0 on this device: the extension compiles per-KV-head layers for the CPU only");
  return on;
}

template <class Make>
auto with_layer_policies(const layer_spec& spec, Make&& make) {
  namespace kv = kvmosaic;
  auto with_selector = [&](const auto& format) {
    using format_type = std::decay_t<decltype(format)>;
    constexpr bool dense = std::is_same_v<format_type, kv::format::dense>;
    // packed_bitmap: select::all and the score-based selectors only (each adds engines).
    constexpr bool packed = std::is_same_v<format_type, kv::format::packed_bitmap>;
    policy_args args(spec.selector.name, spec.selector.values);
    const std::string& compactor = spec.compactor.name;
    require(spec.compactor.values.empty(), "compactor", compactor, "a compactor without keys");
    if (spec.selector.name == "all" || spec.selector.name == "quest" || spec.selector.name == "sentence_chunks" ||
        spec.selector.name == "mean_keys")
      require(compactor == "none", "compactor", compactor,
                          "none with selector " + spec.selector.name + " (this extension compiles no other)");
    if (spec.selector.name == "all") {
      args.finish();
      return make(format, kv::select::all{}, kv::compact::none{});
    }
    // Quest and mean_keys: a budget, blocks of a page, the group's combination.
    const auto read_blocks = [&](auto s) {
      s.budget = detail::read_budget(args, s.budget.ratio);
      s.block_tokens = static_cast<int>(args.integer("block", s.block_tokens, "0 (the page) or a multiple of 8"));
      s.combine = detail::read_combine(args);
      args.finish();
      return s;
    };
    if (spec.selector.name == "mean_keys") {
      // MosaicKV's stage 2; over dense and packed_bitmap pages only here (each adds an engine).
      if constexpr (dense || packed) {
        return make(format, read_blocks(kv::select::mean_keys{}), kv::compact::none{});
      } else {
        reject("selector", spec.selector.name,
               "all, quest, sentence_chunks, streaming, tova, h2o or snapkv here (mean_keys: format dense or packed_bitmap)");
      }
    }
    if constexpr (packed) {
      if (spec.selector.name != "tova" && spec.selector.name != "h2o" && spec.selector.name != "snapkv")
        reject("selector", spec.selector.name,
               "all, mean_keys, tova, h2o or snapkv for packed_bitmap (this extension compiles no other)");
      require(compactor == "repack" || compactor == "none", "compactor", compactor, "repack for packed_bitmap");
    }
    if constexpr (!packed) {
    if (spec.selector.name == "quest") return make(format, read_blocks(kv::select::quest{}), kv::compact::none{});
    if (spec.selector.name == "sentence_chunks") {
      kv::select::sentence_chunks s;
      s.budget = detail::read_budget(args, s.budget.ratio);
      s.target_length = static_cast<int>(args.integer("length", s.target_length, "L, the ideal chunk length"));
      s.window = static_cast<int>(args.integer("window", s.window, "Delta, how far a split may move"));
      s.combine = detail::read_combine(args);
      // boundaries=id:weight|id:weight (the tokenizer's sentence-ending tokens)
      for (const std::string& item : detail::split(args.text("boundaries", "", "id:weight|id:weight"), '|')) {
        if (item.empty()) continue;
        const std::size_t colon = item.find(':');
        require(colon != std::string::npos, "sentence_chunks.boundaries", item, "id:weight");
        s.boundaries.push_back({static_cast<std::int32_t>(std::stol(item.substr(0, colon))),
                                std::stof(item.substr(colon + 1))});
      }
      args.finish();
      return make(format, s, kv::compact::none{});
    }
    if (spec.selector.name == "streaming") {
      kv::select::streaming s;
      s.budget = detail::read_budget(args, s.budget.ratio);
      s.sink_tokens = static_cast<int>(args.integer("sinks", s.sink_tokens, "tokens kept from the start"));
      s.compact_every = static_cast<int>(args.integer("compact_every", s.compact_every, "tokens between passes"));
      args.finish();
      if (compactor == "repack") return make(format, s, kv::compact::repack{});
      require(compactor == "hole_fill", "compactor", compactor,
                          "hole_fill or repack with selector streaming");
      return make(format, s, kv::compact::hole_fill{});
    }
    }  // !packed
    if (spec.selector.name == "tova" || spec.selector.name == "h2o") {
      // Their scores come from the attend path (every format's, on either backend). Over dense
      // and packed_bitmap pages only here (each adds engines to the extension's build).
      if constexpr (std::decay_t<Make>::attend_writes_token_scores && (dense || packed)) {
        const bool by_head = per_head(args, make);
        require(dense || !by_head, "per_head", "1", "0 with packed_bitmap (per-KV-head layers: format dense)");
        auto with_compactor = [&](const auto& s) {
          if constexpr (dense && std::decay_t<Make>::per_kv_head_layers) {  // else per_head refused by_head
            if (by_head) {
              require(compactor == "repack", "compactor", compactor, "repack with per_head=1");
              return make(format, kv::select::per_kv_head<std::decay_t<decltype(s)>>{s, {}}, kv::compact::repack{});
            }
          }
          if (compactor == "repack") return make(format, s, kv::compact::repack{});
          if constexpr (packed) {
            reject("compactor", compactor, "repack with packed_bitmap");
          } else {
            require(compactor == "hole_fill", "compactor", compactor, "hole_fill or repack with selector " + spec.selector.name);
            return make(format, s, kv::compact::hole_fill{});
          }
        };
        const auto fill = [&](auto s) {
          s.budget = detail::read_budget(args, s.budget.ratio);
          s.combine = args.choice("combine", s.combine, {{"max", kv::group_combine::max}, {"sum", kv::group_combine::sum}});
          s.compact_every = static_cast<int>(args.integer("compact_every", s.compact_every, "tokens between passes"));
          return s;
        };
        if (spec.selector.name == "tova") {
          const kv::select::tova s = fill(kv::select::tova{});
          args.finish();
          return with_compactor(s);
        }
        kv::select::h2o s = fill(kv::select::h2o{});
        s.recent_share = args.number("recent", s.recent_share, "the recent window's share of the budget, 0 to 1");
        args.finish();
        return with_compactor(s);
      } else {
        reject("selector", spec.selector.name,
               "all, quest, sentence_chunks or streaming here (tova and h2o: format dense or packed_bitmap)");
      }
    }
    if (spec.selector.name == "snapkv") {
      // The snapshot's votes come from the keys (on the host) or the decode kernels' logits
      // (CUDA over dense); over dense pages with repack only here (each adds an engine).
      if constexpr (dense || packed) {
        kv::select::snapkv s;
        s.budget = detail::read_budget(args, s.budget.ratio);
        s.window = static_cast<int>(args.integer("window", s.window, "W, the observation window (>= 1)"));
        s.pool_kernel = static_cast<int>(args.integer("pool", s.pool_kernel, "an odd pooling width"));
        s.combine = args.choice("combine", s.combine, {{"max", kv::group_combine::max}, {"sum", kv::group_combine::sum}});
        const bool by_head = per_head(args, make);
        kv::select::per_kv_head<kv::select::snapkv> heads{s, {}};
        heads.adaptive = args.integer("adaptive", 0, "0, or 1 with per_head=1 (Ada-KV's allocation)") != 0;
        heads.safeguard = args.number("safeguard", heads.safeguard, "with adaptive=1: each head's kept share, 0 to 1");
        args.finish();
        require(compactor == "repack", "compactor", compactor, "repack with selector snapkv");
        require(by_head || !heads.adaptive, "adaptive", "1", "0 without per_head=1");
        require(dense || !by_head, "per_head", "1", "0 with packed_bitmap (per-KV-head layers: format dense)");
        if constexpr (dense && std::decay_t<Make>::per_kv_head_layers)  // else per_head refused by_head
          if (by_head) return make(format, heads, kv::compact::repack{});
        return make(format, s, kv::compact::repack{});
      } else {
        reject("selector", spec.selector.name,
               "all, quest, sentence_chunks, streaming, tova or h2o here (snapkv: format dense or packed_bitmap)");
      }
    }
    reject("selector", spec.selector.name, "all, quest, mean_keys, sentence_chunks, streaming, tova, h2o or snapkv");
  };

  policy_args args(spec.format.name, spec.format.values);
  // Exact tokens, every format: sinks (the first tokens) and a recent window kept 16-bit.
  auto exact_tokens = [&args](auto& f) {
    f.sink_tokens = static_cast<int>(args.integer("sinks", f.sink_tokens, "0 to 16 first tokens kept exact"));
    f.recent_tokens = static_cast<int>(args.integer("recent", f.recent_tokens, "0 to 1024 last tokens kept exact"));
  };
  if (spec.format.name == "dense") {
    kv::format::dense f;
    exact_tokens(f);
    args.finish();
    return with_selector(f);
  }
  if (spec.format.name == "bitmap_tiles") {
    kv::format::bitmap_tiles f;
    f.s_k = static_cast<float>(args.number("s_k", f.s_k, "K sparsity in [0, 0.95]"));
    f.s_v = static_cast<float>(args.number("s_v", f.s_v, "V sparsity in [0, 0.95]"));
    f.k_layout = args.choice("k_layout", f.k_layout,
                             {{"channels", kv::format::bitmap_k_layout::along_channels},
                              {"tokens", kv::format::bitmap_k_layout::along_tokens}});
    exact_tokens(f);
    args.finish();
    return with_selector(f);
  }
  if (spec.format.name == "quant2" || spec.format.name == "quant4") {
    // The code width and the V axis are template parameters of the format: quant2 with V per
    // channel takes every selector; quant4, and either width with V per token (v_axis=head_dim),
    // are compiled with select::all only (each adds its kernels to every configuration).
    const bool four = spec.format.name == "quant4";
    const auto v_axis = args.choice("v_axis", kv::format::value_axis::tokens,
                                    {{"tokens", kv::format::value_axis::tokens}, {"head_dim", kv::format::value_axis::head_dim}});
    auto fill = [&](auto f) {
      f.partition = static_cast<int>(args.integer("partition", f.partition, "32, 64 or 128"));
      f.mode = args.choice("rounding", f.mode,
                           {{"stochastic", kv::format::rounding::stochastic}, {"nearest", kv::format::rounding::nearest}});
      f.seed = static_cast<std::uint64_t>(args.integer("seed", static_cast<std::int64_t>(f.seed), "any integer >= 0"));
      f.k_axis = args.choice("k_axis", f.k_axis,
                             {{"tokens", kv::format::key_axis::tokens}, {"head_dim", kv::format::key_axis::head_dim}});
      exact_tokens(f);
      f.max_reencodes = static_cast<int>(args.integer("max_reencodes", f.max_reencodes, ">= 0"));
      args.finish();
      return f;
    };
    if (!four && v_axis == kv::format::value_axis::tokens) return with_selector(fill(kv::format::quant2{}));
    require(spec.selector.name == "all" && spec.selector.values.empty() && spec.compactor.name == "none", "selector",
            spec.selector.name,
            "all (with no compactor) for " + spec.format.name + (four ? "" : " with v_axis=head_dim") +
                ": this extension compiles it with select::all only");
    if (four && v_axis == kv::format::value_axis::tokens)
      return make(fill(kv::format::quant4{}), kv::select::all{}, kv::compact::none{});
    if (four) return make(fill(kv::format::quant<4, kv::format::value_axis::head_dim>{}), kv::select::all{}, kv::compact::none{});
    return make(fill(kv::format::quant<2, kv::format::value_axis::head_dim>{}), kv::select::all{}, kv::compact::none{});
  }
  if (spec.format.name == "packed_bitmap") {
    // MosaicKV's stage 1, a format with segments, on either backend: with select::all, or with
    // tova, h2o or snapkv and repack (with_selector; each more combination is an engine built for
    // both backends).
    kv::format::packed_bitmap f;
    f.retained = static_cast<float>(
        args.number("retained", f.retained, "fraction of head_dim a vector keeps, in (0, 1 - truncated]"));
    f.group = static_cast<int>(args.integer("group", f.group, "1, 2 or 4 channels per bitmap bit"));
    f.truncated = static_cast<float>(
        args.number("truncated", f.truncated, "fraction of head_dim never stored, in [0, 1)"));
    f.segment_tokens = static_cast<int>(
        args.integer("segment", f.segment_tokens, "tokens per segment, a multiple of page_size"));
    f.mode = args.choice("mode", f.mode,
                         {{"fixed", kv::format::strategy::fixed}, {"search", kv::format::strategy::search}});
    f.loss_threshold = static_cast<float>(
        args.number("loss", f.loss_threshold, "mode=search: the largest relative squared error, 0 to 1"));
    f.block_variance_threshold = static_cast<float>(
        args.number("block_variance", f.block_variance_threshold, "the largest relative intra-block key variance"));
    exact_tokens(f);
    args.finish();
    return with_selector(f);
  }
  reject("format", spec.format.name, "dense, bitmap_tiles, quant2, quant4 or packed_bitmap");
}

}  // namespace kvmosaic_torch
