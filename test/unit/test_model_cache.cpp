// SPDX-License-Identifier: Apache-2.0
// model_cache and layer_cache on the host backend: a model of three layers of different cache
// types gives each layer the outputs of the same cache driven directly; add, fork and remove fan
// out to every layer with consistent ids, all or nothing; memory sums the layers; tensor_ref's
// dtype is checked; reading back; token ids for the selectors that need them; window votes and a
// snapkv layer's snapshot; bad input rejected.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using dense_layer = cache<format::dense, select::all>;
using quant2_quest_layer = cache<format::quant2, select::quest>;
using bitmap_layer = cache<format::bitmap_tiles, select::all>;

cache_config layer_config(std::int32_t max_sequences = 8) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 64;  // bitmap_tiles: whole 64-token tiles; quant2: a multiple of its partition
  c.max_pages = 256;
  c.max_sequences = max_sequences;
  return c;
}

format::quant2 quant2_format() {
  format::quant2 f;
  f.partition = 32;
  return f;
}

select::quest quarter_quest() {
  select::quest q;
  q.budget.ratio = 0.25;
  q.block_tokens = 8;
  return q;
}

/// The three caches driven directly, and the same three types as a model.
struct direct_and_model {
  explicit direct_and_model(const cache_config& c)
      : config(c), dense(c), quant2(c, quant2_format(), quarter_quest()), bitmap(c, format::bitmap_tiles{0.5f, 0.7f}),
        model(layers(c)) {}

  static std::vector<std::unique_ptr<layer_cache>> layers(const cache_config& c) {
    std::vector<std::unique_ptr<layer_cache>> l;
    l.push_back(make_layer<dense_layer>(c));
    l.push_back(make_layer<quant2_quest_layer>(c, quant2_format(), quarter_quest()));
    l.push_back(make_layer<bitmap_layer>(c, format::bitmap_tiles{0.5f, 0.7f}));
    return l;
  }

  cache_config config;
  dense_layer dense;
  quant2_quest_layer quant2;
  bitmap_layer bitmap;
  model_cache model;
};

/// Each layer's K and V of `tokens` tokens of stream `stream` from position `first` (different
/// data per layer).
synthetic::kv_data layer_rows(const cache_config& c, int layer, std::uint64_t stream, int first, int tokens) {
  return synthetic::generate_kv(test::generator_for(c, 100 + static_cast<std::uint64_t>(layer)), stream, first, tokens);
}

tensor_ref<3> ref_of(const std::vector<float>& x, std::int64_t a, std::int64_t b, std::int64_t c) {
  return tensor_ref<3>::of(tensor_view<const float, 3>(x.data(), a, b, c));
}

template <class T>
std::vector<T> converted(const std::vector<float>& x) {
  std::vector<T> out;
  out.reserve(x.size());
  for (const float v : x) out.push_back(T(v));
  return out;
}

}  // namespace

