// kvmosaic test runner: Catch2 v2 provides main() for kvmosaic_tests and kvmosaic_gpu_tests.
// SPDX-License-Identifier: Apache-2.0
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
