"""`rlengine export --merge RUN_DIR OUT`: a LoRA run's adapter merged into its base, as a HF checkpoint.

Reads the checkpoint RUN_DIR/checkpoints/latest names (or a checkpoint directory itself): its base.json
gives the base (checked against the recorded hash of its weight files), its adapter/ the PEFT adapter.
Each projection becomes W + s * B A, computed in fp32 and written in the base's dtype with
save_pretrained (what transformers loads), with the base's tokenizer files copied beside it. The
merged model serves without rlengine's LoRA path; training keeps the adapters unmerged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


def add_export_parser(sub) -> None:
    """The `export` subcommand on the CLI's subparsers."""
    p = sub.add_parser("export", help="write a LoRA run's adapter merged into its base as a HF checkpoint",
                       description="Merge the adapter of RUN_DIR's latest checkpoint (or of a checkpoint "
                       "directory) into its base model and write OUT: config.json + safetensors.")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base weights (required)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a LoRA run directory, or one of its checkpoint directories")
    p.add_argument("out", metavar="OUT", help="the directory to write (must not hold files)")
    p.set_defaults(func=cmd_export)


def _checkpoint(path: Path) -> Path:
    from rlengine.model.config import ConfigError
    from rlengine.rl.trainer.adapter_ckpt import is_adapter_checkpoint
    from rlengine.rl.trainer.checkpoint import latest_checkpoint

    if is_adapter_checkpoint(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run directory")
    try:
        ckpt = latest_checkpoint(path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if not is_adapter_checkpoint(ckpt):
        raise ConfigError(f"{ckpt}: not a LoRA checkpoint (no adapter/); a full fine-tuning checkpoint's model/ "
                          "is already a HF checkpoint")
    return ckpt


@torch.no_grad()
def merge_adapters(model) -> None:
    """Fold every adapter into its projection in place (W += s * (B * mask) A in fp32) and remove them; a
    trained head (modules_to_save) becomes the model's own, untied from the embeddings."""
    from rlengine.model.lora import ADAPTER_ATTR, PROJECTIONS, unwrap_saved_head

    for layer in model.model.layers:
        for proj, (owner, _) in PROJECTIONS.items():
            holder = getattr(layer, owner)
            adapter = getattr(holder, ADAPTER_ATTR[proj], None)
            if adapter is None:
                continue
            w = getattr(holder, proj).weight
            delta = (adapter.lora_B.float() * adapter.mask.float()) @ adapter.lora_A.float()
            w.copy_((w.float() + adapter.scale * delta).to(w.dtype))
            delattr(holder, ADAPTER_ATTR[proj])
            setattr(holder, ADAPTER_ATTR[proj], None)
    unwrap_saved_head(model)  # modules_to_save = ["lm_head"]: the trained head, untied
    model.lora = None


def cmd_export(args) -> int:
    import json

    from rlengine.model.config import ConfigError
    from rlengine.model.loader import load_pretrained, save_pretrained
    from rlengine.model.lora_peft import load_lora
    from rlengine.rl.trainer.adapter_ckpt import ADAPTER_DIR, BASE_RECORD, check_adapter_base

    if not args.merge:
        raise ConfigError("export needs --merge (the unmerged adapter is already in the checkpoint's adapter/)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; give a new directory for the merged model")
    ckpt = _checkpoint(Path(args.run_dir))
    base = Path(json.loads((ckpt / BASE_RECORD).read_text()).get("base_model", ""))
    if not base.is_dir():
        raise ConfigError(f"{ckpt / BASE_RECORD}: base {str(base)!r} is not a checkpoint directory (a preset base "
                          "has no files to merge into; save it with save_pretrained and train from that directory)")
    raw = json.loads((base / "config.json").read_text())
    dtype = getattr(torch, str(raw.get("torch_dtype") or raw.get("dtype") or "float32"), torch.float32)
    model = load_pretrained(base, dtype=torch.float32)
    model.lora_base = str(base)
    check_adapter_base(ckpt, model)
    load_lora(model, ckpt / ADAPTER_DIR, base=str(base))
    merge_adapters(model)
    save_pretrained(model.to(dtype), out)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    print(f"merged {ckpt / ADAPTER_DIR} into {base}: {out}")
    return 0
