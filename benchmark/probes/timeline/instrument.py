#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Probe (not part of the library or its build): builds a copy of bench_decode whose kernels stamp
a per-CTA timeline (timeline.cuh says what each event is).

    python3 benchmark/probes/timeline/instrument.py /tmp/timeline          # copies and patches
    cd /tmp/timeline && nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -DKVMOSAIC_BENCH_ONE_SHAPE \\
        -Xcompiler -fopenmp -isystem /usr/include/eigen3 -Iinclude -Ibenchmark \\
        -o bench_timeline benchmark/bench_decode.cu -lbenchmark -lpthread -lcuda -lgomp
    KVMOSAIC_TIMELINE=out/t ./bench_timeline --benchmark_filter=...   # on the GPU
    python3 benchmark/probes/timeline/analyze.py out/t.step_*.1.csv

With KVMOSAIC_TIMELINE set, each benchmark run records three more replays of its step (and of
its selection alone, for a selector) after its timing loop, each as
<prefix>.<step|select>_<batch>_<context>_<budget inverse>_<run>.<replay>.csv: a row per CTA. The
reference time is the end of the busy-wait kernel that precedes every timed replay; the graph's
first kernel starts a launch latency after it. The stamps add an atomic per CTA, so compare times
within one such run, not with the benchmark's own timings.

