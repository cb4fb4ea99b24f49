// A type that is not a storage format, in the Format position of a cache, fails with one sentence.
// EXPECT: the first template argument \(Format\) must be a storage format
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<int> c(kvmosaic::cache_config{});
  return 0;
}