TEST_CASE("model_cache: three layers of different types give the outputs of the same caches driven directly",
          "[model_cache]") {
  const cache_config c = layer_config();
  direct_and_model t(c);
  const int hq = c.num_q_heads(), d = c.head_dim, h = c.num_kv_heads;
  const std::vector<int> lengths{40, 7, 64 * 3};
  std::vector<sequence_id> model_ids, direct_ids;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    model_ids.push_back(t.model.add_sequence());
    const sequence_id a = t.dense.add_sequence(), q = t.quant2.add_sequence(), m = t.bitmap.add_sequence();
    REQUIRE(a == q);
    REQUIRE(q == m);
    direct_ids.push_back(a);
    for (int layer = 0; layer < 3; ++layer) {
      const auto kv = layer_rows(c, layer, b, 0, lengths[b]);
      t.model.prefill(layer, model_ids.back(), ref_of(kv.k, lengths[b], h, d), ref_of(kv.v, lengths[b], h, d));
      if (layer == 0) t.dense.prefill(a, test::k_view(kv), test::v_view(kv));
      if (layer == 1) t.quant2.prefill(a, test::k_view(kv), test::v_view(kv));
      if (layer == 2) t.bitmap.prefill(a, test::k_view(kv), test::v_view(kv));
    }
  }
  const auto batch = static_cast<std::int64_t>(model_ids.size());
  const span<const sequence_id> model_span(model_ids.data(), batch), direct_span(direct_ids.data(), batch);
  for (int step = 0; step < 12; ++step) {  // decode steps: every layer appends, then attends
    for (int layer = 0; layer < 3; ++layer) {
      std::vector<float> k, v, q;
      for (std::int64_t b = 0; b < batch; ++b) {
        const int position = static_cast<int>(t.model.layer(layer).length(t.model.layer_sequence(layer, model_ids[b])));
        const auto row = layer_rows(c, layer, static_cast<std::uint64_t>(b), position, 1);
        k.insert(k.end(), row.k.begin(), row.k.end());
        v.insert(v.end(), row.v.begin(), row.v.end());
        const auto query = synthetic::generate_query(test::generator_for(c, 100 + static_cast<std::uint64_t>(layer)),
                                                     static_cast<std::uint64_t>(b), position + 1);
        q.insert(q.end(), query.begin(), query.end());
      }
      t.model.append(layer, model_span, ref_of(k, batch, h, d), ref_of(v, batch, h, d));
      const tensor_view<const float, 3> kd(k.data(), batch, h, d), vd(v.data(), batch, h, d);
      if (layer == 0) t.dense.append(direct_span, kd, vd);
      if (layer == 1) t.quant2.append(direct_span, kd, vd);
      if (layer == 2) t.bitmap.append(direct_span, kd, vd);
      // The model's output in bfloat16 from a half query, to cross the dtype dispatch; the direct
      // cache's from the same half query.
      const std::vector<half> q16 = converted<half>(q);
      std::vector<bfloat16> out_model(q.size());
      std::vector<bfloat16> out_direct(q.size());
      t.model.attend(layer, model_span, tensor_ref<3>::of(tensor_view<const half, 3>(q16.data(), batch, hq, d)),
                     tensor_ref<3>::of(tensor_view<bfloat16, 3>(out_model.data(), batch, hq, d)));
      const tensor_view<const half, 3> qd(q16.data(), batch, hq, d);
      const tensor_view<bfloat16, 3> od(out_direct.data(), batch, hq, d);
      if (layer == 0) t.dense.attend(direct_span, qd, od);
      if (layer == 1) t.quant2.attend(direct_span, qd, od);
      if (layer == 2) t.bitmap.attend(direct_span, qd, od);
      CAPTURE(step, layer);
      for (std::size_t i = 0; i < q.size(); ++i) REQUIRE(out_model[i].bits == out_direct[i].bits);
    }
  }
  // What each layer stores is what the direct caches store: read back through the model.
  for (std::int64_t b = 0; b < batch; ++b)
    for (int layer = 0; layer < 3; ++layer) {
      const sequence_id id = t.model.layer_sequence(layer, model_ids[b]);
      const std::int64_t n = t.model.layer(layer).stored_tokens(id);
      std::vector<float> k(static_cast<std::size_t>(n) * h * d), v(k.size()), k2(k.size()), v2(k.size());
      t.model.read(layer, model_ids[b], tensor_ref<3>::of(tensor_view<float, 3>(k.data(), n, h, d)),
                   tensor_ref<3>::of(tensor_view<float, 3>(v.data(), n, h, d)));
      const tensor_view<float, 3> kd(k2.data(), n, h, d), vd(v2.data(), n, h, d);
      if (layer == 0) t.dense.read(direct_ids[static_cast<std::size_t>(b)], kd, vd);
      if (layer == 1) t.quant2.read(direct_ids[static_cast<std::size_t>(b)], kd, vd);
      if (layer == 2) t.bitmap.read(direct_ids[static_cast<std::size_t>(b)], kd, vd);
      REQUIRE(k == k2);
      REQUIRE(v == v2);
    }
  REQUIRE(t.model.length(model_ids[0]) == 40 + 12);
  // memory() sums the layers.
  const memory_stats m = t.model.memory();
  const memory_stats a = t.dense.memory(), q = t.quant2.memory(), bm = t.bitmap.memory();
  REQUIRE(m.tokens == a.tokens + q.tokens + bm.tokens);
  REQUIRE(m.stored_bytes == a.stored_bytes + q.stored_bytes + bm.stored_bytes);
  REQUIRE(m.dense_bytes == a.dense_bytes + q.dense_bytes + bm.dense_bytes);
  REQUIRE(m.pages_used == a.pages_used + q.pages_used + bm.pages_used);
  REQUIRE(m.pages_free == a.pages_free + q.pages_free + bm.pages_free);
  REQUIRE(m.compression_ratio() < 1.0);
}

