// evict needs a compactor that frees memory: compact::none would keep the dead tokens' pages.
// EXPECT: evict: this cache's compactor frees no memory
#include <kvmosaic/kvmosaic.hpp>
#include <cstdint>
int main() {
  using namespace kvmosaic;
  cache<format::dense> c(cache_config{});
  const std::int64_t positions[] = {1};
  c.evict(c.add_sequence(), span<const std::int64_t>(positions, 1));
}
