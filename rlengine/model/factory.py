"""One way to get a model (and its tokenizer) from a name: a preset or a HF checkpoint directory.

Presets get random weights (seeded) and the built-in tokenizer; checkpoint directories are
loaded with safetensors and use their tokenizer.json when present. Used by LLM, the trainer
and the demo so the three never disagree about what a model name means.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlengine.config import DTYPES, preset
from rlengine.model.loader import load_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_model(name: str, *, dtype: str | torch.dtype = "float32", device=None, moe_impl: str = "ref",
                seed: int = 0) -> Qwen3ForCausalLM:
    """A preset name (random init from `seed`) or a checkpoint directory -> Qwen3ForCausalLM."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device) if device is not None else default_device()
    if Path(str(name)).is_dir():
        return load_pretrained(name, dtype=dtype, device=device, moe_impl=moe_impl)
    return Qwen3ForCausalLM(preset(str(name)), moe_impl=moe_impl, device=device, dtype=dtype, seed=seed)


def tokenizer_for(name: str) -> Tokenizer:
    """The checkpoint's tokenizer.json if it has one, else the built-in tokenizer."""
    tok_file = Path(str(name)) / "tokenizer.json"
    return Tokenizer.from_file(tok_file) if tok_file.is_file() else Tokenizer.builtin()
