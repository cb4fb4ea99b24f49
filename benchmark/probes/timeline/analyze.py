#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Probe (not part of the library or its build): summarizes the per-CTA timelines that
instrument.py's bench_decode writes.

    python3 analyze.py FILE.csv[.xz] [FILE.csv[.xz] ...] [--phases 2-4,4-5,...]

For each file: the kernels in the order their first CTA started (a kernel is its grid and block
size), and for each its CTAs' stamps, min / median / max in microseconds after the reference
(the end of the busy-wait kernel before the replay): event 0 entry, 1 and 2 around the wait for
the prior grid, 3 letting dependents launch, 9 exit, others stamped by hand. `--phases a-b,...`
adds, for every kernel that stamps both, the quantiles of t_b - t_a per CTA (CTAs that exit
without a stamp are left out of a phase).
"""
import lzma
import sys


def quantiles(values):
    values = sorted(values)
    return f"{values[0]:7.2f} {values[len(values) // 2]:7.2f} {values[-1]:7.2f}"


def summarize(path, phases):
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        replay = f.readline().strip()
        header = f.readline().strip().split(",")
        rows = [list(map(int, line.split(","))) for line in f if line.strip()]
    stamps = header.index("t0")
    kernels = {}
    reference = None
    for row in rows:
        grid_x, grid_yz, threads = row[1], row[2], row[4]
        times = row[stamps:]
        if grid_x == 1 and grid_yz == 1 and threads == 1 and times[9]:
            reference = times[9]
            continue
        kernels.setdefault((grid_x, grid_yz, threads), []).append(times)
    if reference is None:
        sys.exit(f"{path}: no busy-wait record to measure from")
    print(f"{path} ({replay.lstrip('# ')}); us after the busy-wait's end: min median max")
    for (grid_x, grid_yz, threads), ctas in sorted(kernels.items(), key=lambda kv: min(t[0] for t in kv[1])):
        print(f"  grid {grid_x} x {grid_yz}, {threads} threads, {len(ctas)} CTAs")
        for event in range(16):
            seen = [(t[event] - reference) / 1000 for t in ctas if t[event]]
            if seen:
                print(f"    event {event:2d} ({len(seen):5d} CTAs): {quantiles(seen)}")
        for first, last in phases:
            spans = [(t[last] - t[first]) / 1000 for t in ctas if t[first] and t[last]]
            if spans:
                print(f"    phase {first:2d} -> {last:2d} ({len(spans):5d} CTAs): {quantiles(spans)}")


def main():
    args, phases = [], []
    it = iter(sys.argv[1:])
    for arg in it:
        if arg == "--phases":
            phases = [tuple(map(int, p.split("-"))) for p in next(it).split(",")]
        else:
            args.append(arg)
    if not args:
        sys.exit(__doc__)
    for path in args:
        summarize(path, phases)


if __name__ == "__main__":
    main()
