"""PEFT's adapter format for rlengine's LoRA adapters (model/lora.py): the directory PEFT reads and writes.

An adapter directory holds adapter_config.json and adapter_model.safetensors with one [r, C_in]
lora_A and one [C_out, r] lora_B per targeted HF projection per layer, under PEFT's names
(base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight). rlengine's fused adapters
(one A stack and one block-diagonal B per rlengine projection) split into those tensors on save and
are assembled from them on load. A trained LM head (modules_to_save = ["lm_head"], lora.SavedHead) is
base_model.model.lm_head.weight and trained embeddings base_model.model.model.embed_tokens.weight, as PEFT
saves its ModulesToSaveWrapper; tied (ensure_weight_tying) both are written, as PEFT writes them. peft
itself is not needed at run time: the format is a JSON file and safetensors. Errors (ConfigError) name the file and what disagrees: another base model's shapes, a
rank or target set that differs from the config, a LoRA variant rlengine does not compute (rslora,
DoRA, biases, per-module ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlengine.model.config import ConfigError
from rlengine.model.lora import ADAPTER_ATTR, PROJECTIONS, SAVE_MODULES, LoraAdapter, LoraSpec, SavedHead, lora_spec

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
HEAD_NAME = f"{PREFIX}lm_head.weight"  # a trained head (modules_to_save), PEFT's key
EMBED_NAME = f"{PREFIX}model.embed_tokens.weight"  # trained input embeddings


def _adapter_slots(model):
    """(layer index, rlengine projection, adapter) for every adapter of `model`."""
    for i, layer in enumerate(model.model.layers):
        for proj, (owner, _) in PROJECTIONS.items():
            adapter = getattr(getattr(layer, owner), ADAPTER_ATTR[proj], None)
            if adapter is not None:
                yield i, proj, adapter


def _pieces(i: int, proj: str, adapter: LoraAdapter):
    """(PEFT name of A, PEFT name of B, A rows slice, B (rows, cols) slices) per targeted HF projection."""
    owner, hf_names = PROJECTIONS[proj]
    names = [n for n, on in zip(hf_names, adapter.targeted) if on]
    for name, (row0, col0, rows) in zip(names, adapter.blocks()):
        base = f"{PREFIX}model.layers.{i}.{owner}.{name}"
        cols = slice(col0, col0 + adapter.r)
        yield f"{base}.lora_A.weight", f"{base}.lora_B.weight", cols, (slice(row0, row0 + rows), cols)


def peft_tensors(model) -> dict[str, torch.Tensor]:
    """The model's adapters as PEFT's tensors (contiguous CPU copies, in the model's dtype)."""
    out = {}
    for i, proj, adapter in _adapter_slots(model):
        A, B = adapter.lora_A.detach(), adapter.lora_B.detach()
        for a_name, b_name, a_rows, b_block in _pieces(i, proj, adapter):
            out[a_name] = A[a_rows].cpu().clone().contiguous()
            out[b_name] = B[b_block].cpu().clone().contiguous()
    for name, module in _saved_slots(model):
        out[name] = module.modules_to_save.weight.detach().cpu().clone().contiguous()
    return out


def _saved_slots(model):
    """(PEFT key, SavedHead or SavedEmbedding) of every trained copy (modules_to_save); a tied head too."""
    for name, module in ((EMBED_NAME, model.model.embed_tokens), (HEAD_NAME, model.lm_head)):
        if isinstance(module, SavedHead):
            yield name, module


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP-sharded parameter (a DTensor) all-gathered into a new tensor (a collective:
    every rank loads the same adapter in the same order), a plain parameter itself."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """param <- full in place; a sharded parameter takes its own shard of `full` (no communication)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    param.copy_(full)


@torch.no_grad()
def load_peft_tensors(model, tensors: dict[str, torch.Tensor], *, source: str = "adapter") -> None:
    """Copy PEFT's tensors into the model's adapters in place (the block-diagonal zeros of B stay zero).
    ConfigError for a missing, unexpected or wrongly shaped tensor (another base model, another rank)."""
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
               .replace(".modules_to_save.default.", "."): v for k, v in tensors.items()}
    used = set()
    spec = lora_spec(model)
    tied = spec is not None and spec.ties(model.config)
    for name, module in _saved_slots(model):
        if name not in tensors:
            if tied and name == HEAD_NAME:  # the tied head is the embeddings' copy, already loaded
                continue
            raise ConfigError(f"{source}: tensor {name!r} is missing (modules_to_save names {name.split('.')[-2]})")
        param = module.modules_to_save.weight
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, this "
                              f"base model needs {tuple(param.shape)} (an adapter for another base model or vocabulary)")
        if tied and name == HEAD_NAME and not torch.equal(tensors[name], tensors[EMBED_NAME]):
            raise ConfigError(f"{source}: ensure_weight_tying, but {HEAD_NAME!r} differs from {EMBED_NAME!r}")
        _assign(param, tensors[name].to(param.dtype))
        used.add(name)
    for i, proj, adapter in _adapter_slots(model):
        A, B = _full(adapter.lora_A), _full(adapter.lora_B)
        for a_name, b_name, a_rows, b_block in _pieces(i, proj, adapter):
            for name, dst in ((a_name, A[a_rows]), (b_name, B[b_block])):
                if name not in tensors:
                    raise ConfigError(f"{source}: tensor {name!r} is missing (an adapter for other target modules?)")
                t = tensors[name]
                if tuple(t.shape) != tuple(dst.shape):
                    raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, this base model and "
                                      f"rank need {tuple(dst.shape)} (an adapter for another base model or shape)")
                dst.copy_(t)
                used.add(name)
        if A is not adapter.lora_A:  # sharded parameters: each rank keeps its shard of the filled full tensors
            _assign(adapter.lora_A, A)
            _assign(adapter.lora_B, B)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ConfigError(f"{source}: {len(extra)} tensor(s) this model has no adapter for, e.g. {extra[0]!r} "
                          "(an adapter for another base model, more layers or other target modules)")


