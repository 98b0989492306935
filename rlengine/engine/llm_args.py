"""LLM's construction arguments resolved: the model (a preset, a checkpoint directory, a Hugging Face hub id at a
revision, or a live module), its dtype
("auto" as vLLM spells it), its tokenizer, the vLLM arguments rlengine can honour, and generate's
progress bar. llm.py keeps the engine itself (requests, steps, outputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlengine.model.config import DTYPES
from rlengine.model.factory import build_model, has_tokenizer_files, tokenizer_for, tokenizer_from
from rlengine.model.hub import resolve_model
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer


def _as_dtype(dtype, model) -> torch.dtype | None:
    """The weights' dtype; "auto" (vLLM's default) is a checkpoint's config.json torch_dtype (float32 when it
    names none, and for presets), a live module's own dtype."""
    if dtype == "auto":
        if isinstance(model, Qwen3ForCausalLM):
            return model.dtype
        cfg = Path(str(model)) / "config.json"
        raw = json.loads(cfg.read_text()) if cfg.is_file() else {}
        name = raw.get("torch_dtype") or raw.get("dtype") or "float32"  # newer transformers write "dtype"
        if name not in DTYPES:
            raise ValueError(f"dtype='auto': {cfg} names torch_dtype {name!r}, rlengine runs {', '.join(DTYPES)}")
        return DTYPES[name]
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _resolve(model, revision: str | None):
    """A model name -> a preset name or a local directory (a hub id: its snapshot, model/hub.py), once, before
    anything reads files; a live module as it is (it has no revision)."""
    if isinstance(model, Qwen3ForCausalLM):
        if revision is not None:
            raise ValueError(f"revision={revision!r} names a hub commit; a live module has none")
        return model
    return resolve_model(str(model), revision=revision)


def _check_vllm_args(tensor_parallel_size, trust_remote_code) -> None:
    """vLLM arguments: the values rlengine can honour, or one error that says why not (gpu_memory_utilization's
    range is EngineSpec's check)."""
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: rlengine runs the model on one device "
                         "(the learner trains the same weights in place); only 1 is supported")
    if trust_remote_code:
        raise ValueError("trust_remote_code=True: rlengine runs its own Qwen3 / Qwen3-MoE code and never executes "
                         "code shipped with a checkpoint; only False is supported")


def _build_model(model, dtype, device, moe_impl) -> Qwen3ForCausalLM:
    if isinstance(model, Qwen3ForCausalLM):
        return model  # shared weights: never copied, never moved
    return build_model(str(model), dtype=dtype or torch.float32, device=device, moe_impl=moe_impl)


def _tokenizer(model, tokenizer) -> tuple[Tokenizer | None, bool]:
    """(the engine's tokenizer, whether its EOS ids count): a given one (Tokenizer, or a checkpoint directory or
    hub id with tokenizer files, whose vocabulary must fit the model's), else a checkpoint's own, the built-in
    one for a preset (whose config already names its EOS), None for a bare module."""
    if isinstance(tokenizer, (str, Path)) and isinstance(model, Qwen3ForCausalLM):
        return tokenizer_from(str(tokenizer), model.config.vocab_size), True
    if isinstance(tokenizer, (str, Path)):
        return tokenizer_for(str(model), tokenizer=str(tokenizer)), True
    if tokenizer is not None:
        return tokenizer, True
    if isinstance(model, Qwen3ForCausalLM):
        return None, False
    return tokenizer_for(str(model)), has_tokenizer_files(str(model))


def _progress_bar(use_tqdm, total: int):
    """vLLM's generate progress bar: use_tqdm True (tqdm.auto.tqdm) or a tqdm-like callable; None when off."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        make = use_tqdm
    else:
        from tqdm.auto import tqdm as make
    return make(total=total, desc="Processed prompts", dynamic_ncols=True)


DEFAULT_CPU_KV_BYTES = 256 * 2**20  # the CPU pool's cap when nothing sizes it: RAM is shared with everything else


def default_num_blocks(device, gpu_memory_utilization, max_model_len, budget, per_block, max_num_seqs,
                       block_size) -> int:
    """KV blocks when the caller gave no count: kv_cache_memory (`budget`) if set; on CUDA 80% of free
    memory, or vLLM's gpu_memory_utilization x total; on the CPU enough for max_num_seqs full-length
    sequences, capped at DEFAULT_CPU_KV_BYTES."""
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * 0.8)
        u = gpu_memory_utilization
        if u is not None:
            budget = int(u * total) - (total - free)  # vLLM: u x total for this engine, weights included
            if budget < per_block:
                raise ValueError(f"gpu_memory_utilization={u}: {u} x {total / 2**30:.1f} GiB leaves no room for "
                                 f"a KV block after the {(total - free) / 2**30:.1f} GiB already in use; raise it")
    if budget is None:
        need = max_num_seqs * -(-max_model_len // block_size)
        return max(1, min(need, DEFAULT_CPU_KV_BYTES // per_block))
    return budget // per_block


def batch_invariant_backend(model: Qwen3ForCausalLM, batch_invariant: bool, attention_backend: str) -> str:
    """Turn on batch-invariant mode on the model when asked (ValueError naming why where it cannot
    run) and return the attention backend to use: "invariant" whenever the model is in that mode, so
    a second engine on an invariant model (the trainer's eval engine) follows it."""
    if batch_invariant:
        model.batch_invariant = True
    if not model.batch_invariant:
        if attention_backend == "invariant":
            raise ValueError("attention_backend='invariant' is the batch-invariant mode's; pass batch_invariant=True")
        return attention_backend
    if attention_backend not in ("auto", "invariant"):
        raise ValueError(f"batch_invariant=True runs its own attention (backend 'invariant'), so "
                         f"attention_backend={attention_backend!r} cannot be combined with it")
    return "invariant"
