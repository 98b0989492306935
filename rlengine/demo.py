"""A minimal end-to-end demo: greedy decoding through the model's plain causal forward.

This is the foundation's smoke job (no KV cache: every step re-runs the whole sequence), kept
as the simplest possible reference path. Real generation goes through rlengine.LLM.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlengine.config import preset
from rlengine.model import Qwen3ForCausalLM, load_pretrained
from rlengine.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_and_tokenizer(model: str, dtype: str = "float32", device: str | None = None):
    """A preset name (random weights, built-in tokenizer) or a checkpoint directory."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if Path(model).is_dir():
        net = load_pretrained(model, dtype=DTYPES[dtype], device=device)
        tok_file = Path(model) / "tokenizer.json"
        tok = Tokenizer.from_file(tok_file) if tok_file.exists() else Tokenizer.builtin()
    else:
        net = Qwen3ForCausalLM(preset(model), device=device, dtype=DTYPES[dtype])
        tok = Tokenizer.builtin()
    return net, tok


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
