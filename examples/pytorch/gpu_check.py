# SPDX-License-Identifier: Apache-2.0
"""The PyTorch extension on a GPU: equal tokens and decode speed against transformers' own cache.

1. Random-weight Llama models of SmolLM2-135M's shape (30 layers, 9 query heads, 3 KV heads,
   head_dim 64) and of Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128;
   4 layers), bf16 on CUDA: greedy generate() with kvmosaic's dense cache in every layer follows
   transformers' DynamicCache (kvmosaic_torch.agreement: logits within twice the gap of eager
   attention, tokens equal up to a near-tie of the reference).
2. Decode tokens/s (CUDA events around whole decode steps, after warm-up): the same models,
   batch 1 and 8, with DynamicCache and with kvmosaic (SPEED_SPECS).

    python3 examples/pytorch/gpu_check.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvmosaic_torch.agreement import decode_agreement  # noqa: E402
from kvmosaic_torch.hf import KvmosaicCache, register  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64),
    "llama3-8b-attention-4-layers": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


# The kvmosaic caches timed (layer specs, docs/pytorch.md): every setting stated, so the rows keep
# their meaning when the library's defaults change.
SPEED_SPECS = {
    "kvmosaic dense": "dense:sinks=0/all",
    "kvmosaic quant2 Pi=64 nearest sinks4 (default)": "quant2:partition=64,rounding=nearest,sinks=4/all",
    "kvmosaic quant2 Pi=64 nearest no sinks": "quant2:partition=64,rounding=nearest,sinks=0/all",
    "kvmosaic quant4 Pi=64 nearest sinks4 (default)": "quant4:partition=64,rounding=nearest,sinks=4/all",
    "kvmosaic dense quest 1/8 pages": "dense:sinks=0/quest:budget=0.125,block=0",
    "kvmosaic dense quest 1/8 blocks of 16 (default)": "dense:sinks=0/quest:budget=0.125,block=16",
}


def model_of(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=65536, attn_implementation="kvmosaic",
                         initializer_range=0.1,  # clear greedy margins, as in test_torch.py
                         **SHAPES[shape])
    return LlamaForCausalLM(config).to(dtype=torch.bfloat16, device="cuda").eval()


def agreement(model, prompt: int, new: int) -> dict:
    """kvmosaic's dense cache against DynamicCache on greedy decoding (kvmosaic_torch.agreement):
    logit gaps teacher-forced on the reference's tokens, beside the gap of eager attention."""
    ids = torch.randint(0, 32000, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return decode_agreement(model, ids, new,
                            lambda: KvmosaicCache(model.config, "dense/all", device="cuda", max_tokens=prompt + new + 64))


def decode_speed(model, cache_factory, batch: int, context: int, steps: int = 32) -> float:
    """Tokens/s of teacher-forced decode steps (batch tokens each) after a prefill of `context`."""
    ids = torch.randint(0, 32000, (batch, context + steps + 8), device="cuda")
    cache = cache_factory()
    with torch.no_grad():
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for t in range(8):  # warm-up
            model(input_ids=ids[:, context + t:context + t + 1], past_key_values=cache, use_cache=True)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for t in range(steps):
            p = context + 8 + t
            model(input_ids=ids[:, p:p + 1], past_key_values=cache, use_cache=True)
        end.record()
        end.synchronize()
    return batch * steps / (begin.elapsed_time(end) / 1e3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="4096,32768", help="comma-separated; empty: tokens only")
    args = parser.parse_args()
    register()
    from transformers import DynamicCache
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "agreement": {}, "speed": []}
    for shape in SHAPES:
        model = model_of(shape)
        report["agreement"][shape] = agreement(model, prompt=300, new=48)
        print(shape, report["agreement"][shape], flush=True)
        for context in (int(c) for c in args.contexts.split(",") if c):
            for batch in (1, 8):
                caches = {"transformers DynamicCache": lambda: DynamicCache(config=model.config)}
                for name, spec in SPEED_SPECS.items():
                    caches[name] = lambda spec=spec: KvmosaicCache(model.config, spec, device="cuda",
                                                                   max_tokens=context + 64, max_batch=batch)
                for name, factory in caches.items():
                    try:
                        tps = decode_speed(model, factory, batch, context)
                    except torch.OutOfMemoryError:
                        tps = float("nan")
                    torch.cuda.empty_cache()
                    row = {"shape": shape, "context": context, "batch": batch, "cache": name, "tokens_per_s": tps}
                    report["speed"].append(row)
                    print(row, flush=True)
        del model
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all(a["agrees"] for a in report["agreement"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
