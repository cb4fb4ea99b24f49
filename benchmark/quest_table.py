#!/usr/bin/env python3
"""Markdown table of the read-less selector rows of bench_decode (select::quest, sentence_chunks) next to
our dense decode and PyTorch SDPA.

  quest_table.py bench_decode.json sdpa.json

Per selector row (`<format>_quest_decode`, `dense_quest_blocks_decode`, `dense_chunks_decode`): the whole selected step (metadata copy, scoring, top-k, attention
over the chosen pages, merge) in µs, the scoring and top-k alone (select_us, with the metadata
copy), the same format's select::all step and our dense step at that shape, and PyTorch's best SDPA
backend; ratios above 1 mean the selected step is faster. Every number must come from one run.
SPDX-License-Identifier: Apache-2.0
"""

import json
import sys


def main():
    bench = json.load(open(sys.argv[1]))["benchmarks"]
    sdpa = json.load(open(sys.argv[2]))
    best = {(r["batch"], r["context"]): r for r in sdpa["best"]}
    plain = {}
    for b in bench:
        family = b["name"].split("/")[0]
        if family in ("dense_decode", "bitmap_tiles_decode", "quant2_decode"):
            plain[(family.replace("_decode", ""), int(b["batch"]), int(b["context"]))] = b["time_us"]
    print("| Format | Selector | Budget | Shape | pages read | step µs | of which select µs | same format, all µs "
          "| speedup | our dense µs | vs our dense | PyTorch µs | vs PyTorch |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in bench:
        if "select_us" not in b:
            continue
        name = b["name"].split("/")[0]
        family = next(f for f in ("bitmap_tiles", "quant2", "dense") if name.startswith(f))
        batch, context = int(b["batch"]), int(b["context"])
        dense = plain.get(("dense", batch, context))
        same = plain.get((family, batch, context))
        torch = best.get((batch, context))
        label = {"dense": "dense", "bitmap_tiles": "bitmap_tiles s=0.7", "quant2": "quant2 Pi=64"}[family]
        if int(b.get("page", 64)) != 64:
            label += ", pages of %d" % int(b["page"])
        if "_chunks_" in name:
            selector = "sentence_chunks"
        elif int(b.get("block", 0)) not in (0, int(b.get("page", 64))):
            selector = "quest, blocks of %d" % int(b["block"])
        else:
            selector = "quest"
        pages = "%.1f%%" % (100 * b["pages_read"]) if "pages_read" in b else "–"
        cells = [label, selector, "1/%d" % round(1 / b["budget"]), "B=%d, S=%dK" % (batch, context // 1024), pages,
                 "%.1f" % b["time_us"], "%.1f" % b["select_us"],
                 "%.1f" % same if same else "–", "%.2f×" % (same / b["time_us"]) if same else "–",
                 "%.1f" % dense if dense else "–", "**%.2f×**" % (dense / b["time_us"]) if dense else "–",
                 "%.1f" % torch["time_us"] if torch else "–", "%.2f×" % (torch["time_us"] / b["time_us"]) if torch else "–"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
