// select::per_kv_head<S> runs a keep-less selector per KV head; a read-less one already chooses per
// head at each step, so wrapping it fails to compile with a sentence that says so.
// EXPECT: S must be a keep-less selector with a token budget
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<kvmosaic::format::dense, kvmosaic::select::per_kv_head<kvmosaic::select::quest>, kvmosaic::compact::repack> c(
      kvmosaic::cache_config{});
  (void)c;
}
