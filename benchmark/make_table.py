#!/usr/bin/env python3
"""Markdown table of kvmosaic's decode benchmarks next to PyTorch SDPA (benchmark/sdpa_baseline.py).

Inputs are JSON files, recognised by their content, so `make_table.py OUT/*.json` works:
  * Google Benchmark output (--benchmark_out_format=json; also the merged bench_all.json written by
    scripts/device/run-gpu-suite.sh): a "benchmarks" list.
  * sdpa_baseline.py output: has "hbm_read_gbps" and "results"/"best". The last one given wins.
  * anything else (demo.json, ...) is ignored with a note on stderr.

Benchmark names are read as `<family>/<key>:<value>/...`, e.g.
`dense_decode/batch:8/context:131072/format:int4/manual_time`. batch and context (also b/bs,
ctx/seq/seq_len/tokens) and hq/hkv/head_dim join a row to PyTorch's best backend for that shape; the
other key:value parts (format, sparsity, ...) form the Config column. Google Benchmark's own parts
(real_time, manual_time, iterations:N, repeats:N, threads:N, min_time:X) are dropped; unnamed
numeric arguments become arg0, arg1, ...
Values per row: the "median" aggregate when repetitions were run (else "mean", else the median of
the iterations); time from a counter named like time_us (else real_time in its time_unit); GB/s from
a GBps-like counter (else bytes / time, else bytes_per_second); % of HBM from a fraction_of_hbm-like
counter (else GB/s divided by the HBM read bandwidth that sdpa_baseline.py measured, marked with *).
The last column is PyTorch's time divided by ours: above 1 means kvmosaic is faster.

  make_table.py [--sdpa sdpa.json] [--filter REGEX] [--out FILE] [--update-readme README.md] FILES...

--update-readme replaces what stands between the lines `<!-- table:begin -->` and
`<!-- table:end -->` of that file (the markers stay). Without --out/--update-readme the table goes
to stdout. SPDX-License-Identifier: Apache-2.0
"""

import argparse
import json
import math
import re
import statistics
import sys

BEGIN_MARK = "<!-- table:begin -->"
END_MARK = "<!-- table:end -->"

# Google Benchmark's fixed fields of a run (everything else numeric is a user counter).
STANDARD_FIELDS = {
    "name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
    "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit",
    "aggregate_name", "aggregate_unit", "label", "error_occurred", "error_message", "executable",
}
# Name parts that Google Benchmark appends by itself: not part of a benchmark's configuration.
GB_NAME_KEYS = {"iterations", "repeats", "threads", "min_time", "min_warmup_time", "threads_per_cpu"}
GB_NAME_FLAGS = {"real_time", "manual_time", "process_time"}

KEY_ALIASES = {
    "batch": ("batch", "b", "bs", "batch_size", "batches"),
    "context": ("context", "ctx", "s", "seq", "seq_len", "seqlen", "tokens", "context_len", "kv_len"),
    "hq": ("hq", "q_heads", "num_heads", "heads", "query_heads"),
    "hkv": ("hkv", "kv_heads", "num_kv_heads"),
    "head_dim": ("head_dim", "d", "dim", "headdim"),
    "group": ("group", "group_size", "gqa_group", "gqa"),
}
SHAPE_KEYS = ("hq", "hkv", "head_dim", "group")   # 0 means "default" in a name: treated as unknown
COUNTER_ALIASES = {
    "time_us": ("time_us", "us", "latency_us", "kernel_us", "decode_us"),
    "bytes": ("bytes", "bytes_read", "bytes_moved", "hbm_bytes"),
    "gbps": ("gbps", "gb_s", "gbs", "gbyteps", "bandwidth_gbps", "bw_gbps"),
    "fraction_of_hbm": ("fraction_of_hbm", "hbm_fraction", "frac_hbm", "of_hbm", "hbm_frac", "fraction_hbm",
                        "pct_hbm", "percent_of_hbm", "hbm_pct", "hbm_percent"),
}
TIME_UNIT_TO_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def norm(key):
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def to_number(text):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_name(name):
    """'fam/batch:8/context:4096/format:int4/manual_time' -> ('fam', {'batch': 8, ...})."""
    parts = name.split("/")
    family, params, positional = parts[0], {}, 0
    for part in parts[1:]:
        if not part:
            continue
        if ":" in part:
            key, value = part.split(":", 1)
            if norm(key) in GB_NAME_KEYS:
                continue
            params[key] = to_number(value)
        elif part in GB_NAME_FLAGS:
            continue
        else:
            params["arg%d" % positional] = to_number(part)
            positional += 1
    return family, params


