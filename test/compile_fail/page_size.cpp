// A page size that is not a multiple of 16 is rejected at compile time when the shape is a type.
// EXPECT: kvmosaic: page_size must be a multiple of 16
#include <kvmosaic/kvmosaic.hpp>
int main() { return kvmosaic::static_shape<128, 4, 40>::page_size; }
