// select::all reads every token: asking it for a budget or a selection fails to compile.
// EXPECT: set_budget: select::all has no budget
#include <kvmosaic/kvmosaic.hpp>
int main() {
  kvmosaic::cache<kvmosaic::format::dense> c(kvmosaic::cache_config{});
  c.set_budget(kvmosaic::select::token_budget{});
}
