// SPDX-License-Identifier: Apache-2.0
// kvmosaic in Compiler Explorer, 3 of 3: a wrong policy combination fails with one sentence.
//
//   Language:  C++
//   Compiler:  x86-64 gcc 12.2 (or newer)
//   Flags:     -std=c++17 -O2
//   Libraries: Eigen 3.4.0
//   Output:    this program must not compile; the compiler's Output pane shows the error
//   Header:    the #include below; replace OWNER/REPO with kvmosaic's GitHub path
//              (README.md, "Try it in Compiler Explorer")
//
// kvmosaic::cache<Format, Selector, Compactor, Backend> first checks that each argument is a
// policy of the kind its position takes. Below, the selector and the compactor are swapped; the
// first error names the position and what belongs there:
//
//   error: static assertion failed: kvmosaic::cache: the second template argument (Selector) must
//          be a selector, e.g. kvmosaic::select::all
//
// The third argument's assertion follows, and nothing else: the cache compiles the rest of its
// body against defaults, so each misplaced policy gives one sentence. The repository's tests
// compile this file and require that it fails with the first message:
// EXPECT: kvmosaic::cache: the second template argument \(Selector\) must be a selector, e\.g\. kvmosaic::select::all
#include <https://raw.githubusercontent.com/OWNER/REPO/main/single_include/kvmosaic/kvmosaic.hpp>

int main() {
  namespace kv = kvmosaic;
  kv::cache<kv::format::quant2, kv::compact::none, kv::select::quest> cache(kv::cache_config{});
  // right: kv::cache<kv::format::quant2, kv::select::quest, kv::compact::none>
  return 0;
}
