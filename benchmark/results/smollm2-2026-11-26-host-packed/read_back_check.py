# Per-layer K/V read-back error of packed_bitmap on SmolLM2's real prefill K/V (GPL-3, 3072
# tokens, sealed pages only), against an independent fp64 reimplementation of the algorithm the
# header states. Run from the repository root:
#   python benchmark/results/smollm2-2026-11-26-host-packed/read_back_check.py
import sys, torch
sys.path.insert(0, "examples/pytorch")
import evaluate_real_model as ev, kvmosaic_torch
from kvmosaic_torch import ModelCache
from kvmosaic_torch.hf import register
register(); kvmosaic_torch.load(cuda=False)
model, tok, _ = ev.load_model(torch.device("cpu"))
ids = ev.read_texts(tok, 3072 + 64)[0][1]
_, dyn = ev.prefill(model, ids, 3072)

def ideal(x, r, kept):  # x [n][d] fp64: top-`kept` eigvecs of x^T x, top-r |y| per row (g=1)
    w, vecs = torch.linalg.eigh(x.T @ x)
    B = vecs[:, torch.argsort(w, descending=True)[:kept]]
    y = x @ B
    idx = y.abs().topk(r, dim=1).indices
    yh = torch.zeros_like(y).scatter(1, idx, y.gather(1, idx))
    return yh @ B.T

def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
for r in (0.25, 0.5):
    spec = f"packed_bitmap:retained={r},group=1,truncated=0.25,segment=65536,mode=fixed,sinks=0,recent=0/all"
    print(f"retained={r}: layer  K lib / ideal   V lib / ideal")
    for layer in range(model.config.num_hidden_layers):
        k = dyn.layers[layer].keys[0].transpose(0, 1).contiguous()    # [t][kv][d]
        v = dyn.layers[layer].values[0].transpose(0, 1).contiguous()
        c = ModelCache(1, 3, 3, 64, spec, max_tokens=4096, max_sequences=1)
        s = c.add_sequence(); c.prefill(0, s, k, v)
        rk, rv = c.read(0, s)
        n = (rk.shape[0] // 64) * 64  # sealed pages only (the tail is exact)
        ik = torch.stack([ideal(k[:n, h].double(), int(r * 64), 48) for h in range(3)], 1)
        iv = torch.stack([ideal(v[:n, h].double(), int(r * 64), 48) for h in range(3)], 1)
        tk = torch.stack([ideal(k[:n, h].double(), 48, 48) for h in range(3)], 1)
        tv = torch.stack([ideal(v[:n, h].double(), 48, 48) for h in range(3)], 1)
        print(f"  {layer:2d}  {rel(rk[:n], k[:n]):.3f} / {rel(ik, k[:n]):.3f}   {rel(rv[:n], v[:n]):.3f} / {rel(iv, v[:n]):.3f}   truncation alone K {rel(tk, k[:n])**2:.3f} V {rel(tv, v[:n])**2:.3f} (rel sq err)")