TEST_CASE("model_cache: add, fork and remove fan out to every layer; ids stay consistent handles", "[model_cache]") {
  const cache_config c = layer_config(4);
  direct_and_model t(c);
  model_cache& model = t.model;
  REQUIRE(model.num_layers() == 3);
  REQUIRE(model.layer(0).describe() == "dense/all/none");
  REQUIRE(model.layer(1).describe().rfind("quant2", 0) == 0);
  REQUIRE_FALSE(model.layer(2).on_device());
  REQUIRE_FALSE(model.layer(1).needs_token_ids());
  model.set_stream(nullptr);  // host layers ignore it
  const int h = c.num_kv_heads, d = c.head_dim;
  const sequence_id a = model.add_sequence();
  for (int layer = 0; layer < 3; ++layer) {
    const auto kv = layer_rows(c, layer, 0, 0, 70);
    model.prefill(layer, a, ref_of(kv.k, 70, h, d), ref_of(kv.v, 70, h, d));
  }
  const sequence_id b = model.fork_sequence(a);
  REQUIRE(b != a);
  REQUIRE(model.num_sequences() == 2);
  for (int layer = 0; layer < 3; ++layer) {
    REQUIRE(model.layer_sequence(layer, b) != model.layer_sequence(layer, a));
    REQUIRE(model.layer(layer).length(model.layer_sequence(layer, b)) == 70);
  }
  REQUIRE(model.length(b) == 70);
  // The fork shares the parent's full page (64 tokens) in every layer.
  REQUIRE(model.memory().pages_used == 3 * 1);
  const std::vector<sequence_id> old_ids{model.layer_sequence(0, a), model.layer_sequence(1, a), model.layer_sequence(2, a)};
  model.remove_sequence(a);
  REQUIRE_FALSE(model.contains(a));
  REQUIRE(model.contains(b));
  REQUIRE(model.memory().pages_used == 3 * 1);  // still held by the fork
  for (int layer = 0; layer < 3; ++layer)
    REQUIRE_THROWS_AS(model.layer(layer).length(old_ids[static_cast<std::size_t>(layer)]), invalid_argument);
  // A removed or never handed out model id is rejected, naming seq.
  for (const sequence_id bad : {a, sequence_id{-1}, sequence_id{12345}}) {
    try {
      model.length(bad);
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      REQUIRE(e.parameter() == "seq");
      REQUIRE(std::string(e.what()).find("model_cache::length") != std::string::npos);
    }
    REQUIRE_THROWS_AS(model.remove_sequence(bad), invalid_argument);
    REQUIRE_THROWS_AS(model.fork_sequence(bad), invalid_argument);
    REQUIRE_THROWS_AS(model.layer_sequence(0, bad), invalid_argument);
  }
  // Ids are never reused, even when the layers reuse their slots.
  const sequence_id e = model.add_sequence();
  REQUIRE(e != a);
  REQUIRE(e != b);
  model.remove_sequence(b);
  model.remove_sequence(e);
  REQUIRE(model.num_sequences() == 0);
  REQUIRE(model.memory().pages_used == 0);
  REQUIRE(model.memory().tokens == 0);
}

TEST_CASE("model_cache: a layer that cannot add or fork leaves every layer as it was", "[model_cache][errors]") {
  // Layer 2 holds 2 sequences, the others 3.
  std::vector<std::unique_ptr<layer_cache>> layers;
  layers.push_back(make_layer<dense_layer>(layer_config(3)));
  layers.push_back(make_layer<quant2_quest_layer>(layer_config(3), quant2_format(), quarter_quest()));
  layers.push_back(make_layer<bitmap_layer>(layer_config(2)));
  model_cache model(std::move(layers));
  const cache_config c = layer_config();
  const int h = c.num_kv_heads, d = c.head_dim;
  const sequence_id a = model.add_sequence();
  for (int layer = 0; layer < 3; ++layer) {
    const auto kv = layer_rows(c, layer, 0, 0, 20);
    model.prefill(layer, a, ref_of(kv.k, 20, h, d), ref_of(kv.v, 20, h, d));
  }
  const sequence_id b = model.add_sequence();
  const memory_stats before = model.memory();
  for (int attempt = 0; attempt < 3; ++attempt) {
    REQUIRE_THROWS_AS(model.add_sequence(), capacity_error);
    REQUIRE_THROWS_AS(model.fork_sequence(a), capacity_error);
  }
  REQUIRE(model.num_sequences() == 2);
  const memory_stats after = model.memory();
  REQUIRE(after.pages_used == before.pages_used);
  REQUIRE(after.stored_bytes == before.stored_bytes);
  REQUIRE(after.tokens == before.tokens);
  // Layers 0 and 1 undid their part: each still has its third slot free.
  for (int layer = 0; layer < 2; ++layer) {
    const sequence_id extra = model.layer(layer).add_sequence();
    model.layer(layer).remove_sequence(extra);
  }
  model.remove_sequence(b);
  const sequence_id f = model.fork_sequence(a);  // now it fits
  REQUIRE(model.length(f) == 20);
}

