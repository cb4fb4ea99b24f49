// Package test: kvmosaic brought in with FetchContent.
// SPDX-License-Identifier: Apache-2.0
#include <kvmosaic/kvmosaic.hpp>

#include <cstdio>
#include <cstring>

int main() {
  const char* version = kvmosaic::version_string();
  std::printf("kvmosaic %s\n", version);
  return std::strcmp(version, EXPECTED_VERSION) == 0 ? 0 : 1;
}
