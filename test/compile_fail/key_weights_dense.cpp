// Output-aware K weights exist only for formats that prune K: asking a dense cache fails to compile.
// EXPECT: set_key_weights: this format does not prune K with channel weights
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<kvmosaic::format::dense> c(kvmosaic::cache_config{});
  const float w[1] = {1.0f};
  c.set_key_weights(c.add_sequence(), kvmosaic::tensor_view<const float, 2>(w, 1, 1));
}
