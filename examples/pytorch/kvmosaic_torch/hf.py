# SPDX-License-Identifier: Apache-2.0
"""Hugging Face transformers integration: `model.generate()` with kvmosaic in every layer.

    from kvmosaic_torch.hf import KvmosaicCache, register
    register()                                              # attention function "kvmosaic"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvmosaic")
    cache = KvmosaicCache(model.config, "quant2:rounding=nearest,sinks=4/all", device="cpu")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

The cache stores what the model produced (K after RoPE, V) in each layer's kvmosaic cache. A
prefill (several new tokens) is attended by SDPA over exact K and V, as transformers would, and
stored; every decode step (one new token per sequence) appends to the kvmosaic cache and attends
through it: `kvmosaic_attention` sees the step's keys marked by the cache and calls the library's
decode instead of SDPA. A prefill that continues a sequence attends over the stored tokens read
back (decoded) plus the new ones. Batches are sequences of equal length (no padding): a padded
attention mask at decode is rejected. A layer whose selector is snapkv takes its snapshot right
after its first prefill is attended: the prompt's last `window` queries (after RoPE) vote, and
the layer keeps its budget.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import ModelCache, pages_for

__all__ = ["KvmosaicCache", "kvmosaic_attention", "register", "snapkv_window", "ATTENTION_NAME"]

ATTENTION_NAME = "kvmosaic"


class _KvmosaicLayer(CacheLayerMixin):
    """One transformers cache layer over layer `index` of the owner's kvmosaic model cache."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "KvmosaicCache", index: int):
        super().__init__()
        self.owner, self.index, self.length = owner, index, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


class KvmosaicCache(Cache):
    """A transformers `Cache` whose layers are kvmosaic caches (one `ModelCache`).

    `layer_specs`: one spec for every layer, or one per layer. `storage`: the dtype kvmosaic keeps
    uncompressed values in (bf16 or f16). Sequences are made on the first prefill, one per batch
    row. `token_ids` for selectors that cut at boundary tokens come from `attach(model)`, a forward
    pre-hook that records each call's input_ids."""

    def __init__(self, config: Any, layer_specs: list[str] | str = "dense/all", *, device: str | torch.device = "cpu",
                 storage: str = "bf16", page_size: int = 64, max_tokens: int = 8192, max_batch: int = 1):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = config.num_key_value_heads
        self.kv = ModelCache(config.num_hidden_layers, num_kv, config.num_attention_heads // num_kv, head_dim,
                             layer_specs, storage=storage, page_size=page_size, max_sequences=max_batch,
                             max_pages=pages_for(max_tokens, page_size, max_batch), device=device)
        super().__init__(layers=[_KvmosaicLayer(self, i) for i in range(config.num_hidden_layers)])
        self.sequences: list[int] = []
        self.pending_ids: torch.Tensor | None = None
        specs = [layer_specs] * config.num_hidden_layers if isinstance(layer_specs, str) else list(layer_specs)
        self.snapshot_windows = [snapkv_window(spec) for spec in specs]

    def attach(self, model: torch.nn.Module):
        """Records each forward's input_ids (for layer specs whose selector reads token ids)."""
        def hook(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.pending_ids = ids
        return model.register_forward_pre_hook(hook, with_kwargs=True)

    def _ids(self, row: int) -> torch.Tensor | None:
        return None if self.pending_ids is None else self.pending_ids[row]

    def _update(self, layer: _KvmosaicLayer, k: torch.Tensor, v: torch.Tensor):
        batch, _, tokens, _ = k.shape
        if not self.sequences:
            self.sequences = [self.kv.add_sequence() for _ in range(batch)]
        if batch != len(self.sequences):
            raise ValueError(f"kvmosaic: a batch of {batch} rows; this cache holds {len(self.sequences)} sequences")
        rows_k, rows_v = k.transpose(1, 2), v.transpose(1, 2)  # [batch][tokens][kv heads][head_dim], views
        i = layer.index
        if tokens == 1 and layer.length > 0:  # a decode step: attended by kvmosaic_attention
            self.kv.append(i, self.sequences, rows_k[:, 0], rows_v[:, 0], self._ids(slice(None)))
            layer.length += 1
            k._kvmosaic = (self, i)
            return k, v
        earlier = layer.length
        if earlier > 0 and any(self.kv.stored_tokens(i, s) != earlier for s in self.sequences):
            raise NotImplementedError("kvmosaic: a prefill that continues a sequence whose tokens were evicted")
        old = [self.kv.read(i, s) for s in self.sequences] if earlier > 0 else None
        for b, s in enumerate(self.sequences):
            self.kv.prefill(i, s, rows_k[b], rows_v[b], self._ids(b))
        layer.length += tokens
        if old is None:
            if self.snapshot_windows[i] is not None:  # kvmosaic_attention takes the snapshot after SDPA
                k = k.view_as(k)  # the mark goes on a view this call returns, not on the caller's tensor
                k._kvmosaic_prefill = (self, i)
            return k, v
        keys = torch.stack([o[0] for o in old]).to(k.dtype).to(k.device).transpose(1, 2)
        values = torch.stack([o[1] for o in old]).to(v.dtype).to(v.device).transpose(1, 2)
        return torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)

    def memory(self) -> dict[str, int]:
        return self.kv.memory()

    def snapshot(self, layer: int, query: torch.Tensor, scale: float = 0.0) -> int:
        """SnapKV's snapshot of every sequence of `layer` from the prompt's queries `query`
        ([batch][query heads][prompt][head_dim], after RoPE): its last `window` positions vote."""
        window = self.snapshot_windows[layer]
        evicted = 0
        for b, seq in enumerate(self.sequences):
            evicted += self.kv.snapshot(layer, seq, query[b, :, -window:, :].transpose(0, 1), scale)
        return evicted


def snapkv_window(spec: str) -> int | None:
    """The observation window of a layer spec whose selector is snapkv (its `window`, 32 by
    default), else None."""
    parts = spec.split("/")
    if len(parts) < 2:
        return None
    name, _, args = parts[1].partition(":")
    if name.strip() != "snapkv":
        return None
    values = dict(item.split("=", 1) for item in args.split(",") if "=" in item)
    return int(values.get("window", 32))


def kvmosaic_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs):
    """transformers' attention-function contract: query [batch][heads][q_len][head_dim] ->
    ([batch][q_len][heads][head_dim], None). Decode steps of a KvmosaicCache go to the library;
    everything else (prefill, other caches) to SDPA."""
    marker = getattr(key, "_kvmosaic", None)
    if marker is None or query.shape[2] != 1:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        prefill = getattr(key, "_kvmosaic_prefill", None)
        if prefill is not None:  # a snapkv layer's prompt, attended over its exact K and V: now the snapshot
            prefill[0].snapshot(prefill[1], query, scaling or 0.0)
        return out
    cache, layer = marker
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.all()):
        raise NotImplementedError("kvmosaic: padded batches (an attention mask that hides tokens) at decode")
    out = cache.kv.attend(layer, cache.sequences, query[:, :, 0, :], scaling or 0.0)
    return out.unsqueeze(1), None


def register() -> None:
    """Registers `kvmosaic_attention` under the name "kvmosaic" (attn_implementation="kvmosaic")."""
    AttentionInterface.register(ATTENTION_NAME, kvmosaic_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # prefill masks as for SDPA
