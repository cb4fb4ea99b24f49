// select::sentence_chunks keeps runs of slots, which a compaction would move: a cache that pairs
// it with a compactor that frees memory fails to compile, with one sentence.
// EXPECT: spans are runs of slots \(select::sentence_chunks\)
#include <kvmosaic/kvmosaic.hpp>
int main() {
  using namespace kvmosaic;
  cache<format::dense, select::sentence_chunks, compact::repack> c(cache_config{});
  (void)c;
}