TEST_CASE("tensor_ref: the typed view back, and a dtype mismatch rejected naming the dtype", "[model_cache][tensor_ref]") {
  std::vector<float> x(2 * 3 * 4);
  const std::int64_t extents[3] = {2, 3, 4}, strides[3] = {1, 2, 6};
  const auto view = tensor_view<float, 3>::strided(x.data(), extents, strides);
  const tensor_ref<3> r = tensor_ref<3>::of(view);
  REQUIRE(r.type == dtype::f32);
  REQUIRE(r.data == x.data());
  const tensor_view<const float, 3> back = r.as<const float>();
  for (int i = 0; i < 3; ++i) {
    REQUIRE(back.extent(i) == extents[i]);
    REQUIRE(back.stride(i) == strides[i]);
  }
  try {
    (void)r.as<half>();
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "type");
    REQUIRE(std::string(e.what()).find("f32") != std::string::npos);
    REQUIRE(std::string(e.what()).find("f16") != std::string::npos);
  }
  std::vector<bfloat16> y(4);
  REQUIRE(tensor_ref<1>::of(span<const bfloat16>(y.data(), 4)).type == dtype::bf16);
  REQUIRE_THROWS_AS(tensor_ref<1>::of(span<const bfloat16>(y.data(), 4)).as<float>(), invalid_argument);

  // Through a layer: k and v of different dtypes, a wrong q dtype for the data, an unknown dtype.
  const cache_config c = layer_config();
  const int h = c.num_kv_heads, d = c.head_dim;
  std::unique_ptr<layer_cache> layer = make_layer<dense_layer>(c);
  const sequence_id seq = layer->add_sequence();
  const auto kv = layer_rows(c, 0, 0, 0, 5);
  const std::vector<half> v16 = converted<half>(kv.v);
  try {
    layer->prefill(seq, ref_of(kv.k, 5, h, d), tensor_ref<3>::of(tensor_view<const half, 3>(v16.data(), 5, h, d)), {});
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "v.type");
  }
  tensor_ref<3> k = ref_of(kv.k, 5, h, d);
  k.type = static_cast<dtype>(7);
  tensor_ref<3> v = ref_of(kv.v, 5, h, d);
  v.type = k.type;
  REQUIRE_THROWS_AS(layer->prefill(seq, k, v, {}), invalid_argument);
  REQUIRE(layer->length(seq) == 0);  // nothing stored
  // Half K and V are taken as half: the same rows as float input rounded to half.
  const std::vector<half> k16 = converted<half>(kv.k);
  layer->prefill(seq, tensor_ref<3>::of(tensor_view<const half, 3>(k16.data(), 5, h, d)),
                 tensor_ref<3>::of(tensor_view<const half, 3>(v16.data(), 5, h, d)), {});
  std::vector<float> k_read(5 * static_cast<std::size_t>(h) * d), v_read(k_read.size());
  layer->read(seq, tensor_ref<3>::of(tensor_view<float, 3>(k_read.data(), 5, h, d)),
              tensor_ref<3>::of(tensor_view<float, 3>(v_read.data(), 5, h, d)));
  for (std::size_t i = 0; i < k_read.size(); ++i) REQUIRE(k_read[i] == to_float(bfloat16(to_float(k16[i]))));
}

