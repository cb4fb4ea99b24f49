// A head_dim without kernels is rejected at compile time when the shape is a type.
// EXPECT: kvmosaic: head_dim must be 64, 128 or 256
#include <kvmosaic/kvmosaic.hpp>
int main() { return kvmosaic::static_shape<96, 4>::head_dim; }
