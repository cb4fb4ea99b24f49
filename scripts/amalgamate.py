#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generates kvmosaic's single-file headers from include/.

    python3 scripts/amalgamate.py            # (re)writes single_include/kvmosaic/*
    python3 scripts/amalgamate.py --check    # exit 1 if the committed files differ from the output

single_include/kvmosaic/kvmosaic.hpp  the host part: <kvmosaic/kvmosaic.hpp> and
                                      <kvmosaic/support/synthetic.hpp>; needs a C++17 compiler
                                      and Eigen.
single_include/kvmosaic/kvmosaic.cuh  the same plus the CUDA part, <kvmosaic/kvmosaic.cuh>; needs
                                      nvcc (with the CUDA toolkit's CCCL) and Eigen. It does not
                                      include kvmosaic.hpp: each file stands alone, because
                                      Compiler Explorer fetches one URL per #include line and never
                                      the files that file includes.

Each kvmosaic header is inlined once, at its first #include, after the headers it includes (a
depth-first walk of the #include "kvmosaic/..." lines in the order they appear), so the output
is in dependency order. Every other #include (the standard library, Eigen, the CUDA toolkit,
CUB) stays an #include; one that appears again outside any #if is dropped. Each inlined file
loses its `#pragma once` and its SPDX line; the output has one of each at the top. A kvmosaic
include inside #if/#ifdef is rejected: inlining it unconditionally would change its meaning.