TEST_CASE("layer_cache: a selector that cuts at boundary tokens needs the ids, others ignore them",
          "[model_cache][token_ids]") {
  const cache_config c = layer_config();
  const int h = c.num_kv_heads, d = c.head_dim;
  select::sentence_chunks chunks;
  chunks.boundaries = {{synthetic::comma_token_id, 1.0f}};
  std::vector<std::unique_ptr<layer_cache>> layers;
  layers.push_back(make_layer<cache<format::dense, select::sentence_chunks>>(c, format::dense{}, chunks));
  layers.push_back(make_layer<dense_layer>(c));
  model_cache model(std::move(layers));
  REQUIRE(model.layer(0).needs_token_ids());
  REQUIRE_FALSE(model.layer(1).needs_token_ids());
  const sequence_id seq = model.add_sequence();
  const auto kv = layer_rows(c, 0, 0, 0, 30);
  try {
    model.prefill(0, seq, ref_of(kv.k, 30, h, d), ref_of(kv.v, 30, h, d));
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "token_ids.size()");
    REQUIRE(std::string(e.what()).find("needs token ids") != std::string::npos);
  }
  const std::vector<std::int32_t> ids = test::stream_ids(0, 30);
  const span<const std::int32_t> id_span(ids.data(), 30);
  model.prefill(0, seq, ref_of(kv.k, 30, h, d), ref_of(kv.v, 30, h, d), id_span);
  model.prefill(1, seq, ref_of(kv.k, 30, h, d), ref_of(kv.v, 30, h, d), id_span);  // ignored
  REQUIRE(model.layer(0).length(model.layer_sequence(0, seq)) == 30);
  REQUIRE(model.layer(1).length(model.layer_sequence(1, seq)) == 30);
  const auto row = layer_rows(c, 0, 0, 30, 1);
  const std::int32_t next_id = 7;
  REQUIRE_THROWS_AS(model.append(0, span<const sequence_id>(&seq, 1), ref_of(row.k, 1, h, d), ref_of(row.v, 1, h, d)),
                    invalid_argument);
  model.append(0, span<const sequence_id>(&seq, 1), ref_of(row.k, 1, h, d), ref_of(row.v, 1, h, d),
               span<const std::int32_t>(&next_id, 1));
  REQUIRE(model.length(seq) == 31);
}

TEST_CASE("layer_cache: window votes and a snapkv snapshot as the cache's own, other selectors refuse a snapshot",
          "[model_cache][snapkv]") {
  const cache_config c = layer_config();
  const int h = c.num_kv_heads, d = c.head_dim, n = 300, window = 16;
  select::snapkv snap;
  snap.budget.tokens = 120;
  snap.window = window;
  using snapkv_layer = cache<format::dense, select::snapkv, compact::repack>;
  std::vector<std::unique_ptr<layer_cache>> layers;
  layers.push_back(make_layer<snapkv_layer>(c, format::dense{}, snap));
  layers.push_back(make_layer<dense_layer>(c));
  model_cache model(std::move(layers));
  snapkv_layer direct(c, format::dense{}, snap);
  const sequence_id seq = model.add_sequence(), one = direct.add_sequence();
  const auto kv = layer_rows(c, 0, 0, 0, n);
  for (int layer = 0; layer < 2; ++layer) model.prefill(layer, seq, ref_of(kv.k, n, h, d), ref_of(kv.v, n, h, d));
  direct.prefill(one, tensor_view<const float, 3>(kv.k.data(), n, h, d), tensor_view<const float, 3>(kv.v.data(), n, h, d));
  std::vector<float> q(static_cast<std::size_t>(window) * c.num_q_heads() * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.23f * static_cast<float>(i));
  const tensor_view<const float, 3> queries(q.data(), window, c.num_q_heads(), d);
  // Both layers vote (any cache can), as the cache itself does; only the snapkv layer snapshots.
  const std::vector<double> votes = direct.window_votes(one, queries);
  REQUIRE(model.layer(0).window_votes(model.layer_sequence(0, seq), tensor_ref<3>::of(queries)) == votes);
  REQUIRE(model.layer(1).window_votes(model.layer_sequence(1, seq), tensor_ref<3>::of(queries)) == votes);
  try {
    model.snapshot(1, seq, tensor_ref<3>::of(queries));
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "the layer's selector");
    REQUIRE(std::string(e.what()).find("select::snapkv") != std::string::npos);
  }
  REQUIRE(model.layer(1).length(model.layer_sequence(1, seq)) == n);  // nothing changed
  const std::int64_t evicted = direct.snapshot(one, queries);
  REQUIRE(evicted == n - 120);
  REQUIRE(model.snapshot(0, seq, tensor_ref<3>::of(queries)) == evicted);
  REQUIRE(model.layer(0).stored_tokens(model.layer_sequence(0, seq)) == direct.stored_tokens(one));
  REQUIRE(model.layer(0).memory().pages_used == direct.memory().pages_used);
}

