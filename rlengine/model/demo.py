"""A minimal end-to-end demo: greedy decoding through the model's plain causal forward.

This is the foundation's smoke job (no KV cache: every step re-runs the whole sequence), kept
as the simplest possible reference path. Real generation goes through rlengine.LLM.
"""

from __future__ import annotations

import time

import torch

from rlengine.model import Qwen3ForCausalLM
from rlengine.model.factory import build_model, tokenizer_for



def load_model_and_tokenizer(model: str, dtype: str = "float32", device: str | None = None):
    """A preset name (random weights, built-in tokenizer) or a checkpoint directory."""
    return build_model(model, dtype=dtype, device=device), tokenizer_for(model)


@torch.no_grad()
def greedy(model: Qwen3ForCausalLM, prompt_ids: list[int], max_tokens: int, eos_id: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(model(ids)[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]], device=ids.device)], dim=1)
    return out


def run_demo(model: str = "tiny", dtype: str = "float32", device: str | None = None, prompt: str = "12+34=",
             max_tokens: int = 16) -> list[int]:
    net, tok = load_model_and_tokenizer(model, dtype, device)
    ids = tok.encode(prompt)
    t0 = time.perf_counter()
    out = greedy(net, ids, max_tokens, tok.eos_token_id)
    dt = time.perf_counter() - t0
    print(f"model={model} device={net.device} dtype={net.dtype}")
    print(f"prompt {prompt!r} -> {tok.decode(out)!r} (ids {out})")
    print(f"{len(out)} tokens in {dt * 1e3:.1f} ms (random weights unless a checkpoint was given)")
    return out
