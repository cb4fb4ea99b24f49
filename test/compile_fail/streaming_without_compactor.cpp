// A keep-less selector evicts tokens for good: with compact::none their pages would never come
// back, so the cache type fails to compile, with one sentence.
// EXPECT: a selector that evicts tokens needs a compactor that frees memory
#include <kvmosaic/kvmosaic.hpp>
int main() {
  using namespace kvmosaic;
  cache<format::dense, select::streaming, compact::none> c(cache_config{});
  (void)c;
}