Deterministic: the output depends only on the contents of include/ (no dates, no absolute
paths, no file system order), with "\\n" line ends. Python 3.6+, standard library only.
"""

import argparse
import difflib
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE_DIR = os.path.join(REPO_ROOT, "include")
OUTPUT_DIR = os.path.join(REPO_ROOT, "single_include", "kvmosaic")

# (output file, what it holds (comment lines), root headers under include/, in order)
TARGETS = [
    ("kvmosaic.hpp",
     ["kvmosaic's host part: <kvmosaic/kvmosaic.hpp> (every format, selector and compactor, the host",
      "backend, the fp64 oracle) and <kvmosaic/support/synthetic.hpp> (the synthetic KV generator).",
      "Needs a C++17 compiler and Eigen 3.3 or newer; no CUDA."],
     ["kvmosaic/kvmosaic.hpp", "kvmosaic/support/synthetic.hpp"]),
    ("kvmosaic.cuh",
     ["kvmosaic with its CUDA part: <kvmosaic/kvmosaic.cuh> (the host part, the CUDA backend and its",
      "kernels) and <kvmosaic/support/synthetic.hpp>. Needs nvcc (C++17; the CUDA toolkit's CCCL) and",
      "Eigen 3.3 or newer. Stands alone: include it instead of kvmosaic.hpp, never with it."],
     ["kvmosaic/kvmosaic.cuh", "kvmosaic/support/synthetic.hpp"]),
]

KVMOSAIC_INCLUDE = re.compile(r'^\s*#\s*include\s*["<](kvmosaic/[^">]+)[">]')
ANY_INCLUDE = re.compile(r'^\s*#\s*include\b')
CONDITIONAL_OPEN = re.compile(r'^\s*#\s*if(n?def)?\b')
CONDITIONAL_CLOSE = re.compile(r'^\s*#\s*endif\b')
PRAGMA_ONCE = re.compile(r'^\s*#\s*pragma\s+once\s*$')
SPDX = re.compile(r'^\s*//\s*SPDX-License-Identifier:.*$')


class AmalgamationError(Exception):
    pass


def read_lines(relative):
    path = os.path.join(INCLUDE_DIR, *relative.split("/"))
    if not os.path.isfile(path):
        raise AmalgamationError("include/%s: no such header" % relative)
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    return text.splitlines()


class Amalgamator:
    def __init__(self):
        self.inlined = set()          # kvmosaic headers already emitted (or being emitted)
        self.top_level_includes = set()  # other #include lines already emitted outside any #if
        self.out = []

    def emit_header(self, relative):
        if relative in self.inlined:
            return
        self.inlined.add(relative)
        lines = read_lines(relative)
        if self.out and self.out[-1] != "":
            self.out.append("")
        self.out.append("// ---- begin <%s> ----" % relative)
        begin = len(self.out)
        depth = 0
        for number, line in enumerate(lines, 1):
            if SPDX.match(line) or PRAGMA_ONCE.match(line):
                continue
            if line.strip() == "" and len(self.out) == begin:
                continue  # the blank lines that followed them
            if CONDITIONAL_OPEN.match(line):
                depth += 1
            elif CONDITIONAL_CLOSE.match(line):
                depth -= 1
            match = KVMOSAIC_INCLUDE.match(line)
            if match:
                if depth > 0:
                    raise AmalgamationError(
                        "include/%s:%d: #include <%s> inside #if; the amalgamation cannot inline a "
                        "conditional kvmosaic include" % (relative, number, match.group(1)))
                self.emit_header(match.group(1))
                continue
            if ANY_INCLUDE.match(line) and depth == 0:
                key = " ".join(line.split())
                if key in self.top_level_includes:
                    continue
                self.top_level_includes.add(key)
            self.out.append(line)
        if depth != 0:
            raise AmalgamationError("include/%s: unbalanced #if/#endif" % relative)
        while self.out and self.out[-1] == "":
            self.out.pop()
        self.out.append("// ---- end <%s> ----" % relative)


def generate(name, description, roots):
    amalgamator = Amalgamator()
    for root in roots:
        amalgamator.emit_header(root)
    header = ["// SPDX-License-Identifier: Apache-2.0",
              "//",
              "// single_include/kvmosaic/%s: kvmosaic as one file." % name]
    header += ["// " + line for line in description]
    header += [
        "//",
        "// GENERATED FILE: do not edit. Written by scripts/amalgamate.py from the headers in include/",
        "// (each kvmosaic header inlined once, in dependency order); after changing include/, run",
        "//     python3 scripts/amalgamate.py",
        "// and commit the result (CTest single_include_up_to_date checks that it is current).",
        "#pragma once",
    ]
    return "\n".join(header + [""] + amalgamator.out) + "\n"


def main(argv):
    parser = argparse.ArgumentParser(description="Generates single_include/kvmosaic/ from include/.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed file differs from what would be generated")
    args = parser.parse_args(argv)

    try:
        outputs = [(name, generate(name, description, roots)) for name, description, roots in TARGETS]
    except AmalgamationError as error:
        print("amalgamate.py: error: %s" % error, file=sys.stderr)
        return 2

    stale = []
    for name, text in outputs:
        path = os.path.join(OUTPUT_DIR, name)
        shown = "single_include/kvmosaic/" + name
        current = None
        if os.path.isfile(path):
            with open(path, "rb") as f:
                current = f.read().decode("utf-8", errors="replace")
        if args.check:
            if current is None:
                stale.append(shown)
                print("amalgamate.py: %s is missing" % shown, file=sys.stderr)
            elif current != text:
                stale.append(shown)
                diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                                 "committed/" + shown, "generated/" + shown, n=1, lineterm=""))
                print("amalgamate.py: %s differs from what include/ generates (first lines of the diff):"
                      % shown, file=sys.stderr)
                for line in diff[:20]:
                    print("  " + line, file=sys.stderr)
                if len(diff) > 20:
                    print("  ... (%d more diff lines)" % (len(diff) - 20), file=sys.stderr)
        elif current != text:
            os.makedirs(OUTPUT_DIR, exist_ok=True)
            with open(path, "wb") as f:
                f.write(text.encode("utf-8"))
            print("amalgamate.py: wrote %s (%d lines)" % (shown, text.count("\n")))
        else:
            print("amalgamate.py: %s is up to date" % shown)

    if stale:
        print("amalgamate.py: the single-file headers are out of date with include/; run\n"
              "    python3 scripts/amalgamate.py\n"
              "and commit single_include/", file=sys.stderr)
        return 1
    if args.check:
        print("amalgamate.py: single_include/kvmosaic/ matches include/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
