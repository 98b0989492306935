"""One way to get a model (and its tokenizer) from a name: a preset or a HF checkpoint directory.

Presets get random weights (seeded) and the built-in tokenizer; checkpoint directories are
loaded with safetensors and use their own tokenizer files (Tokenizer.from_pretrained). A checkpoint's
model config stops at config.json's eos_token_id AND generation_config.json's list (chat models list
several there), so every engine on the model ends responses at each. Used by LLM, the trainer and the
demo so the three never disagree about what a model name means.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlengine.config import DTYPES, preset
from rlengine.model.generation_config import generation_eos_ids, merge_ids
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
        model = load_pretrained(name, dtype=dtype, device=device, moe_impl=moe_impl)
        eos = merge_ids(model.config.eos_token_ids, generation_eos_ids(name))
        model.config.eos_token_id = eos[0] if len(eos) == 1 else (eos or None)
        return model
    return Qwen3ForCausalLM(preset(str(name)), moe_impl=moe_impl, device=device, dtype=dtype, seed=seed)


def has_tokenizer_files(name: str) -> bool:
    """True for a checkpoint directory that ships any tokenizer file (then it must load, or fail clearly)."""
    path = Path(str(name))
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return path.is_dir() and any((path / f).is_file() for f in files)


def tokenizer_for(name: str) -> Tokenizer:
    """A checkpoint directory's own tokenizer (CheckpointError if its files are broken or incomplete); the
    built-in tokenizer for presets and for directories without tokenizer files (checkpoints rlengine saved
    from a preset)."""
    return Tokenizer.from_pretrained(name) if has_tokenizer_files(name) else Tokenizer.builtin()
