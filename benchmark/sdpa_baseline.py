#!/usr/bin/env python3
"""PyTorch baseline for kvmosaic's decode benchmarks: scaled_dot_product_attention, one query token.

For each shape (GQA: Hq query heads share Hkv K/V heads; bf16; q [B, Hq, 1, D], k/v [B, Hkv, S, D],
contiguous) every SDPA backend that accepts it is timed: cuDNN, Flash, memory-efficient and math
(math only up to --math-max-context tokens). Backends are called with enable_gqa=True; a fused
backend that rejects that is timed again on K/V expanded to Hq heads with repeat_interleave (done
outside the timed region; the result is marked "gqa": "expanded"). Shapes or backends that raise or
run out of memory are skipped and listed under "skipped".

Timing: CUDA events around each call, 3 warm-up calls, then 20 timed calls, each after the L2 cache
is flushed by zeroing a 256 MiB buffer (outside the timed region); the median is reported.
Bytes = K + V (B*Hkv*S*D*2*2, the logical GQA bytes even for "expanded") + q + out; GB/s is decimal
(1e9). The GPU's streaming HBM read bandwidth is measured in the same run (median of 20 full
reductions over a 2 GiB tensor, int64 and fp32 views; the faster one) and reported as
hbm_read_gbps; fraction_of_hbm = gbps / hbm_read_gbps.

Output (--out FILE, JSON; rewritten after every shape so a killed run still leaves results):
  {"device", "torch", "cuda", "cudnn", "hbm_read_gbps", "hbm_read_methods", "method": {...},
   "results": [{"batch", "context", "hq", "hkv", "head_dim", "backend", "gqa", "time_us",
                "time_us_min", "bytes", "gbps", "fraction_of_hbm", "max_abs_diff"}...],
   "best": [{"batch", "context", "hq", "hkv", "head_dim", "backend", "gqa", "time_us", "gbps",
             "fraction_of_hbm"}...],
   "skipped": [{"batch", "context", "backend", "gqa", "reason"}...]}
max_abs_diff: largest |out - out_ref| against the first backend that ran on that shape.

Usage:  python3 benchmark/sdpa_baseline.py --out sdpa.json [--quick] [--shapes 1x4096,8x32768]
Needs only PyTorch with CUDA. SPDX-License-Identifier: Apache-2.0
"""

import argparse
import gc
import json
import math
import statistics
import sys
import time
import warnings

DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_CONTEXTS = (4096, 32768, 131072)
DEFAULT_EXTRA = ((1, 524288),)
BACKEND_ORDER = ("cudnn", "flash", "efficient", "math")
ENUM_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON results here")
    p.add_argument("--shapes", help="comma-separated BxS list (e.g. 1x4096,32x131072); "
                   "default: batch 1,8,32 x context 4096,32768,131072 plus 1x524288")
    p.add_argument("--quick", action="store_true", help="batch 1,8 x context 4096,32768 only")
    p.add_argument("--hq", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--hkv", type=int, default=8, help="K/V heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--backends", default=",".join(BACKEND_ORDER),
                   help="comma-separated subset of %s" % ",".join(BACKEND_ORDER))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer size in MiB (default 256)")
    p.add_argument("--math-max-context", type=int, default=32768,
                   help="skip the math backend above this context (default 32768)")
    p.add_argument("--no-expanded", action="store_true",
                   help="do not retry backends without GQA support on K/V expanded to Hq heads")
    p.add_argument("--hbm-gib", type=float, default=2.0, help="tensor size of the HBM read test (default 2 GiB)")
    args = p.parse_args(argv)

    if args.shapes:
        shapes = []
        for item in args.shapes.split(","):
            b, s = item.lower().strip().split("x")
            shapes.append((int(b), int(s)))
    elif args.quick:
        shapes = [(b, s) for b in (1, 8) for s in (4096, 32768)]
    else:
        shapes = [(b, s) for b in DEFAULT_BATCHES for s in DEFAULT_CONTEXTS] + list(DEFAULT_EXTRA)
    args.shape_list = shapes
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backend_list:
        if b not in ENUM_NAMES:
            p.error("unknown backend %r" % b)
    if args.hq % args.hkv:
        p.error("--hq must be a multiple of --hkv")
    return args


def first_line(exc):
    text = str(exc).strip().splitlines()
    return (type(exc).__name__ + ": " + (text[0] if text else ""))[:200]


