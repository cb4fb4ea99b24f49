# SPDX-License-Identifier: Apache-2.0
"""Tests of the PyTorch extension and the transformers integration (pytest).

On the CPU they run in CI (scripts/test.sh installs CPU-usable PyTorch and transformers); with a
GPU, `KVMOSAIC_TORCH_DEVICE=cuda` runs the same tests on CUDA tensors (docs/pytorch.md).
References are independent of the library: torch's own SDPA in float64 over the rows the cache
stored, and transformers' DynamicCache for generate().
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvmosaic_torch  # noqa: E402
from kvmosaic_torch import ModelCache  # noqa: E402

DEVICE = torch.device(os.environ.get("KVMOSAIC_TORCH_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVMOSAIC_TORCH_DEVICE=cuda but torch sees no GPU", allow_module_level=True)

SPECS = [
    "dense/all",
    "bitmap_tiles:s_k=0.5,s_v=0.5/all",
    "quant2:partition=64,rounding=nearest,sinks=4/all",
    "dense/quest:budget=0.25,block=16",
    "quant2:partition=32,rounding=nearest/streaming:budget=0.5,sinks=4,compact_every=64/hole_fill",
    "bitmap_tiles:s_k=0.7,s_v=0.7,sinks=4,recent=64/all",
    "quant2:partition=64,rounding=nearest,sinks=4,recent=128/quest:budget=0.25,block=16",
    "quant4:partition=64/all",
    "quant4:partition=32,v_axis=head_dim/all",
    "quant2:partition=64,v_axis=head_dim,sinks=0/all",
]


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """fp64 attention of q [heads][d] over rows k, v [tokens][kv heads][d]."""
    q, k, v = q.double(), k.double(), v.double()
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads][tokens][d]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    p = torch.softmax(torch.einsum("hd,htd->ht", q, kk) * scale, dim=-1)
    return torch.einsum("ht,htd->hd", p, vv)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_equals_sdpa_in_model_dtype(dtype):
    torch.manual_seed(1)
    kvh, group, d, n = 3, 3, 64, 300
    cache = ModelCache(2, kvh, group, d, "dense/all", storage="f16" if dtype == torch.float16 else "bf16",
                       max_tokens=512, max_sequences=2, device=DEVICE)
    seq = cache.add_sequence()
    k = torch.randn(n, kvh, d, device=DEVICE, dtype=dtype)
    v = torch.randn(n, kvh, d, device=DEVICE, dtype=dtype)
    cache.prefill(1, seq, k[:-1], v[:-1])
    cache.append(1, [seq], k[-1:], v[-1:])
    q = torch.randn(1, kvh * group, d, device=DEVICE, dtype=dtype)
    out = cache.attend(1, [seq], q)
    assert out.dtype == dtype and out.device == q.device and out.shape == q.shape
    rk, rv = cache.read(1, seq)
    stored = k.to(torch.bfloat16 if dtype != torch.float16 else torch.float16).float().cpu()
    assert torch.equal(rk, stored), "dense read-back differs from the rows written (rounded to storage)"
    ref = exact_attention(q[0].cpu(), rk, rv, group, d ** -0.5)
    assert rel_l2(out[0].cpu(), ref) < (2e-2 if dtype != torch.float32 else 1e-5)
    assert cache.stored_tokens(1, seq) == n and cache.stored_tokens(0, seq) == 0  # layer 0 untouched


@pytest.mark.parametrize("spec", SPECS)
def test_attend_matches_attention_over_read_back(spec):
    """The library's output equals exact attention over what it says it stores (read back),
    for every format; quant2 and quant4 attend on codes with 8-bit q and p, hence their looser bound."""
    torch.manual_seed(2)
    kvh, group, d, n, batch = 3, 3, 64, 700, 2
    cache = ModelCache(1, kvh, group, d, spec, max_tokens=1024, max_sequences=batch, device=DEVICE)
    seqs = [cache.add_sequence() for _ in range(batch)]
    for b, s in enumerate(seqs):
        cache.prefill(0, s, torch.randn(n + b * 37, kvh, d, device=DEVICE), torch.randn(n + b * 37, kvh, d, device=DEVICE))
    q = torch.randn(batch, kvh * group, d, device=DEVICE)
    out = cache.attend(0, seqs, q)
    for b, s in enumerate(seqs):
        rk, rv = cache.read(0, s)
        assert rk.shape == (cache.stored_tokens(0, s), kvh, d)
        if "quest" in spec or "streaming" in spec:
            continue  # these read a subset: covered by the library's own tests
        ref = exact_attention(q[b].cpu(), rk, rv, group, d ** -0.5)
        bound = 5e-2 if spec.startswith("quant") else 2e-5
        assert rel_l2(out[b].cpu(), ref) < bound, spec


def test_streaming_frees_memory():
    torch.manual_seed(3)
    cache = ModelCache(1, 3, 3, 64, "dense/streaming:budget=0.25,sinks=4,compact_every=64/hole_fill",
                       max_tokens=4096, max_sequences=1, device=DEVICE)
    seq = cache.add_sequence()
    cache.prefill(0, seq, torch.randn(4096, 3, 64, device=DEVICE), torch.randn(4096, 3, 64, device=DEVICE))
    m = cache.memory()
    assert cache.length(seq) == 4096
    assert m["pages_used"] <= 4096 // 4 // 64 + 2, m


def test_fork_and_remove():
    cache = ModelCache(3, 3, 3, 64, ["dense/all", "quant2/all", "bitmap_tiles/all"], max_tokens=256, max_sequences=4,
                       device=DEVICE)
    a = cache.add_sequence()
    for layer in range(3):
        cache.prefill(layer, a, torch.randn(100, 3, 64, device=DEVICE), torch.randn(100, 3, 64, device=DEVICE))
    b = cache.fork_sequence(a)
    assert cache.length(b) == 100
    for layer in range(3):
        assert torch.equal(cache.read(layer, a)[0], cache.read(layer, b)[0])
    cache.remove_sequence(a)
    with pytest.raises(ValueError):
        cache.length(a)
    assert "quant2" in cache.describe(1) and "bitmap_tiles" in cache.describe(2)


def test_bad_input_is_a_clear_python_error():
    cache = ModelCache(1, 3, 3, 64, "dense/all", max_tokens=256, max_sequences=1, device=DEVICE)
    seq = cache.add_sequence()
    k = torch.randn(10, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="k has shape"):
        cache.prefill(0, seq, k[0], k[0])
    with pytest.raises(ValueError, match="dtype"):
        cache.prefill(0, seq, k.double(), k.double())
    with pytest.raises(ValueError, match="layer = 5"):
        cache.prefill(5, seq, k, k)
    with pytest.raises(ValueError, match="head_dim|extent"):
        cache.prefill(0, seq, torch.randn(10, 3, 32, device=DEVICE), torch.randn(10, 3, 32, device=DEVICE))
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="is on cpu"):
            cache.prefill(0, seq, k.cpu(), k.cpu())
    with pytest.raises(ValueError, match="partition"):
        ModelCache(1, 3, 3, 64, "quant2:partition=48/all", device=DEVICE)
    with pytest.raises(ValueError, match="quant2 key"):
        ModelCache(1, 3, 3, 64, "quant2:bits=4/all", device=DEVICE)
    with pytest.raises(ValueError, match="selector"):  # quant4 is compiled with select::all only
        ModelCache(1, 3, 3, 64, "quant4/quest", device=DEVICE)
    with pytest.raises(ValueError, match="selector"):  # snapkv is compiled over dense only
        ModelCache(1, 3, 3, 64, "bitmap_tiles/snapkv/repack", device=DEVICE)
    with pytest.raises(ValueError, match="compactor"):
        ModelCache(1, 3, 3, 64, "dense/snapkv/hole_fill", device=DEVICE)
    with pytest.raises(ValueError, match="compactor"):
        ModelCache(1, 3, 3, 64, "dense/tova", device="cpu")
    with pytest.raises(ValueError, match="compactor"):
        ModelCache(1, 3, 3, 64, "dense/streaming", device=DEVICE)


def test_tova_and_h2o_keep_the_budget():
    """select::tova and select::h2o through the extension (host layers, or on CUDA tensors the
    CUDA layers, whose kernels write the scores): the prompt stays until a decode step has scored
    it; the next write evicts down to the budget and, compacting after every write here, gives the
    pages back; the step after attends to finite values. On CUDA the same steps on a CPU cache
    keep the same tokens and attend alike."""
    torch.manual_seed(5)
    kvh, group, d, n, budget, page = 3, 3, 64, 300, 96, 16
    for spec in (f"dense/tova:tokens={budget},compact_every=1/repack",
                 f"dense/h2o:tokens={budget},recent=0.25,compact_every=1/repack"):
        devices = [DEVICE] if DEVICE.type == "cpu" else [DEVICE, torch.device("cpu")]
        caches = [ModelCache(1, kvh, group, d, spec, page_size=page, max_tokens=512, max_sequences=1, device=x)
                  for x in devices]
        k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
        q0, q1 = torch.randn(1, kvh * group, d), torch.randn(1, kvh * group, d)
        k1, v1 = torch.randn(1, kvh, d), torch.randn(1, kvh, d)
        outs = []
        for cache, x in zip(caches, devices):
            seq = cache.add_sequence()
            cache.prefill(0, seq, k.to(x), v.to(x))
            assert cache.stored_tokens(0, seq) == n  # nothing scored before the first step
            assert torch.isfinite(cache.attend(0, [seq], q0.to(x))).all()
            cache.append(0, [seq], k1.to(x), v1.to(x))
            assert cache.length(seq) == n + 1
            assert budget <= cache.stored_tokens(0, seq) < budget + page, spec  # whole pages of survivors, and the tail
            out = cache.attend(0, [seq], q1.to(x))
            assert torch.isfinite(out).all()
            outs.append((out.float().cpu(), cache.read(0, seq)[0].float().cpu()))
        if len(outs) == 2:  # the device's scores evicted what the host's did: the same keys kept
            assert torch.equal(outs[0][1], outs[1][1]), spec
            assert rel_l2(outs[0][0], outs[1][0]) < 1e-4, spec
    ModelCache(1, kvh, group, d, "dense/h2o:combine=max/hole_fill", device=DEVICE)  # the other compactor, parsed


def test_per_head_layers_keep_each_heads_budget():
    """per_head=1 (select::per_kv_head, CPU layers): each KV head evicts by its own scores down to
    the budget; with a budget of the whole context it attends as the one-decision layer does; read
    is refused (the heads hold different tokens). On CUDA the spec is refused, naming per_head."""
    torch.manual_seed(6)
    kvh, group, d, n, page = 3, 3, 64, 300, 16
    if DEVICE.type != "cpu":
        with pytest.raises(ValueError, match="per_head"):
            ModelCache(1, kvh, group, d, "dense/h2o:tokens=96,per_head=1/repack", device=DEVICE)
        return
    k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    q0, q1 = torch.randn(1, kvh * group, d), torch.randn(1, kvh * group, d)
    k1, v1 = torch.randn(1, kvh, d), torch.randn(1, kvh, d)
    outs = []
    for spec in ("dense/tova:tokens=100000,compact_every=1/repack", "dense/tova:tokens=100000,compact_every=1,per_head=1/repack",
                 "dense/tova:tokens=96,compact_every=1,per_head=1/repack"):
        cache = ModelCache(1, kvh, group, d, spec, page_size=page, max_tokens=512, max_sequences=1)
        seq = cache.add_sequence()
        cache.prefill(0, seq, k, v)
        cache.attend(0, [seq], q0)
        cache.append(0, [seq], k1, v1)
        outs.append(cache.attend(0, [seq], q1).float())
        if "tokens=96" in spec:
            assert 96 <= cache.stored_tokens(0, seq) < 96 + page  # every head's mean: its survivors and tail
            with pytest.raises(ValueError, match="per_kv_head"):
                cache.read(0, seq)
    assert rel_l2(outs[0], outs[1]) < 1e-6  # nothing evicted: one decision or three, the same attention
    assert rel_l2(outs[0], outs[2]) > 1e-4  # evicted: not the same
    # SnapKV with Ada-KV's allocation: the heads keep their budgets in all, spread by the votes.
    cache = ModelCache(1, kvh, group, d, "dense/snapkv:tokens=96,window=8,per_head=1,adaptive=1/repack", page_size=page,
                       max_tokens=512, max_sequences=1)
    seq = cache.add_sequence()
    cache.prefill(0, seq, k, v)
    assert cache.snapshot(0, seq, torch.randn(8, kvh * group, d)) == kvh * (n - 96)
    assert 96 <= cache.stored_tokens(0, seq) < 96 + page  # the heads' mean: survivors in whole pages, and the tail
    with pytest.raises(ValueError, match="adaptive"):
        ModelCache(1, kvh, group, d, "dense/snapkv:tokens=96,adaptive=1/repack")


def test_snapkv_snapshot_keeps_the_budget():
    """select::snapkv through the extension: after a prefill, the snapshot with the prompt's last
    queries keeps the budget and gives pages back (on CUDA tensors the CUDA layer, whose decode
    kernels compute the votes: the same tokens kept as a CPU cache's fp64 votes keep, and the same
    attention after); a layer of another selector refuses a snapshot."""
    torch.manual_seed(7)
    kvh, group, d, n, budget, window, page = 3, 3, 64, 300, 96, 8, 16
    spec = f"dense/snapkv:tokens={budget},window={window}/repack"
    devices = [DEVICE] if DEVICE.type == "cpu" else [DEVICE, torch.device("cpu")]
    k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    queries, q = torch.randn(window, kvh * group, d), torch.randn(1, kvh * group, d)
    kept = []
    for x in devices:
        cache = ModelCache(2, kvh, group, d, [spec, "dense/all"], page_size=page, max_tokens=512, max_sequences=1, device=x)
        seq = cache.add_sequence()
        for layer in (0, 1):
            cache.prefill(layer, seq, k.to(x), v.to(x))
        pages = cache.memory(0)["pages_used"]
        assert cache.snapshot(0, seq, queries) == n - budget
        assert budget <= cache.stored_tokens(0, seq) < budget + page  # whole pages of survivors, and the tail
        assert cache.memory(0)["pages_used"] < pages
        with pytest.raises(ValueError, match="snapkv"):
            cache.snapshot(1, seq, queries)
        assert cache.stored_tokens(1, seq) == n
        kept.append((cache.read(0, seq)[0], cache.attend(0, [seq], q.to(x)).float().cpu()))
    if len(kept) == 2:
        assert torch.equal(kept[0][0], kept[1][0])
        assert rel_l2(kept[0][1], kept[1][1]) < 1e-4


def test_generate_with_a_snapkv_layer_snapshots_after_the_prompt():
    """generate() with snapkv layers: each takes its snapshot right after its prompt is attended
    (the prompt's last queries vote), keeps its budget, then decodes through kvmosaic."""
    from kvmosaic_torch.hf import KvmosaicCache, register
    register()
    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    spec = "dense/snapkv:tokens=64,window=16/repack"
    cache = KvmosaicCache(model.config, [spec, "dense/all", spec, "dense/all"], device=DEVICE, max_tokens=256)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 206)
    seq = cache.sequences[0]
    assert cache.kv.length(seq) == 205
    for layer in (1, 3):
        assert cache.kv.stored_tokens(layer, seq) == 205
    for layer in (0, 2):  # the budget, 5 tokens appended after the snapshot, whole pages of survivors
        assert 64 + 5 <= cache.kv.stored_tokens(layer, seq) < 64 + 5 + 64, layer