TEST_CASE("model_cache rejects bad layers and layer indices, naming the parameter", "[model_cache][errors]") {
  REQUIRE_THROWS_AS(model_cache(std::vector<std::unique_ptr<layer_cache>>{}), invalid_argument);
  std::vector<std::unique_ptr<layer_cache>> with_null;
  with_null.push_back(make_layer<dense_layer>(layer_config()));
  with_null.push_back(nullptr);
  try {
    model_cache m(std::move(with_null));
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "layers[i]");
    REQUIRE(std::string(e.what()).find("i = 1") != std::string::npos);
  }
  direct_and_model t(layer_config());
  const sequence_id seq = t.model.add_sequence();
  for (const int bad : {-1, 3}) {
    REQUIRE_THROWS_AS(t.model.layer(bad), invalid_argument);
    REQUIRE_THROWS_AS(t.model.layer_sequence(bad, seq), invalid_argument);
    std::vector<float> k(64 * 2);
    REQUIRE_THROWS_AS(t.model.prefill(bad, seq, ref_of(k, 1, 2, 64), ref_of(k, 1, 2, 64)), invalid_argument);
  }
  // A layer's own checks come through with its message: wrong extents.
  std::vector<float> k(3 * 64);
  try {
    t.model.prefill(0, seq, ref_of(k, 1, 3, 64), ref_of(k, 1, 3, 64));
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    REQUIRE(e.parameter() == "k.extent(1) (kv heads)");
  }
  // The typed cache behind a layer.
  auto& typed = dynamic_cast<layer_cache_of<dense_layer>&>(t.model.layer(0));
  REQUIRE(typed.get().length(t.model.layer_sequence(0, seq)) == 0);
}

TEST_CASE("model_cache: plan then run (with log-sum-exp) is attend; reserve_step reaches every layer", "[model_cache]") {
  const cache_config c = layer_config();
  direct_and_model t(c);
  const int h = c.num_kv_heads, d = c.head_dim, hq = c.num_q_heads();
  std::vector<sequence_id> seqs;
  for (const int length : {130, 20}) {
    const sequence_id id = t.model.add_sequence();
    for (int layer = 0; layer < 3; ++layer) {
      const auto kv = layer_rows(c, layer, seqs.size(), 0, length);
      t.model.prefill(layer, id, ref_of(kv.k, length, h, d), ref_of(kv.v, length, h, d));
    }
    seqs.push_back(id);
  }
  t.model.reserve_step(2, 1024);
  const span<const sequence_id> ids(seqs.data(), 2);
  for (int layer = 0; layer < 3; ++layer) {
    CAPTURE(layer);
    std::vector<float> q;
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto one = synthetic::generate_query(test::generator_for(c, 100 + static_cast<std::uint64_t>(layer)), b, 200);
      q.insert(q.end(), one.begin(), one.end());
    }
    std::vector<float> by_attend(q.size()), by_run(q.size()), lse(2 * static_cast<std::size_t>(hq), std::nanf(""));
    t.model.attend(layer, ids, ref_of(q, 2, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_attend.data(), 2, hq, d)));
    t.model.plan(layer, ids);
    t.model.run(layer, ref_of(q, 2, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_run.data(), 2, hq, d)),
                tensor_ref<2>::of(tensor_view<float, 2>(lse.data(), 2, hq)));
    REQUIRE(by_run == by_attend);
    for (const float x : lse) REQUIRE(std::isfinite(x));
    // Without lse (its default), and an lse of the wrong dtype.
    t.model.run(layer, ref_of(q, 2, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_run.data(), 2, hq, d)));
    REQUIRE(by_run == by_attend);
    std::vector<half> lse16(lse.size());
    try {
      t.model.run(layer, ref_of(q, 2, hq, d), tensor_ref<3>::of(tensor_view<float, 3>(by_run.data(), 2, hq, d)),
                  tensor_ref<2>::of(tensor_view<half, 2>(lse16.data(), 2, hq)));
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      REQUIRE(e.parameter() == "lse.type");
    }
  }
  REQUIRE_THROWS_AS(t.model.run(3, tensor_ref<3>{}, tensor_ref<3>{}), invalid_argument);
}