def adapter_config(spec: LoraSpec, base_model: str) -> dict:
    """adapter_config.json's content for `spec` on `base_model` (a path or hub id)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.r, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": list(spec.modules_to_save) or None,
            "ensure_weight_tying": spec.ensure_weight_tying, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None}


def save_adapter(model, path: str | Path, *, base_model: str) -> Path:
    """Write adapter_config.json and adapter_model.safetensors to `path` (temporary names, then renamed)."""
    spec = lora_spec(model)
    if spec is None:
        raise ValueError("save_adapter: the model has no LoRA adapters")
    return write_adapter(path, peft_tensors(model), adapter_config(spec, base_model))


def write_adapter(path: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write PEFT's two files from host tensors (peft_tensors) and a config (adapter_config): save_adapter's
    second half, for a caller that took the tensors earlier (an FSDP save takes them while unsharded)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_NAME)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return path


def read_adapter_spec(path: str | Path) -> LoraSpec:
    """adapter_config.json of a PEFT adapter directory -> LoraSpec (ConfigError naming the file)."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise ConfigError(f"LoRA adapter {str(path)!r}: no {CONFIG_NAME} there (not a PEFT adapter directory)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cfg_path}: not valid JSON ({exc})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{cfg_path}: peft_type {raw.get('peft_type')!r}; only LORA adapters load")
    for key, ok in (("use_rslora", False), ("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if raw.get(key, ok) != ok:
            raise ConfigError(f"{cfg_path}: {key} = {raw[key]!r} is not supported (rlengine computes plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if raw.get(key):
            raise ConfigError(f"{cfg_path}: {key} is not supported (one rank and alpha on every layer)")
    raw_saved = raw.get("modules_to_save") or []
    saved = tuple(dict.fromkeys(m.split(".")[-1] for m in raw_saved))  # PEFT adds "model.embed_tokens" when tying
    if raw.get("trainable_token_indices") or any(m not in SAVE_MODULES for m in saved):
        raise ConfigError(f"{cfg_path}: modules_to_save {raw_saved!r} / trainable_token_indices: only "
                          f"modules_to_save within {list(SAVE_MODULES)!r} is supported")
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"{cfg_path}: target_modules as a regular expression is not supported; list the names")
    return LoraSpec(r=int(raw["r"]), alpha=float(raw.get("lora_alpha", 8)), dropout=float(raw.get("lora_dropout", 0.0)),
                    targets=tuple([targets] if isinstance(targets, str) else targets or ()),
                    modules_to_save=saved, ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)))


def load_adapter(model, path: str | Path) -> None:
    """Fill the model's adapters (already added with the directory's spec) from adapter_model.safetensors."""
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise ConfigError(f"LoRA adapter {str(path)!r}: no {WEIGHTS_NAME} there")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{file}: cannot read safetensors file ({exc})") from None
    load_peft_tensors(model, tensors, source=str(file))


def job_lora_spec(section) -> LoraSpec | None:
    """The adapter spec of a job's model section: model.lora_path's adapter_config.json when set (model.lora_r,
    if also set, must agree with it), else model.lora_* (lora_spec_of); None without LoRA."""
    from rlengine.model.lora import lora_spec_of

    spec = lora_spec_of(section)
    if not section.lora_path:
        return spec
    saved = read_adapter_spec(section.lora_path)
    if spec is not None and (spec.r, spec.targets, set(spec.modules_to_save), spec.ensure_weight_tying) != (
            saved.r, saved.targets, set(saved.modules_to_save), saved.ensure_weight_tying):
        raise ConfigError(f"model.lora_path {section.lora_path!r} holds an adapter of r = {saved.r} on "
                          f"{', '.join(saved.targets)} saving {list(saved.modules_to_save)}; model.lora_r / "
                          f"lora_target_modules / lora_modules_to_save ask for r = {spec.r} on "
                          f"{', '.join(spec.targets)} saving {list(spec.modules_to_save)} "
                          "(leave model.lora_r at 0 to take the adapter's)")
    return saved


def attach_lora(model, section, *, base: str, seed: int = 0) -> LoraSpec | None:
    """Add the job's adapters (job_lora_spec) to `model`, filled from model.lora_path when set, and record
    the base it sits on (`base`: the model's path or preset name) for checkpoints; None without LoRA."""
    from rlengine.model.lora import add_lora

    spec = job_lora_spec(section)
    if spec is None:
        return None
    add_lora(model, spec, seed=seed)
    if section.lora_path:
        load_adapter(model, section.lora_path)
    model.lora_base = str(base)
    return spec


def load_lora(model, path: str | Path, *, base: str = "") -> LoraSpec:
    """Add adapters to `model` as a PEFT adapter directory describes them and fill them from it (LLM's
    lora_path). ConfigError for an adapter of another shape or a LoRA variant rlengine does not compute."""
    from rlengine.model.lora import add_lora

    spec = read_adapter_spec(path)
    add_lora(model, spec)
    load_adapter(model, path)
    model.lora_base = str(base)
    return spec
