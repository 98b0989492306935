"""The model half of a LoRA run's checkpoint: the adapter in PEFT's format and a record of its base.

The base is the model as the run starts its RL phase: model.name's weights, or, after a format warm
start (which trains the whole model: a random preset has no pretrained base to adapt), those weights
warm-started, written once to RUN_DIR/base/ (HF format) so that a resume and PEFT find them
(attach_run_lora). With LoRA (model/lora.py) the base weights never change, so a checkpoint does not save them again:
RUN_DIR/checkpoints/<update>/adapter/ holds adapter_config.json and adapter_model.safetensors
(model/lora_peft.py: what peft.PeftModel.from_pretrained loads on the transformers model of the same
base), and base.json records the base's path (or preset name) and a sha256 of its weight files (for
a preset, of its frozen weights' bytes). The rest of the checkpoint (fp32 masters of the adapters,
optimizer, RNG, counters) is checkpoint.py's as for full fine-tuning; checkpoint.py calls these
functions where it would save or load the full model, and sharded.py (FSDP) writes adapter_export's
copies, taken by rank 0 from the unsharded adapters, where it would write the HF export. Loading checks
the base hash first: an adapter trained on other base weights is a CheckpointError naming both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from rlengine.model.config import ConfigError
from rlengine.model.hub import resolve_model
from rlengine.model.loader import CheckpointError, load_pretrained, save_pretrained
from rlengine.model.lora import lora_spec
from rlengine.model.lora_peft import (adapter_config, attach_lora, job_lora_spec, load_adapter, peft_tensors,
                                      write_adapter)
from rlengine.rl.distributed import full_tensor

ADAPTER_DIR = "adapter"
BASE_RECORD = "base.json"
BASE_DIR = "base"


def attach_run_lora(model, cfg, run_dir: Path, *, warm_started: bool, resumed: bool, write: bool) -> None:
    """Add the job's adapters (model.lora_*; nothing without them) once the base is final. After a warm
    start the base is RUN_DIR/base/: written now by the writing rank of a new run, read back on resume
    (the resumed model was built from model.name, not warm-started)."""
    if job_lora_spec(cfg.model) is None:
        return
    if cfg.run.async_checkpoint:
        raise ConfigError("model.lora_r: LoRA runs with run.async_checkpoint = false "
                          "(asynchronous checkpoints of adapters are not supported yet)")
    base = resolve_model(cfg.model.name, revision=cfg.model.revision or None, what="model.name")
    if warm_started:
        base = Path(run_dir) / BASE_DIR
        if resumed:
            saved = load_pretrained(base, dtype=model.dtype, device="cpu")
            with torch.no_grad():
                for p, q in zip(model.parameters(), saved.parameters()):
                    p.copy_(q)
        elif write:
            save_pretrained(model, base)
    attach_lora(model, cfg.model, base=str(base), seed=cfg.run.seed)


def is_adapter_checkpoint(path: Path) -> bool:
    return (Path(path) / ADAPTER_DIR).is_dir()


def base_hash(model) -> str:
    """sha256 of the base: its *.safetensors files (sorted by name) for a checkpoint directory, else the
    bytes of its frozen weights in parameters() order (FSDP-sharded ones all-gathered: then every rank
    calls it). Computed once per model (the base is frozen)."""
    cached = getattr(model, "lora_base_hash", None)
    if cached:
        return cached
    h = hashlib.sha256()
    base = Path(getattr(model, "lora_base", ""))
    files = sorted(base.glob("*.safetensors")) if base.is_dir() else []
    if files:
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as handle:
                while chunk := handle.read(1 << 24):
                    h.update(chunk)
    else:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                h.update(name.replace(".original_module.", ".").encode())  # a SavedHead's base: lm_head.weight
                h.update(full_tensor(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    model.lora_base_hash = "sha256:" + h.hexdigest()
    return model.lora_base_hash


def adapter_export(model) -> tuple[dict, dict, dict]:
    """What a checkpoint's adapter/ and base.json hold, as host copies: (PEFT tensors, adapter_config.json,
    base record). Taken from full parameters: under FSDP, by rank 0 inside the unshard (sharded.py)."""
    base = str(getattr(model, "lora_base", ""))
    return (peft_tensors(model), adapter_config(lora_spec(model), base),
            {"base_model": base, "base_hash": base_hash(model)})


def write_adapter_export(export: tuple[dict, dict, dict], out: Path) -> None:
    """Write out/adapter/ (PEFT format) and out/base.json from adapter_export's host copies."""
    tensors, config, record = export
    write_adapter(Path(out) / ADAPTER_DIR, tensors, config)
    (Path(out) / BASE_RECORD).write_text(json.dumps(record, indent=2))


def save_adapter_checkpoint(model, out: Path) -> None:
    """Write out/adapter/ (PEFT format) and out/base.json."""
    write_adapter_export(adapter_export(model), out)


def check_adapter_base(path: Path, model) -> None:
    """CheckpointError unless the checkpoint's adapter was trained on this model's base weights."""
    file = Path(path) / BASE_RECORD
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc}); the checkpoint is incomplete or damaged") from None
    if record.get("base_hash") != base_hash(model):
        raise CheckpointError(f"{file}: the adapter was trained on base {record.get('base_model')!r} "
                              f"({record.get('base_hash')}); the job's base {getattr(model, 'lora_base', '')!r} has "
                              f"other weights ({base_hash(model)})")


def load_adapter_checkpoint(path: Path, model) -> None:
    """Restore the adapters in place from path/adapter/ (the engine keeps decoding from them)."""
    try:
        load_adapter(model, Path(path) / ADAPTER_DIR)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
