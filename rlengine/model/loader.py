"""Load and save Hugging Face Qwen3 / Qwen3-MoE / Qwen2 / Llama checkpoints (config.json + safetensors).

`load_pretrained` builds the model on the meta device, materialises it on the target device
and fills every parameter from single or sharded *.safetensors files (never pickle), then
checks nothing is missing. `save_pretrained` writes a directory that transformers loads back
(per-expert tensors, separate q/k/v and gate/up). Errors name the file and tensor at fault
and leave no half-built model behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlengine.model.config import ConfigError, ModelConfig
from rlengine.model.hf_names import WeightSpec, weight_map
from rlengine.model.hub import is_hub_id, resolve_model
from rlengine.model.qwen3 import Qwen3ForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable, or disagrees with its config."""


def checkpoint_dir(path: str | Path, revision: str | None = None) -> Path:
    """A checkpoint directory, or a Hugging Face hub id (org/name, at `revision`) -> its snapshot directory
    (model/hub.py); any other path as it is, for the caller to report."""
    if revision or (not Path(path).is_dir() and is_hub_id(str(path))):
        return Path(resolve_model(str(path), revision=revision))
    return Path(path)


def load_model_config(path: str | Path, *, revision: str | None = None) -> ModelConfig:
    """config.json of a checkpoint directory or hub id -> ModelConfig (CheckpointError / ConfigError naming it)."""
    cfg_path = checkpoint_dir(path, revision) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing (a checkpoint directory needs config.json)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
    return ModelConfig.from_hf_dict(raw, source=str(cfg_path))


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it, from the shard index or the single file."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from None
        missing = sorted({f for f in mapping.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{path}: shard file(s) listed in {INDEX_NAME} are missing: {', '.join(missing)}")
        return {name: path / f for name, f in mapping.items()}
    single = path / SINGLE_NAME
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file found")
    out = {}
    for f in files:
        with _open(f) as handle:
            out.update({k: f for k in handle.keys()})
    return out


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read safetensors file ({exc})") from None


class _Reader:
    """Reads tensors by HF name, keeping each shard open once."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.handles = files, {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = _open(file)
        try:
            return self.handles[file].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from None


def _assemble(spec: WeightSpec, reader: _Reader) -> torch.Tensor:
    if spec.fused_name and reader.has(spec.fused_name) and not reader.has(spec.hf_names[0]):
        return reader.get(spec.fused_name)
    parts = [reader.get(n) for n in spec.hf_names]
    if spec.stack_experts:
        per = len(parts) // spec.stack_experts
        return torch.stack([torch.cat(parts[e * per:(e + 1) * per], dim=0) for e in range(spec.stack_experts)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def load_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    moe_impl: str = "ref", revision: str | None = None) -> Qwen3ForCausalLM:
    """Load a HF checkpoint directory (or hub id, at `revision`) -> Qwen3ForCausalLM on `device` in `dtype`.

    Raises CheckpointError / ConfigError naming the file, tensor or field on any problem.
    """
    path = checkpoint_dir(path, revision)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    cfg = load_model_config(path)
    reader = _Reader(_weight_files(path))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, moe_impl=moe_impl, seed=None)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    specs = weight_map(cfg)
    with torch.no_grad():
        for name, spec in specs.items():
            tensor = _assemble(spec, reader)
            target = params[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{reader.files.get(spec.hf_names[0], path)}: tensor {spec.hf_names[0]!r} "
                                      f"gives {name} shape {tuple(tensor.shape)}, config.json implies "
                                      f"{tuple(target.shape)}")
            target.copy_(tensor)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_buffers()
    return model


def _hf_tensors(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Split rlengine parameters back into HF tensors (contiguous CPU copies)."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for name, spec in weight_map(cfg).items():
        t = params[name].detach().cpu()
        if spec.stack_experts:
            per = len(spec.hf_names) // spec.stack_experts
            for e in range(spec.stack_experts):
                names = spec.hf_names[e * per:(e + 1) * per]
                for n, piece in zip(names, t[e].chunk(per, dim=0)):
                    out[n] = piece.contiguous()
            continue
        if len(spec.hf_names) == 1:
            out[spec.hf_names[0]] = t.contiguous()
            continue
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            sizes = [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2
        else:
            sizes = [t.shape[0] // len(spec.hf_names)] * len(spec.hf_names)
        for n, piece in zip(spec.hf_names, t.split(sizes, dim=0)):
            out[n] = piece.contiguous()
    return out


def hf_export(model: Qwen3ForCausalLM) -> tuple[dict[str, torch.Tensor], dict]:
    """The model as HF tensors (CPU copies that own their memory: training may go on meanwhile) and
    its HF config.json dict: what write_hf_export writes."""
    own = _storage_ptrs(model)
    tensors = {n: t.clone() if t.untyped_storage().data_ptr() in own else t for n, t in _hf_tensors(model).items()}
    hf_cfg = model.config.to_hf_dict()
    hf_cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    return tensors, hf_cfg


def _storage_ptrs(model: torch.nn.Module) -> set[int]:
    """Data pointers of the model's own storage (a CPU model's export pieces may alias it)."""
    return {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type == "cpu"}


def save_pretrained(model: Qwen3ForCausalLM, path: str | Path, *, max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write config.json and safetensors (sharded with an index above max_shard_bytes) to `path`.

    Files are written under temporary names and renamed, so an interrupted save leaves no
    half-written checkpoint behind.
    """
    return write_hf_export(*hf_export(model), path, max_shard_bytes=max_shard_bytes)


def write_hf_export(tensors: dict[str, torch.Tensor], hf_cfg: dict, path: str | Path, *,
                    max_shard_bytes: int = 2 * 2**30) -> Path:
    """save_pretrained's writing half, from hf_export's tensors and config (any thread)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = [SINGLE_NAME] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        tmp = path / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.replace(path / fname)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: f for shard, f in zip(shards, names) for n in shard}}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2))
    elif (path / INDEX_NAME).exists():
        (path / INDEX_NAME).unlink()
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return path


load_config = load_model_config  # the name before load_model_config; kept for old imports

__all__ = ["load_pretrained", "save_pretrained", "load_model_config", "load_config", "CheckpointError", "ConfigError"]
