# SPDX-License-Identifier: Apache-2.0
"""kvmosaic from PyTorch: the C++ extension (built on first use with PyTorch's own tooling,
torch.utils.cpp_extension) and a thin Python face over it.

    import kvmosaic_torch
    cache = kvmosaic_torch.ModelCache(num_layers=30, num_kv_heads=3, group_size=3, head_dim=64,
                                      layer_specs=["quant2:rounding=nearest,sinks=4/quest:budget=0.125"])
    seq = cache.add_sequence()
    cache.prefill(layer, seq, k, v)          # k, v: [tokens][num_kv_heads][head_dim]
    cache.append(layer, [seq], k1, v1)       # one token per sequence: [batch][num_kv_heads][head_dim]
    out = cache.attend(layer, [seq], q)      # q: [batch][num_q_heads][head_dim] -> out, same shape

A layer spec is `format[:key=value,...]/selector[:key=value,...][/compactor]` (csrc/layer_spec.hpp
lists the keys). Layers live on the CPU (the library's host backend) or on a CUDA device (its
kernels; the extension is then built with nvcc, for the architectures in TORCH_CUDA_ARCH_LIST).
`kvmosaic_torch.hf` plugs the cache into Hugging Face transformers.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

__all__ = ["load", "ModelCache", "repo_root"]

_HERE = Path(__file__).resolve().parent
_CSRC = _HERE.parent / "csrc"


def repo_root() -> Path:
    """The kvmosaic checkout this package belongs to (its include/ holds the library)."""
    return _HERE.parents[2]


def _eigen_include() -> str:
    candidates = [os.environ.get("KVMOSAIC_EIGEN_INCLUDE", ""), "/usr/include/eigen3",
                  str(repo_root() / ".device-deps" / "include" / "eigen3")]
    for c in candidates:
        if c and (Path(c) / "Eigen" / "Core").exists():
            return c
    raise RuntimeError("kvmosaic_torch: Eigen 3 headers not found; set KVMOSAIC_EIGEN_INCLUDE to the folder "
                       "holding Eigen/Core (Debian: apt-get install libeigen3-dev)")


_loaded: dict[bool, bool] = {}


def load(cuda: bool | None = None, verbose: bool = False) -> None:
    """Builds (once; cached in examples/pytorch/build/) and loads the extension, which registers
    torch.classes.kvmosaic.ModelCache and torch.ops.kvmosaic.*. `cuda`: build the CUDA layers too
    (default: when torch sees a GPU)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    if _loaded.get(cuda) or _loaded.get(True):
        return
    from torch.utils import cpp_extension

    name = "kvmosaic_torch_cuda" if cuda else "kvmosaic_torch_host"
    build = Path(os.environ.get("KVMOSAIC_TORCH_BUILD", _HERE.parent / "build")) / name
    build.mkdir(parents=True, exist_ok=True)
    sources = [str(_CSRC / "ops.cpp")]
    flags = ["-O2", "-std=c++17"]
    cuda_flags = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    if cuda:
        sources += sorted(str(p) for p in (_CSRC / "cuda").glob("*.cu"))
        flags.append("-DKVMOSAIC_TORCH_CUDA")
        cuda_flags.append("-DKVMOSAIC_TORCH_CUDA")
    cpp_extension.load(name=name, sources=sources, extra_include_paths=[str(repo_root() / "include"), _eigen_include()],
                       extra_cflags=flags, extra_cuda_cflags=cuda_flags, build_directory=str(build),
                       with_cuda=cuda, is_python_module=False, verbose=verbose)
    _loaded[cuda] = True


def pages_for(tokens: int, page_size: int, sequences: int) -> int:
    """Pool pages one layer needs to hold `sequences` sequences of up to `tokens` tokens."""
    return max(1, sequences * (math.ceil(tokens / page_size) + 1))


class ModelCache:
    """A model's KV cache: one kvmosaic cache per layer (each of its own spec), one sequence id
    space, memory summed (kvmosaic::model_cache). Tensors stay where they are: q, k, v, out in
    the model's dtype (float32, float16, bfloat16) on the cache's device, any strides."""

    def __init__(self, num_layers: int, num_kv_heads: int, group_size: int, head_dim: int,
                 layer_specs: list[str] | str = "dense/all", *, storage: str = "bf16", page_size: int = 64,
                 max_tokens: int = 8192, max_sequences: int = 8, max_pages: int | None = None,
                 device: str | torch.device = "cpu"):
        device = torch.device(device)
        load(cuda=device.type == "cuda")
        specs = [layer_specs] if isinstance(layer_specs, str) else list(layer_specs)
        if max_pages is None:
            max_pages = pages_for(max_tokens, page_size, max_sequences)
        self.num_layers, self.num_kv_heads, self.group_size, self.head_dim = num_layers, num_kv_heads, group_size, head_dim
        self.device = device
        self.specs = specs
        self._impl = torch.classes.kvmosaic.ModelCache(num_layers, num_kv_heads, group_size, head_dim, storage,
                                                       page_size, max_pages, max_sequences, str(device), specs)

    def describe(self, layer: int = 0) -> str:
        return self._impl.describe(layer)

    def add_sequence(self) -> int:
        return self._impl.add_sequence()

    def remove_sequence(self, seq: int) -> None:
        self._impl.remove_sequence(seq)

    def fork_sequence(self, seq: int) -> int:
        return self._impl.fork_sequence(seq)

    def length(self, seq: int) -> int:
        return self._impl.length(seq)

    def stored_tokens(self, layer: int, seq: int) -> int:
        return self._impl.stored_tokens(layer, seq)

    def prefill(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor, token_ids: torch.Tensor | None = None):
        self._impl.prefill(layer, seq, k, v, token_ids)

    def append(self, layer: int, seqs: list[int], k: torch.Tensor, v: torch.Tensor,
               token_ids: torch.Tensor | None = None):
        self._impl.append(layer, list(seqs), k, v, token_ids)

    def attend(self, layer: int, seqs: list[int], q: torch.Tensor, scale: float = 0.0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self._impl.attend(layer, list(seqs), q, float(scale))
        self._impl.attend_into(layer, list(seqs), q, out, float(scale))
        return out

    def read(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K, V of `seq` in `layer`, decoded as attention reads them (CPU float32)."""
        k, v = self._impl.read(layer, seq)
        return k, v

    def snapshot(self, layer: int, seq: int, queries: torch.Tensor, scale: float = 0.0) -> int:
        """SnapKV's snapshot of `seq` in `layer` (a layer spec with selector snapkv): `queries`
        [window][query heads][head_dim] are the prompt's last queries (after RoPE; moved to the CPU
        here). Keeps the budget, compacts; returns the tokens evicted."""
        return self._impl.snapshot(layer, seq, queries.detach().to("cpu"), float(scale))

    def memory(self, layer: int = -1) -> dict[str, int]:
        """tokens, stored_bytes, dense_bytes, pages_used, pages_free: of every layer, or of one."""
        return dict(self._impl.memory(layer))

    def compression(self) -> float:
        """Stored bytes over the 16-bit dense bytes of the same tokens (every layer)."""
        m = self.memory()
        return m["stored_bytes"] / m["dense_bytes"] if m["dense_bytes"] else 1.0
