// SPDX-License-Identifier: Apache-2.0
// bench_decode.cu's functions without its rows: a developer driver includes this file, registers
// only the rows it times (benchmark::RegisterBenchmark), and so compiles only their kernels, in a
// minute instead of the whole benchmark's build. The drivers kept with results under results/
// include it; build one with
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DKVMOSAIC_BENCH_ONE_SHAPE -Iinclude -Ibenchmark \
//        -isystem /usr/include/eigen3 -o <binary> <driver.cu> -lbenchmark -lpthread -lcuda
#pragma once

#include <benchmark/benchmark.h>

#include <initializer_list>
#include <vector>

namespace kvmosaic_bench {
/// Takes the place of a BENCHMARK(...) registration chain: every call does nothing.
struct unregistered_row {
  template <class... A>
  unregistered_row* Name(A&&...) { return this; }
  unregistered_row* ArgNames(std::initializer_list<const char*>) { return this; }
  unregistered_row* ArgsProduct(std::vector<std::vector<long>>) { return this; }
  unregistered_row* Args(std::vector<long>) { return this; }
  template <class... A>
  unregistered_row* UseManualTime(A&&...) { return this; }
  template <class... A>
  unregistered_row* Iterations(A&&...) { return this; }
  template <class... A>
  unregistered_row* Unit(A&&...) { return this; }
  static unregistered_row* get() {
    static unregistered_row row;
    return &row;
  }
};
}  // namespace kvmosaic_bench

#define KVMOSAIC_BENCH_CAT2(a, b) a##b
#define KVMOSAIC_BENCH_CAT(a, b) KVMOSAIC_BENCH_CAT2(a, b)
#undef BENCHMARK
#define BENCHMARK(...)                                                                       \
  [[maybe_unused]] static kvmosaic_bench::unregistered_row* KVMOSAIC_BENCH_CAT(unregistered_, \
                                                                              __LINE__) = kvmosaic_bench::unregistered_row::get()
#undef BENCHMARK_MAIN
#define BENCHMARK_MAIN()
#include "bench_decode.cu"
/// The driver's main: Google Benchmark over the rows it registered.
#define KVMOSAIC_BENCH_DRIVER_MAIN()           \
  int main(int argc, char** argv) {            \
    benchmark::Initialize(&argc, argv);        \
    benchmark::RunSpecifiedBenchmarks();       \
    benchmark::Shutdown();                     \
  }