Only the copy is patched; nothing here changes the repository. Stamps of your own go in the copy,
after this script: `kvmosaic::cuda::detail::tl_mark(event)` with a free event (4-8, 10-15).
"""
import pathlib
import re
import shutil
import sys


def replace_once(text, old, new, where):
    if text.count(old) != 1:
        sys.exit(f"instrument.py: {where}: expected one '{old[:60]}...', found {text.count(old)}")
    return text.replace(old, new)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    here = pathlib.Path(__file__).resolve().parent
    repo = here.parents[2]
    out = pathlib.Path(sys.argv[1])
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(repo / "include", out / "include")
    shutil.copytree(repo / "benchmark", out / "benchmark", ignore=shutil.ignore_patterns("results"))
    cuda = out / "include" / "kvmosaic" / "cuda"
    shutil.copy(here / "timeline.cuh", cuda / "detail" / "timeline.cuh")
    include = '#include "kvmosaic/cuda/detail/timeline.cuh"\n'

    # Every kernel opens a scope at its first line.
    kernels = 0
    for path in sorted(cuda.rglob("*.cuh")):
        if path.name == "timeline.cuh":
            continue
        text = path.read_text()
        if "__global__" not in text:
            continue
        pieces, at = [], 0
        for match in re.finditer(r"__global__", text):
            line_start = text.rfind("\n", 0, match.start()) + 1
            if match.start() < at or text[line_start:match.start()].lstrip().startswith("//"):
                continue  # inside a kernel already patched, or a comment
            body = text.find(") {\n", match.start())
            pieces.append(text[at:body + 4])
            pieces.append("  ::kvmosaic::cuda::detail::tl_scope kvmosaic_timeline_scope;\n")
            at = body + 4
            kernels += 1
        pieces.append(text[at:])
        text = "".join(pieces)
        text = replace_once(text, "#pragma once\n", "#pragma once\n" + include, path.name)
        path.write_text(text)

    # The programmatic-dependent-launch calls stamp events 1, 2 (around the wait) and 3.
    path = cuda / "detail" / "dependent_launch.cuh"
    text = path.read_text()
    text = replace_once(text, '#include "kvmosaic/cuda/error.cuh"\n', '#include "kvmosaic/cuda/error.cuh"\n' + include, path.name)
    text = replace_once(text, "void wait_for_prior_grid() {\n", "void wait_for_prior_grid() {\n  tl_mark(1);\n", path.name)
    text = replace_once(text, '  asm volatile("griddepcontrol.wait;" ::: "memory");\n#endif\n',
                        '  asm volatile("griddepcontrol.wait;" ::: "memory");\n#endif\n  tl_mark(2);\n', path.name)
    text = replace_once(text, "void allow_dependent_grids() {\n", "void allow_dependent_grids() {\n  tl_mark(3);\n", path.name)
    path.write_text(text)

    # The busy-wait before each timed replay is the reference (its exit).
    path = out / "benchmark" / "timing.cuh"
    text = path.read_text()
    text = replace_once(text, "__global__ void busy_wait_kernel(unsigned long long ns) {\n",
                        "__global__ void busy_wait_kernel(unsigned long long ns) {\n"
                        "  ::kvmosaic::cuda::detail::tl_scope kvmosaic_timeline_scope;\n", path.name)
    path.write_text(text)

    # bench_decode records three replays after its timing loop.
    path = out / "benchmark" / "bench_decode.cu"
    text = path.read_text()
    dump = r'''
// Timeline probe (benchmark/probes/timeline): three replays of `graph`, each CTA's stamps to CSV.
static int timeline_runs = 0;
static void record_timeline(const std::string& tag, cudaGraphExec_t graph, cudaStream_t stream, l2_flusher& flusher,
                            event_timer& timer) {
  const char* prefix = std::getenv("KVMOSAIC_TIMELINE");
  if (prefix == nullptr) return;
  using kvmosaic::cuda::detail::tl_record;
  for (int replay = 0; replay < 3; ++replay) {
    const unsigned zero = 0;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    KVMOSAIC_CUDA_CHECK(cudaMemcpyToSymbol(kvmosaic::cuda::detail::tl_count, &zero, sizeof zero));
    const double seconds = timed_replay(graph, stream, flusher, timer);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream));
    unsigned count = 0;
    KVMOSAIC_CUDA_CHECK(cudaMemcpyFromSymbol(&count, kvmosaic::cuda::detail::tl_count, sizeof count));
    count = std::min(count, kvmosaic::cuda::detail::tl_capacity);
    std::vector<tl_record> records(count);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyFromSymbol(records.data(), kvmosaic::cuda::detail::tl_log, count * sizeof(tl_record)));
    const std::string path = std::string(prefix) + "." + tag + "." + std::to_string(replay) + ".csv";
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return;
    std::fprintf(f, "# replay_us=%.2f\nsmid,grid_x,grid_yz,block,threads", seconds * 1e6);
    for (int k = 0; k < 16; ++k) std::fprintf(f, ",t%d", k);
    std::fprintf(f, "\n");
    for (const tl_record& r : records) {
      std::fprintf(f, "%u,%u,%u,%u,%u", r.smid, r.grid_x, r.grid_yz, r.block, r.threads);
      for (int k = 0; k < 16; ++k) std::fprintf(f, ",%llu", r.t[k]);
      std::fprintf(f, "\n");
    }
    std::fclose(f);
  }
}

'''
    anchor = "template <class Format, class Selector"
    at = text.find(anchor)
    if at < 0:
        sys.exit("instrument.py: bench_decode.cu: no benchmark template")
    text = text[:at] + dump + text[at:]
    text = replace_once(
        text, "  KVMOSAIC_CUDA_CHECK(cudaGetLastError());\n  if constexpr (selects) {",
        "  KVMOSAIC_CUDA_CHECK(cudaGetLastError());\n"
        "  const std::string timeline_tag = std::to_string(batch) + \"_\" + std::to_string(context) + \"_\" +\n"
        "                                   std::to_string(selects ? state.range(5) : 0) + \"_\" + std::to_string(timeline_runs++);\n"
        "  record_timeline(\"step_\" + timeline_tag, step, stream, flusher, timer);\n"
        "  if constexpr (selects) {", "bench_decode.cu")
    text = replace_once(text, '    state.counters["select_us"] = median(select_times) * 1e6;\n',
                        '    state.counters["select_us"] = median(select_times) * 1e6;\n'
                        '    record_timeline("select_" + timeline_tag, select_step, stream, flusher, timer);\n', "bench_decode.cu")
    path.write_text(text)
    print(f"{out}: {kernels} kernels instrumented")


if __name__ == "__main__":
    main()
