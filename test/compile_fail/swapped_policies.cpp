// Policies in the wrong positions are named in the error.
// EXPECT: the second template argument \(Selector\) must be a selector
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<kvmosaic::format::dense, kvmosaic::compact::none, kvmosaic::select::all> c(kvmosaic::cache_config{});
  return 0;
}