def test_packed_bitmap_on_cpu_attends_close_to_dense():
    """packed_bitmap (MosaicKV's stage 1) on the CPU whatever the device (on CUDA tensors:
    test_packed_bitmap_on_cuda_matches_cpu): its output equals exact attention over what it
    stores (read back), and K and V with a few dominant directions, as a model's are, come back
    close to the rows written, so that it attends close to dense."""
    torch.manual_seed(4)
    kvh, group, d, n = 3, 3, 64, 600
    spec = "packed_bitmap:retained=0.5,group=1,truncated=0.25,segment=1024,mode=fixed,sinks=4/all"
    cache = ModelCache(1, kvh, group, d, spec, max_tokens=1024, max_sequences=1, device="cpu")
    seq = cache.add_sequence()
    # rank-8 rows plus a little noise: the top quarter of the rotated channels holds their energy
    basis = torch.randn(kvh, 8, d)
    k = torch.einsum("thr,hrd->thd", torch.randn(n, kvh, 8), basis) + 0.01 * torch.randn(n, kvh, d)
    v = torch.einsum("thr,hrd->thd", torch.randn(n, kvh, 8), basis) + 0.01 * torch.randn(n, kvh, d)
    cache.prefill(0, seq, k, v)
    q = 0.2 * torch.randn(1, kvh * group, d)
    out = cache.attend(0, [seq], q)
    rk, rv = cache.read(0, seq)
    assert rk.shape == (n, kvh, d) and "packed_bitmap" in cache.describe(0)
    assert rel_l2(out[0], exact_attention(q[0], rk, rv, group, d ** -0.5)) < 1e-3
    assert rel_l2(rk, k) < 5e-2 and rel_l2(rv, v) < 5e-2
    assert rel_l2(out[0], exact_attention(q[0], k, v, group, d ** -0.5)) < 5e-2
    assert cache.compression() < 0.8  # 72 of 128 bytes a row, plus the bases (2 x 64 x 48 fp32 per KV head) and tail
    with pytest.raises(ValueError, match="selector"):  # not compiled with quest
        ModelCache(1, kvh, group, d, "packed_bitmap/quest", device="cpu")
    with pytest.raises(ValueError, match="group"):
        ModelCache(1, kvh, group, d, "packed_bitmap:group=3/all", device="cpu")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs KVMOSAIC_TORCH_DEVICE=cuda (the CUDA build of the extension)")
