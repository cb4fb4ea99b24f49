# SPDX-License-Identifier: Apache-2.0
"""How closely a model decoding through a kvmosaic cache follows transformers' own cache.

Two correct attention implementations round differently (kvmosaic accumulates in float32 in its
own order; SDPA and eager attention in theirs), and a random-weight model amplifies that through
its layers, so greedy tokens can part at a near-tie. `decode_agreement` therefore measures on
one token path, the reference's:

1. greedy `generate()` with DynamicCache and SDPA gives the reference tokens;
2. those tokens are fed, teacher-forced, through the model with DynamicCache and SDPA (the
   reference logits), with the cache under test, and with DynamicCache and eager attention (transformers' other implementation: the yardstick
   of how far two correct implementations differ on this model);
3. `generate()` with the cache under test gives its own greedy tokens.

A cache agrees when its largest logit difference from the reference stays within
`tolerance_of(eager gap, logits)` and its greedy tokens equal the reference's up to a step where
the reference's top two logits were closer than twice that tolerance (a near-tie, which either
implementation may break either way).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["teacher_forced_logits", "decode_agreement", "tolerance_of"]


def teacher_forced_logits(model, tokens: torch.Tensor, prompt: int, cache) -> torch.Tensor:
    """Logits [steps][batch][vocab] of a prefill of tokens[:, :prompt] followed by one decode step
    per further token: row i predicts token prompt + i."""
    rows = []
    with torch.no_grad():
        out = model(input_ids=tokens[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[:, -1])
        for p in range(prompt, tokens.shape[1] - 1):
            out = model(input_ids=tokens[:, p:p + 1], past_key_values=cache, use_cache=True)
            rows.append(out.logits[:, -1])
    return torch.stack(rows).float()


def tolerance_of(eager_gap: float, largest_logit: float, dtype: torch.dtype) -> float:
    """Twice the gap between transformers' two attention implementations, and at least 4 units in
    the last place of the largest logit in the model's dtype (where eager and SDPA happen to round
    alike)."""
    eps = torch.finfo(dtype).eps
    return max(2.0 * eager_gap, 4.0 * eps * max(largest_logit, 1.0))


def decode_agreement(model, ids: torch.Tensor, new: int, make_cache: Callable[[], object]) -> dict:
    """Agreement of the cache `make_cache()` with transformers' DynamicCache on greedy decoding of
    `new` tokens after the prompt `ids` [1][prompt] (see the module's docstring)."""
    from transformers import DynamicCache
    prompt = ids.shape[1]
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)  # no stop at an end token
    with torch.no_grad():
        ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **options)
    ref_tokens = ref[:, prompt:]
    reference = teacher_forced_logits(model, ref, prompt, DynamicCache(config=model.config))
    tested = teacher_forced_logits(model, ref, prompt, make_cache())
    attention = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        eager = teacher_forced_logits(model, ref, prompt, DynamicCache(config=model.config))
    finally:
        model.set_attn_implementation(attention)
    tested_gap = float((tested - reference).abs().max())
    eager_gap = float((eager - reference).abs().max())
    tolerance = tolerance_of(eager_gap, float(reference.abs().max()), model.dtype)
    top2 = reference[:, 0].topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()

    with torch.no_grad():
        got = model.generate(ids, past_key_values=make_cache(), **options)
    got_tokens = got[:, prompt:]
    first_difference = next((i for i in range(new) if got_tokens[0, i] != ref_tokens[0, i]), None)
    near_tie = first_difference is None or margins[first_difference] <= 2.0 * tolerance
    return {
        "prompt": prompt, "new": new,
        "max_logit": float(reference.abs().max()),
        "tested_gap": tested_gap, "eager_gap": eager_gap,
        "relative_l2": float((tested - reference).norm() / reference.norm()), "tolerance": tolerance,
        "teacher_forced_top1": float((tested[:, 0].argmax(-1) == ref_tokens[0]).float().mean()),
        "equal_tokens": first_difference is None, "first_difference": first_difference,
        "reference_margin_at_difference": None if first_difference is None else margins[first_difference],
        "agrees": tested_gap <= tolerance and near_tie,
    }
