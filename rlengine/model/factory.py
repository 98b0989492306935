"""One way to get a model (and its tokenizer) from a name: a preset, a HF checkpoint directory or a hub id.

A name is resolved once (model/hub.py: preset, then directory, then hub id -> its cached snapshot).
Presets get random weights (seeded) and the built-in tokenizer; checkpoint directories are
loaded with safetensors and use their own tokenizer files (Tokenizer.from_pretrained), or a tokenizer
named apart (a directory or hub id) whose vocabulary must fit the model's. A checkpoint's
model config stops at config.json's eos_token_id AND generation_config.json's list (chat models list
several there), so every engine on the model ends responses at each. Used by LLM, the trainer and the
demo so the three never disagree about what a model name means.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlengine.model.config import DTYPES, ConfigError, ModelConfig, preset
from rlengine.model.generation_config import generation_eos_ids, merge_ids
from rlengine.model.hub import resolve_model
from rlengine.model.loader import load_model_config, load_pretrained
from rlengine.model.moe import MOE_IMPLS, triton_available
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_moe_impl(moe_impl: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on a CUDA device with triton installed (sync-free experts: MoE decode steps can run
    as CUDA graphs), else "ref" (the torch loop); "ref" / "triton" unchanged (anything else: ValueError)."""
    if moe_impl == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "ref"
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be 'auto' or one of {MOE_IMPLS}, got {moe_impl!r}")
    return moe_impl


def build_model(name: str, *, dtype: str | torch.dtype = "float32", device=None, moe_impl: str = "auto",
                seed: int = 0, revision: str | None = None) -> Qwen3ForCausalLM:
    """A preset name (random init from `seed`), a checkpoint directory or a hub id (at `revision`) ->
    Qwen3ForCausalLM. moe_impl: "auto" (resolve_moe_impl: Triton on a GPU), "ref" or "triton"."""
    name = resolve_model(name, revision=revision)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device) if device is not None else default_device()
    moe_impl = resolve_moe_impl(moe_impl, device)
    if Path(str(name)).is_dir():
        model = load_pretrained(name, dtype=dtype, device=device, moe_impl=moe_impl)
        eos = merge_ids(model.config.eos_token_ids, generation_eos_ids(name))
        model.config.eos_token_id = eos[0] if len(eos) == 1 else (eos or None)
        return model
    return Qwen3ForCausalLM(preset(str(name)), moe_impl=moe_impl, device=device, dtype=dtype, seed=seed)


def model_config(name: str, *, revision: str | None = None) -> ModelConfig:
    """The ModelConfig a model name means: a preset's, or config.json of a checkpoint directory or hub id."""
    path = resolve_model(name, revision=revision)
    return load_model_config(path) if Path(path).is_dir() else preset(path)


def has_tokenizer_files(name: str) -> bool:
    """True for a checkpoint directory that ships any tokenizer file (then it must load, or fail clearly)."""
    path = Path(str(name))
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return path.is_dir() and any((path / f).is_file() for f in files)


# The largest vocabulary of a preset made for the built-in tokenizer (the tiny presets pad its 51 tokens to
# 256, qwen3-30m to 4096): a checkpoint without tokenizer files and a larger vocabulary was trained with a
# tokenizer that is missing, and the built-in one would silently produce ids it never learned.
BUILTIN_TOKENIZER_MAX_VOCAB = 4096


def tokenizer_for(name: str, *, revision: str | None = None, tokenizer: str | None = None,
                  what: str = "tokenizer") -> Tokenizer:
    """The tokenizer of model `name` (a preset, checkpoint directory or hub id at `revision`): `tokenizer` when
    given (tokenizer_from: a directory or hub id, checked against the model's vocabulary; `what` names that
    option in messages); else a checkpoint's own (CheckpointError if its files are broken or incomplete); the
    built-in tokenizer for presets and for directories without tokenizer files (checkpoints rlengine saved
    from a preset). Such a directory whose model has a vocabulary over BUILTIN_TOKENIZER_MAX_VOCAB is a
    ConfigError naming both sizes (pass a tokenizer explicitly: LLM(..., tokenizer=DIR))."""
    name = resolve_model(name, revision=revision)
    if tokenizer is not None:
        return tokenizer_from(tokenizer, model_config(name).vocab_size, what=what)
    if has_tokenizer_files(name):
        return Tokenizer.from_pretrained(name)
    tok = Tokenizer.builtin()
    if Path(str(name)).is_dir():
        vocab = load_model_config(name).vocab_size
        if vocab > BUILTIN_TOKENIZER_MAX_VOCAB:
            raise ConfigError(
                f"{name}: no tokenizer files (tokenizer.json / tokenizer_config.json) and the model's vocabulary is "
                f"{vocab} tokens; the built-in tokenizer (used then) has {tok.vocab_size}, which only suits "
                f"rlengine's small presets (vocabularies up to {BUILTIN_TOKENIZER_MAX_VOCAB}): copy the tokenizer "
                "files of the model it was trained from into the directory, or pass one explicitly "
                "(LLM(..., tokenizer=...), rlengine generate --tokenizer DIR)")
    return tok


def tokenizer_from(name: str, vocab_size: int, *, what: str = "tokenizer") -> Tokenizer:
    """The tokenizer files of a directory or hub id (`what` names the option in messages), for a model of
    vocab_size tokens: ConfigError when there are none, or when the tokenizer has more tokens than the model
    has embeddings (its ids past vocab_size would index nothing: a tokenizer of another model family)."""
    path = resolve_model(name, what=what, files="tokenizer")
    if not has_tokenizer_files(path):
        raise ConfigError(f"{what} {name!r}: no tokenizer files (tokenizer.json / tokenizer_config.json) there")
    tok = Tokenizer.from_pretrained(path)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"{what} {name!r} has a vocabulary of {tok.vocab_size} tokens and the model only "
                          f"{vocab_size}: a tokenizer of another model; use the one the model was trained with")
    return tok