@pytest.mark.parametrize("strategy", ["group=1,mode=fixed", "group=2,mode=search,loss=0.2"])
def test_packed_bitmap_on_cuda_matches_cpu(strategy):
    """A packed_bitmap layer on CUDA tensors attends as the same layer on CPU tensors, and the rows
    it stores read back as the host's: several segments (256 tokens each), two sequences, prefill
    and appends across a segment boundary.

    Tolerance: relative L2 < 1e-2. Both backends plan a segment (its rotation) with the same host
    code on the same rows, but the device encoder sums each row's rotation in fp32 in another order
    than the host's, so a stored 16-bit value may differ by one bf16 step (2^-8 relative), and a
    group whose energy ties another's within that rounding may be kept on one backend and not the
    other; both move a row by far less than 1e-2. The rows written are rank 8 plus noise that the
    format drops in part, so the format's own error (checked below to exceed 2e-2) is above the
    tolerance: a layer that stored the rows unpacked, or with another rotation, fails."""
    torch.manual_seed(5)
    kvh, group, d = 3, 3, 64
    lengths, steps = [700, 300], 70  # 700 + 70 crosses into the fourth segment
    spec = f"packed_bitmap:retained=0.25,{strategy},truncated=0.25,segment=256,sinks=4/all"
    caches = {dev: ModelCache(1, kvh, group, d, spec, max_tokens=1024, max_sequences=2, device=dev)
              for dev in ("cpu", DEVICE)}
    seqs = {dev: [c.add_sequence() for _ in lengths] for dev, c in caches.items()}
    basis = torch.randn(kvh, 8, d)

    def rows(n):
        # contiguous: the CUDA backend takes [rows][heads][head_dim] arrays as laid out and rejects strided ones
        return (torch.einsum("thr,hrd->thd", torch.randn(n, kvh, 8), basis) + 0.2 * torch.randn(n, kvh, d)).contiguous()

    written = [[rows(n), rows(n)] for n in lengths]
    for i, (k, v) in enumerate(written):
        for dev, c in caches.items():
            c.prefill(0, seqs[dev][i], k.to(dev), v.to(dev))
    for _ in range(steps):
        k, v = rows(len(lengths)), rows(len(lengths))
        for dev, c in caches.items():
            c.append(0, seqs[dev], k.to(dev), v.to(dev))
        for i in range(len(lengths)):
            written[i] = [torch.cat([written[i][0], k[i:i + 1]]), torch.cat([written[i][1], v[i:i + 1]])]
    q = 0.2 * torch.randn(len(lengths), kvh * group, d)
    want = caches["cpu"].attend(0, seqs["cpu"], q)
    got = caches[DEVICE].attend(0, seqs[DEVICE], q.to(DEVICE))
    assert got.device.type == "cuda" and "packed_bitmap" in caches[DEVICE].describe(0)
    assert torch.isfinite(got).all()
    for i in range(len(lengths)):
        (hk, hv), (gk, gv) = caches["cpu"].read(0, seqs["cpu"][i]), caches[DEVICE].read(0, seqs[DEVICE][i])
        assert gk.shape == hk.shape == (lengths[i] + steps, kvh, d)
        assert rel_l2(hk, written[i][0]) > 2e-2 and rel_l2(hv, written[i][1]) > 2e-2
        assert rel_l2(gk.cpu(), hk) < 1e-2 and rel_l2(gv.cpu(), hv) < 1e-2
        assert rel_l2(got[i].cpu(), want[i]) < 1e-2


