"""The files of a checkpoint directory, for both layouts (checkpoint.py, sharded.py): naming a new
one, publishing it crash-safely (the order is checkpoint.py's docstring), and the tensor sets both save.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with each tensor once: safetensors refuses shared storage (tied lm_head/embed_tokens)."""
    seen: set[int] = set()
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so the rename publishes durable contents."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for f in filenames:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _fresh_name(ckpt_root: Path, update: int) -> str:
    """update-000040, or update-000040.N for the first N whose directory (or .tmp- twin) is unused."""
    base = f"update-{update:06d}"
    taken = {p.name for p in ckpt_root.iterdir()}
    name, n = base, 0
    while name in taken or f".tmp-{name}" in taken:
        n += 1
        name = f"{base}.{n}"
    return name


def begin_checkpoint(run_dir: Path, update: int) -> tuple[Path, str, Path]:
    """(checkpoints/, a fresh name for `update`, its new empty .tmp-<name> directory)."""
    ckpt_root = run_dir / "checkpoints"
    if not ckpt_root.is_dir():
        ckpt_root.mkdir(parents=True)
        _fsync(run_dir)
    name = _fresh_name(ckpt_root, update)
    tmp = ckpt_root / f".tmp-{name}"
    tmp.mkdir()
    return ckpt_root, name, tmp


def publish(ckpt_root: Path, name: str, update: int, *, keep: int = 0,
            on_stage: Callable[[str], None] | None = None) -> Path:
    """Make the complete .tmp-<name> the checkpoint `latest` names (the crash-safe order in the module
    docstring), then remove superseded and leftover directories and all but the newest `keep`."""
    on_stage = on_stage or (lambda stage: None)
    tmp, final = ckpt_root / f".tmp-{name}", ckpt_root / name
    _fsync_tree(tmp)
    on_stage("written")
    tmp.rename(final)
    _fsync(ckpt_root)
    pointer = ckpt_root / "latest.tmp"
    pointer.write_text(name)
    _fsync(pointer)
    on_stage("before-pointer")
    os.replace(pointer, ckpt_root / "latest")
    _fsync(ckpt_root)
    on_stage("after-pointer")
    base = f"update-{update:06d}"
    for p in ckpt_root.iterdir():
        superseded = p.name == base or p.name.startswith(base + ".")
        if p.is_dir() and p.name != name and (superseded or p.name.startswith(".tmp-")):
            shutil.rmtree(p)
    if keep:
        saved = sorted((p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("update-")),
                       key=lambda p: p.stat().st_mtime_ns)
        for p in saved[:-keep]:
            if p.name != name:
                shutil.rmtree(p)
    return final


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters masters align with (all of them unless some are frozen), in parameters() order."""
    return [p for p in module.parameters() if p.requires_grad]