def lookup(mapping, aliases):
    """First value in mapping whose normalised key is one of aliases; returns (key, value)."""
    normalised = {norm(k): k for k in mapping}
    for alias in aliases:
        if alias in normalised:
            key = normalised[alias]
            return key, mapping[key]
    return None, None


def numeric_fields(entry):
    return {k: v for k, v in entry.items()
            if k not in STANDARD_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def pick_runs(benchmarks):
    """One representative entry per run: median aggregate > mean aggregate > median of iterations."""
    order, groups = [], {}
    for b in benchmarks:
        run = b.get("run_name") or b.get("name", "")
        if "executable" in b:
            run = b["executable"] + "\0" + run
        if run not in groups:
            order.append(run)
            groups[run] = []
        groups[run].append(b)
    picked = []
    for run in order:
        entries = groups[run]
        errors = [e for e in entries if e.get("error_occurred")]
        if errors:
            picked.append(errors[0])
            continue
        aggregates = {e.get("aggregate_name"): e for e in entries if e.get("run_type") == "aggregate"}
        chosen = aggregates.get("median") or aggregates.get("mean")
        if chosen is None:
            iterations = [e for e in entries if e.get("run_type", "iteration") == "iteration"]
            if not iterations:
                continue
            chosen = dict(iterations[0])
            if len(iterations) > 1:
                for key in set(numeric_fields(iterations[0])) | {"real_time", "cpu_time"}:
                    values = [e[key] for e in iterations if isinstance(e.get(key), (int, float))]
                    if values:
                        chosen[key] = statistics.median(values)
        picked.append(chosen)
    return picked


def row_from_entry(entry):
    name = entry.get("run_name") or entry.get("name", "")
    family, params = parse_name(name)
    counters = numeric_fields(entry)
    row = {"name": name, "family": family, "executable": entry.get("executable")}
    if entry.get("error_occurred"):
        row["error"] = entry.get("error_message") or "error"

    # Shape keys: from the name, else from counters of the same name.
    config = dict(params)
    for canon, aliases in KEY_ALIASES.items():
        key, value = lookup(config, aliases)
        if key is not None:
            config.pop(key)
        else:
            _, value = lookup(counters, aliases)
        if isinstance(value, (int, float)) and float(value).is_integer():
            value = int(value)
        if canon in SHAPE_KEYS and value == 0:
            value = None
        row[canon] = value
    if row["group"] is None and isinstance(row["hq"], int) and isinstance(row["hkv"], int) and row["hkv"]:
        row["group"] = row["hq"] // row["hkv"]
    row["config"] = config

    _, time_us = lookup(counters, COUNTER_ALIASES["time_us"])
    if time_us is None and isinstance(entry.get("real_time"), (int, float)):
        time_us = entry["real_time"] * TIME_UNIT_TO_US.get(entry.get("time_unit", "ns"), 1e-3)
    row["time_us"] = time_us
    _, nbytes = lookup(counters, COUNTER_ALIASES["bytes"])
    row["bytes"] = nbytes
    _, gbps = lookup(counters, COUNTER_ALIASES["gbps"])
    if gbps is None and nbytes and time_us:
        gbps = nbytes / (time_us * 1e-6) / 1e9
    if gbps is None and counters.get("bytes_per_second"):
        gbps = counters["bytes_per_second"] / 1e9
    row["gbps"] = gbps
    key, frac = lookup(counters, COUNTER_ALIASES["fraction_of_hbm"])
    if frac is not None and ("pct" in norm(key) or "percent" in norm(key)):
        frac = frac / 100.0
    row["fraction_of_hbm"] = frac
    return row


def load_inputs(paths, sdpa_path):
    rows, sdpa = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "benchmarks" in data:
            rows.extend(row_from_entry(e) for e in pick_runs(data["benchmarks"]))
        elif isinstance(data, dict) and "hbm_read_gbps" in data and ("best" in data or "results" in data):
            sdpa = data
        else:
            print("make_table: %s: neither Google Benchmark nor sdpa_baseline JSON; ignored" % path,
                  file=sys.stderr)
    if sdpa_path:
        with open(sdpa_path) as f:
            sdpa = json.load(f)
    return rows, sdpa


def sdpa_best(sdpa):
    """[(batch, context, hq, hkv, head_dim) -> best entry] from 'best', or computed from 'results'."""
    best = {}
    entries = (sdpa or {}).get("best") or (sdpa or {}).get("results") or []
    for e in entries:
        if e.get("time_us") is None:
            continue
        key = (e.get("batch"), e.get("context"), e.get("hq"), e.get("hkv"), e.get("head_dim"))
        if key not in best or e["time_us"] < best[key]["time_us"]:
            best[key] = e
    return best


def match_sdpa(best, row):
    candidates = []
    for (b, s, hq, hkv, d), e in best.items():
        if b != row["batch"] or s != row["context"]:
            continue
        group = hq // hkv if isinstance(hq, int) and isinstance(hkv, int) and hkv else None
        if any(row[k] is not None and v is not None and row[k] != v
               for k, v in (("hq", hq), ("hkv", hkv), ("head_dim", d), ("group", group))):
            continue
        candidates.append(e)
    return min(candidates, key=lambda e: e["time_us"]) if candidates else None


def fmt_tokens(n):
    if not isinstance(n, int):
        return "?" if n is None else str(n)
    if n >= 1024 and n % (1024 * 1024) == 0:
        return "%dM" % (n // (1024 * 1024))
    if n >= 1024 and n % 1024 == 0:
        return "%dK" % (n // 1024)
    return str(n)


def fmt(value, spec):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return spec % value


def shape_text(row):
    batch = row.get("batch")
    if batch is None and row.get("context") is None:
        return "–"
    text = "B=%s, S=%s" % ("?" if batch is None else batch, fmt_tokens(row.get("context")))
    if row.get("hq") is not None or row.get("hkv") is not None:
        text += ", %s/%s heads" % (row.get("hq") or "?", row.get("hkv") or "?")
    elif row.get("group") is not None:
        text += ", group %s" % row["group"]
    if row.get("head_dim") is not None:
        text += ", D=%s" % row["head_dim"]
    return text


def backend_text(e):
    text = e.get("backend", "?")
    if e.get("gqa") == "expanded":
        text += " (K/V expanded)"
    return text


def build_table(rows, sdpa):
    hbm = (sdpa or {}).get("hbm_read_gbps")
    best = sdpa_best(sdpa)
    lines = []
    if sdpa:
        lines.append("%s; PyTorch %s; HBM streaming read %s GB/s (measured by sdpa_baseline.py). "
                     "PyTorch: best SDPA backend, bf16, GQA %s/%s heads, D=%s." % (
                         sdpa.get("device", "unknown GPU"), sdpa.get("torch", "?"), fmt(hbm, "%.0f"),
                         (sdpa.get("results") or [{}])[0].get("hq", "?"),
                         (sdpa.get("results") or [{}])[0].get("hkv", "?"),
                         (sdpa.get("results") or [{}])[0].get("head_dim", "?")))
        lines.append("")

    if not rows:   # PyTorch-only table
        lines.append("| Shape | PyTorch best | PyTorch µs | GB/s | % of HBM |")
        lines.append("| --- | --- | ---: | ---: | ---: |")
        for e in sorted(best.values(), key=lambda e: (e.get("batch") or 0, e.get("context") or 0)):
            lines.append("| %s | %s | %s | %s | %s |" % (
                shape_text({"batch": e.get("batch"), "context": e.get("context")}), backend_text(e),
                fmt(e.get("time_us"), "%.1f"), fmt(e.get("gbps"), "%.0f"),
                fmt(None if e.get("fraction_of_hbm") is None else 100 * e["fraction_of_hbm"], "%.1f%%")))
        return "\n".join(lines) + "\n"

    show_exe = len({r["executable"] for r in rows}) > 1
    any_derived = False
    # Our dense decode of the same shape (families named dense_decode*, not the selections over
    # dense pages such as dense_quest_decode): the speedup of every other row.
    dense = {}
    for r in rows:
        if r["family"].startswith("dense_decode") and r["time_us"]:
            dense[(r["batch"], r["context"], r["group"], r["head_dim"])] = r["time_us"]
    lines.append("| Benchmark | Config | Shape | ours µs | ours GB/s | % of HBM | our dense / ours | PyTorch best "
                 "| PyTorch µs | PyTorch / ours |")
    lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        bench = r["family"] if not show_exe or not r["executable"] else "%s: %s" % (r["executable"], r["family"])
        config = ", ".join("%s=%s" % kv for kv in r["config"].items()
                           if not (kv[0] == "sparsity" and kv[1] == 0)) or "–"
        if r.get("error"):
            lines.append("| %s | %s | %s | error: %s | | | | | | |" % (bench, config, shape_text(r),
                                                                   r["error"].replace("|", "/")))
            continue
        frac = r["fraction_of_hbm"]
        derived = ""
        if frac is None and r["gbps"] is not None and hbm:
            frac, derived = r["gbps"] / hbm, "*"
            any_derived = True
        e = match_sdpa(best, r)
        ratio = None
        if e is not None and r["time_us"]:
            ratio = e["time_us"] / r["time_us"]
        dense_us = dense.get((r["batch"], r["context"], r["group"], r["head_dim"]))
        vs_dense = dense_us / r["time_us"] if dense_us and r["time_us"] and not r["family"].startswith("dense_decode") else None
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            bench, config, shape_text(r), fmt(r["time_us"], "%.1f"), fmt(r["gbps"], "%.0f"),
            fmt(None if frac is None else 100 * frac, "%.1f%%") + derived, fmt(vs_dense, "%.2f×"),
            backend_text(e) if e else "–", fmt(e["time_us"] if e else None, "%.1f"), fmt(ratio, "%.2f×")))
    if any_derived:
        lines.append("")
        lines.append("\\* % of HBM relative to the HBM read bandwidth measured by sdpa_baseline.py.")
    return "\n".join(lines) + "\n"


def update_readme(path, table):
    with open(path) as f:
        text = f.read()
    begin = text.find(BEGIN_MARK)
    end = text.find(END_MARK, begin + len(BEGIN_MARK)) if begin >= 0 else -1
    if begin < 0 or end < 0:
        raise SystemExit("make_table: %s has no %s ... %s markers" % (path, BEGIN_MARK, END_MARK))
    head = text[:begin + len(BEGIN_MARK)]
    new = head + "\n" + table.rstrip("\n") + "\n" + text[end:]
    with open(path, "w") as f:
        f.write(new)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="Google Benchmark JSON files (and/or sdpa.json)")
    p.add_argument("--sdpa", help="sdpa_baseline.py JSON (may also be given among FILES)")
    p.add_argument("--filter", help="only benchmarks whose name matches this regular expression")
    p.add_argument("--out", help="write the table to this file")
    p.add_argument("--update-readme", metavar="FILE",
                   help="replace the text between %s and %s in FILE" % (BEGIN_MARK, END_MARK))
    args = p.parse_args(argv)
    if not args.files and not args.sdpa:
        p.error("no input files")

    rows, sdpa = load_inputs(args.files, args.sdpa)
    if args.filter:
        rows = [r for r in rows if re.search(args.filter, r["name"])]
    if not rows and not sdpa:
        raise SystemExit("make_table: no benchmark rows and no sdpa_baseline results")
    table = build_table(rows, sdpa)

    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    if args.update_readme:
        update_readme(args.update_readme, table)
        print("make_table: updated %s (%d rows)" % (args.update_readme, len(rows)), file=sys.stderr)
    if not args.out and not args.update_readme:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
