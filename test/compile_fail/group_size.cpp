// A GQA group larger than 8 is rejected at compile time when the shape is a type.
// EXPECT: kvmosaic: group_size must be 1 to 8
#include <kvmosaic/kvmosaic.hpp>
int main() { return kvmosaic::static_shape<128, 16>::group_size; }