def test_packed_bitmap_evicts_by_scores_and_snapshots():
    """packed_bitmap layers with tova, h2o (repack) and snapkv: the scores come from the packed
    attend path (the host's, or on CUDA tensors the CUDA kernels' logits in each segment's rotated
    space); the next write evicts down to the budget and compaction re-encodes the survivors; a
    snapshot keeps the budget. The extension compiles no other selector over packed_bitmap, nor
    another compactor, and says so."""
    torch.manual_seed(8)
    kvh, group, d, n, budget, page = 3, 3, 64, 300, 96, 16
    packed = "packed_bitmap:retained=0.5,sinks=4"
    k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    q0, q1 = torch.randn(1, kvh * group, d), torch.randn(1, kvh * group, d)
    k1, v1 = torch.randn(1, kvh, d), torch.randn(1, kvh, d)
    for selector in (f"tova:tokens={budget},compact_every=1", f"h2o:tokens={budget},compact_every=1"):
        cache = ModelCache(1, kvh, group, d, f"{packed}/{selector}/repack", page_size=page, max_tokens=512,
                           max_sequences=1, device=DEVICE)
        seq = cache.add_sequence()
        cache.prefill(0, seq, k.to(DEVICE), v.to(DEVICE))
        pages = cache.memory(0)["pages_used"]
        assert torch.isfinite(cache.attend(0, [seq], q0.to(DEVICE))).all()
        cache.append(0, [seq], k1.to(DEVICE), v1.to(DEVICE))
        assert budget <= cache.stored_tokens(0, seq) < budget + page, selector
        assert cache.memory(0)["pages_used"] < pages, selector
        assert torch.isfinite(cache.attend(0, [seq], q1.to(DEVICE))).all()
    cache = ModelCache(1, kvh, group, d, f"{packed}/snapkv:tokens={budget},window=8/repack", page_size=page,
                       max_tokens=512, max_sequences=1, device=DEVICE)
    seq = cache.add_sequence()
    cache.prefill(0, seq, k.to(DEVICE), v.to(DEVICE))
    assert cache.snapshot(0, seq, torch.randn(8, kvh * group, d)) == n - budget
    assert budget <= cache.stored_tokens(0, seq) < budget + page
    with pytest.raises(ValueError, match="tova, h2o or snapkv"):
        ModelCache(1, 3, 3, 64, f"{packed}/streaming:budget=0.5,sinks=4/repack", max_tokens=256, max_sequences=1,
                   device=DEVICE)
    with pytest.raises(ValueError, match="repack"):
        ModelCache(1, 3, 3, 64, f"{packed}/tova:budget=0.5/hole_fill", max_tokens=256, max_sequences=1, device=DEVICE)
    with pytest.raises(ValueError, match="per_head"):
        ModelCache(1, 3, 3, 64, f"{packed}/tova:budget=0.5,per_head=1/repack", max_tokens=256, max_sequences=1,
                   device=torch.device("cpu"))


