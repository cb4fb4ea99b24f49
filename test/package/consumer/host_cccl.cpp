// Compiled by the host C++ compiler: <thrust/version.h> is found only through CCCL::CCCL, which
// kvmosaic's package config adds to kvmosaic::kvmosaic when the consumer has CUDA enabled.
// SPDX-License-Identifier: Apache-2.0
#include <thrust/version.h>

int host_thrust_version() { return THRUST_VERSION; }
