// select::sentence_chunks cuts the stream at boundary tokens: a prefill without the token ids
// fails to compile, naming the overload to call.
// EXPECT: this selector cuts the stream at boundary tokens: pass the token ids
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<kvmosaic::format::dense, kvmosaic::select::sentence_chunks> c(kvmosaic::cache_config{});
  const float rows[128 * 8] = {};
  const kvmosaic::tensor_view<const float, 3> k(rows, 1, 8, 128);
  c.prefill(c.add_sequence(), k, k);
}
