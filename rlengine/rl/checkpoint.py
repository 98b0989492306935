"""Run checkpoints: HF-format weights (safetensors) plus optimizer, RNG, sampler and counter state.

Layout: RUN_DIR/checkpoints/update-000040/{model/ (config.json + model.safetensors),
critic.safetensors, optim.safetensors, optim.json, state.json}. Everything is written to a
temporary directory that is renamed into place, then RUN_DIR/checkpoints/latest is
replaced atomically, so a crash never leaves a half-written checkpoint that resume would
read. Optimizer tensors go to safetensors, scalars to JSON: no pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlengine.model.loader import load_pretrained, save_pretrained


def _optim_to_files(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors = {f"{prefix}.{i}.{k}": v.detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    return tensors, {"param_groups": sd["param_groups"], "state_keys": {str(i): list(st) for i, st in sd["state"].items()}}


def _optim_from_files(opt: torch.optim.Optimizer, tensors: dict, meta: dict, prefix: str, device) -> None:
    state = {int(i): {k: tensors[f"{prefix}.{i}.{k}"].to(device if k != "step" else "cpu") for k in keys}
             for i, keys in meta["state_keys"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(run_dir: Path, update: int, *, model, learner, state: dict) -> Path:
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"update-{update:06d}"
    tmp = ckpt_root / f".tmp-update-{update:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_pretrained(model, tmp / "model")
    tensors, meta = _optim_to_files(learner.opt, "actor")
    metas = {"actor": meta}
    if learner.critic is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in learner.critic.state_dict().items()},
                  str(tmp / "critic.safetensors"))
        ct, cm = _optim_to_files(learner.critic_opt, "critic")
        tensors.update(ct)
        metas["critic"] = cm
    save_file(tensors, str(tmp / "optim.safetensors"))
    (tmp / "optim.json").write_text(json.dumps(metas))
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = ckpt_root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, ckpt_root / "latest")
    return final


def latest_checkpoint(run_dir: Path) -> Path:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest (nothing to resume from)")
    return run_dir / "checkpoints" / pointer.read_text().strip()


def load_checkpoint(path: Path, *, model, learner) -> dict:
    """Restore weights in place (the engine keeps sharing them), optimizers and critic; returns state.json."""
    saved = load_pretrained(path / "model", dtype=model.dtype, device="cpu")
    with torch.no_grad():
        for p, q in zip(model.parameters(), saved.parameters()):
            p.copy_(q)
    tensors = load_file(str(path / "optim.safetensors"))
    metas = json.loads((path / "optim.json").read_text())
    _optim_from_files(learner.opt, tensors, metas["actor"], "actor", model.device)
    if learner.critic is not None:
        learner.critic.load_state_dict(load_file(str(path / "critic.safetensors")))
        _optim_from_files(learner.critic_opt, tensors, metas["critic"], "critic", model.device)
    return json.loads((path / "state.json").read_text())
