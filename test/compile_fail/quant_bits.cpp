// A code width without kernels (format::quant<Bits>: 2 or 4) is rejected at compile time.
// EXPECT: format::quant<Bits>: Bits \(the code width\) must be 2 or 4
#include <kvmosaic/kvmosaic.hpp>
int main() { return kvmosaic::format::quant<3>{}.partition; }