def warning_text(caught):
    """The distinct warnings PyTorch gave while rejecting a backend (the actual reasons), shortened."""
    seen = []
    for w in caught or ():
        text = " ".join(str(w.message).split())
        if text and text not in seen:
            seen.append(text)
    return (" [" + "; ".join(t[:160] for t in seen[:3]) + "]") if seen else ""


class Timer:
    """Median CUDA-event time of fn() with the L2 flushed before every timed call."""

    def __init__(self, torch, flush_mib, warmup, iters):
        self.torch = torch
        self.flush = torch.empty(flush_mib * 1024 * 1024, dtype=torch.uint8, device="cuda")
        self.warmup = warmup
        self.iters = iters

    def __call__(self, fn):
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times_us = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
        return statistics.median(times_us), min(times_us)


def measure_hbm(torch, timer, gib):
    """Streaming-read bandwidth: full reductions over a large tensor (read-bound)."""
    n_bytes = int(gib * 1024 ** 3) // 8 * 8
    x = torch.zeros(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
    methods = {}
    for name, fn in (("int64_sum", lambda: x.view(torch.int64).sum()),
                     ("fp32_sum", lambda: x.view(torch.float32).sum())):
        try:
            med, _ = timer(fn)
            methods[name] = n_bytes / (med * 1e-6) / 1e9
        except Exception as e:  # noqa: BLE001 - report and go on
            print("hbm %s failed: %s" % (name, first_line(e)), file=sys.stderr)
    del x
    torch.cuda.empty_cache()
    best = max(methods.values()) if methods else float("nan")
    return best, methods, n_bytes


def is_oom(torch, exc):
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in str(exc).lower()


def run(args):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print("sdpa_baseline: PyTorch (>= 2.5, with torch.nn.attention) is not importable: %s" % e,
              file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        print("sdpa_baseline: CUDA is not available", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")  # "Flash attention was not used because ..." per rejected call

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    backends = {}
    for b in args.backend_list:
        enum = getattr(SDPBackend, ENUM_NAMES[b], None)
        if enum is None:
            print("sdpa_baseline: this torch has no SDPBackend.%s; skipped" % ENUM_NAMES[b], file=sys.stderr)
        else:
            backends[b] = enum

    timer = Timer(torch, args.flush_mib, args.warmup, args.iters)
    hbm, hbm_methods, hbm_bytes = measure_hbm(torch, timer, args.hbm_gib)
    print("device: %s (%d SMs, %.1f GiB), torch %s, cuda %s, cudnn %s" % (
        props.name, props.multi_processor_count, props.total_memory / 1024 ** 3, torch.__version__,
        torch.version.cuda, torch.backends.cudnn.version()))
    print("HBM streaming read: %s GB/s (%s)" % (
        "%.0f" % hbm, ", ".join("%s %.0f" % kv for kv in sorted(hbm_methods.items()))))

    report = {
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "hbm_read_gbps": hbm,
        "hbm_read_methods": hbm_methods,
        "hbm_read_bytes": hbm_bytes,
        "method": {
            "dtype": "bfloat16", "warmup": args.warmup, "iters": args.iters, "statistic": "median",
            "l2_flush_mib": args.flush_mib, "timer": "cuda events", "gb": "1e9 bytes",
            "bytes": "K+V (Hkv heads) + q + out",
        },
        "results": [],
        "best": [],
        "skipped": [],
    }

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    hq, hkv, d = args.hq, args.hkv, args.head_dim
    group = hq // hkv
    elt = 2  # bf16
    header = "%5s %8s %-10s %-8s %11s %9s %7s %9s" % ("batch", "context", "backend", "gqa", "time_us",
                                                      "GB/s", "%HBM", "max_diff")
    print(header)
    print("-" * len(header))

    for batch, context in args.shape_list:
        kv_bytes = batch * hkv * context * d * elt * 2
        qo_bytes = 2 * batch * hq * d * elt
        total_bytes = kv_bytes + qo_bytes
        shape_key = {"batch": batch, "context": context}

        def skip(backend, gqa, reason):
            report["skipped"].append(dict(shape_key, backend=backend, gqa=gqa, reason=reason))
            print("%5d %8d %-10s %-8s skipped: %s" % (batch, context, backend, gqa, reason[:200]))

        free, _ = torch.cuda.mem_get_info()
        if kv_bytes * 1.05 > free:
            skip("*", "native", "needs %.1f GiB of K/V, %.1f GiB free" % (kv_bytes / 1024 ** 3, free / 1024 ** 3))
            continue
        q = k = v = k_exp = v_exp = ref = None
        try:
            torch.manual_seed(1234)
            q = torch.randn(batch, hq, 1, d, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(batch, hkv, context, d, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(batch, hkv, context, d, dtype=torch.bfloat16, device="cuda")
            shape_results = []
            need_expanded = []

            for name, enum in backends.items():
                if name == "math" and context > args.math_max_context:
                    skip(name, "native", "math backend skipped above %d tokens" % args.math_max_context)
                    continue
                caught = []
                try:
                    with sdpa_kernel([enum]):
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        torch.cuda.synchronize()
                        med, mn = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                except Exception as e:  # noqa: BLE001
                    torch.cuda.synchronize()
                    if is_oom(torch, e):
                        skip(name, "native", "out of memory")
                    else:
                        skip(name, "native", first_line(e) + warning_text(caught))
                        if name != "math":
                            need_expanded.append((name, enum))
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                shape_results.append((name, "native", med, mn, out))
                if ref is None:
                    ref = out

            if need_expanded and not args.no_expanded:
                try:
                    k_exp = k.repeat_interleave(group, dim=1)
                    del k
                    k = None
                    v_exp = v.repeat_interleave(group, dim=1)
                    del v
                    v = None
                except Exception as e:  # noqa: BLE001
                    for name, _ in need_expanded:
                        skip(name, "expanded", "expanding K/V to %d heads: %s" % (
                            hq, "out of memory" if is_oom(torch, e) else first_line(e)))
                    need_expanded = []
                    k_exp = v_exp = None
                    gc.collect()
                    torch.cuda.empty_cache()
                for name, enum in need_expanded:
                    try:
                        with sdpa_kernel([enum]):
                            out = F.scaled_dot_product_attention(q, k_exp, v_exp)
                            torch.cuda.synchronize()
                            med, mn = timer(lambda: F.scaled_dot_product_attention(q, k_exp, v_exp))
                    except Exception as e:  # noqa: BLE001
                        torch.cuda.synchronize()
                        skip(name, "expanded", "out of memory" if is_oom(torch, e) else first_line(e))
                        gc.collect()
                        torch.cuda.empty_cache()
                        continue
                    shape_results.append((name, "expanded", med, mn, out))
                    if ref is None:
                        ref = out

            for name, gqa, med, mn, out in shape_results:
                diff = None
                if ref is not None and out is not None:
                    diff = (out.float() - ref.float()).abs().max().item()
                gbps = total_bytes / (med * 1e-6) / 1e9
                frac = gbps / hbm if hbm and not math.isnan(hbm) else None
                row = dict(shape_key, hq=hq, hkv=hkv, head_dim=d, backend=name, gqa=gqa,
                           time_us=round(med, 3), time_us_min=round(mn, 3), bytes=total_bytes,
                           gbps=round(gbps, 2), fraction_of_hbm=None if frac is None else round(frac, 4),
                           max_abs_diff=diff)
                report["results"].append(row)
                print("%5d %8d %-10s %-8s %11.1f %9.0f %6.1f%% %9s" % (
                    batch, context, name, gqa, med, gbps, 100.0 * (frac or 0.0),
                    "-" if diff is None else "%.2e" % diff))
            if shape_results:
                best = min((r for r in report["results"] if r["batch"] == batch and r["context"] == context
                            and r["hq"] == hq and r["hkv"] == hkv and r["head_dim"] == d),
                           key=lambda r: r["time_us"])
                report["best"].append({k: best[k] for k in (
                    "batch", "context", "hq", "hkv", "head_dim", "backend", "gqa", "time_us", "gbps",
                    "fraction_of_hbm")})
            shape_results = None
        except Exception as e:  # noqa: BLE001 - e.g. OOM while allocating the shape
            skip("*", "native", "out of memory" if is_oom(torch, e) else first_line(e))
        finally:
            q = k = v = k_exp = v_exp = ref = out = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        save()

    print()
    print("best per shape (HBM read %.0f GB/s):" % hbm)
    for b in report["best"]:
        print("  B=%-3d S=%-7d %-10s %-8s %10.1f us %7.0f GB/s %5.1f%%" % (
            b["batch"], b["context"], b["backend"], b["gqa"], b["time_us"], b["gbps"],
            100.0 * (b["fraction_of_hbm"] or 0.0)))
    save()
    if args.out:
        print("wrote %s" % args.out)
    return 0 if report["results"] else 1


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    rc = run(args)
    print("sdpa_baseline: %.1f s" % (time.time() - t0))
    return rc


if __name__ == "__main__":
    sys.exit(main())