def test_ops_are_registered():
    cache = ModelCache(1, 3, 3, 64, "dense/all", max_tokens=128, max_sequences=1, device=DEVICE)
    seq = cache.add_sequence()
    k = torch.randn(1, 3, 64, device=DEVICE)
    torch.ops.kvmosaic.append(cache._impl, 0, [seq], k, k)
    out = torch.ops.kvmosaic.attend(cache._impl, 0, [seq], torch.randn(1, 9, 64, device=DEVICE), 0.0)
    # one token: the output is its value row, repeated over each group's heads
    stored = k.to(torch.bfloat16).float()
    assert torch.allclose(out[0].cpu(), stored[0].repeat_interleave(3, dim=0).cpu(), atol=1e-6)


def _tiny_llama(dtype, num_kv=3, heads=9, head_dim=64, layers=4):
    """A random-weight Llama of SmolLM2's attention shape. Weights drawn with std 0.1 (not the
    usual 0.02) so that greedy decoding has clear margins: near-uniform logits would let rounding
    alone pick among near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=num_kv, head_dim=head_dim,
                         max_position_embeddings=1024, attn_implementation="kvmosaic", initializer_range=0.1)
    return LlamaForCausalLM(config).to(dtype=dtype, device=DEVICE).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_generate_dense_equals_transformers_cache(dtype):
    """generate() with kvmosaic's dense cache in every layer follows transformers' DynamicCache:
    teacher-forced on the reference's tokens, every logit within twice the gap between SDPA and
    eager attention (transformers' two implementations) on the same model; greedy tokens equal
    up to a near-tie of the reference, if any (kvmosaic_torch.agreement). A float32 model's K and
    V are stored as bf16, so there the logits must stay within 2% (relative L2) instead."""
    from kvmosaic_torch.agreement import decode_agreement
    from kvmosaic_torch.hf import KvmosaicCache, register
    register()
    model = _tiny_llama(dtype)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    storage = "f16" if dtype == torch.float16 else "bf16"
    caches = []

    def make_cache():
        caches.append(KvmosaicCache(model.config, "dense/all", device=DEVICE, storage=storage, max_tokens=128))
        return caches[-1]

    result = decode_agreement(model, ids, 24, make_cache)
    if dtype != torch.float32:
        assert result["agrees"], str(result)
    else:
        assert result["relative_l2"] < 2e-2, result
    generated = caches[-1]  # the cache generate() decoded with
    assert generated.kv.length(generated.sequences[0]) == 40 + 24 - 1  # the last token is not fed back


def test_generate_with_compressed_layers_runs():
    """Each layer its own cache type, a batch of two, sentence chunks fed the token ids."""
    from kvmosaic_torch.hf import KvmosaicCache, register
    register()
    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 512, (2, 130), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    specs = ["quant2:rounding=nearest,sinks=4/quest:budget=0.5", "bitmap_tiles/all",
             "dense/sentence_chunks:budget=0.5,boundaries=7:1.0|9:0.5", "quant2/streaming:budget=0.5/hole_fill"]
    cache = KvmosaicCache(model.config, specs, device=DEVICE, max_tokens=256, max_batch=2)
    cache.attach(model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 138)
    m = cache.kv.memory()
    assert m["stored_bytes"] < m["dense_bytes"]


@pytest.mark.parametrize("fmt", ["dense", "packed_bitmap:sinks=4"])
def test_mean_keys_reads_the_top_blocks(fmt):
    """select::mean_keys (MosaicKV's stage 2) over dense and packed_bitmap pages: a whole-context
    budget reads every token (the output of select::all on the same rows); a budget of 1/4 reads
    less, and differs from it."""
    torch.manual_seed(5)
    kvh, group, d, n = 2, 3, 64, 700
    k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    q = torch.randn(1, kvh * group, d)
    outputs = {}
    for selector in ("all", "mean_keys:budget=1,block=16", "mean_keys:budget=0.25,block=16"):
        cache = ModelCache(1, kvh, group, d, f"{fmt}/{selector}", max_tokens=1024, max_sequences=1, device="cpu")
        seq = cache.add_sequence()
        cache.prefill(0, seq, k, v)
        outputs[selector] = cache.attend(0, [seq], q)[0]
        assert "mean_keys" in cache.describe(0) or selector == "all"
    assert rel_l2(outputs["mean_keys:budget=1,block=16"], outputs["all"]) < 1e-5
    assert rel_l2(outputs["mean_keys:budget=0.25,block=16"], outputs["all"]) > 1e-3
    with pytest.raises(ValueError, match="mean_keys"):
        ModelCache(1, kvh, group, d, "quant2/mean_keys", device="cpu")
