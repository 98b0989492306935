"""The files of a checkpoint directory, for both layouts (checkpoint.py, sharded.py): naming a new
one, publishing it crash-safely (the order is checkpoint.py's docstring), removing a save that failed,
the ranks' agreement on whether a save succeeded, and the tensor sets both save.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from rlengine.model.loader import CheckpointError


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
    if ckpt_root.exists() and not ckpt_root.is_dir():  # say so, not mkdir's "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ckpt_root))
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


def discard(ckpt_root: Path, name: str) -> bool:
    """Remove what an unfinished save of `name` wrote (.tmp-<name>, <name>, latest.tmp) unless `latest`
    already names it; returns whether it had been published (then nothing is removed)."""
    pointer = ckpt_root / "latest"
    try:
        published = pointer.is_file() and pointer.read_text().strip() == name
    except OSError:
        published = False
    if not published:
        shutil.rmtree(ckpt_root / f".tmp-{name}", ignore_errors=True)
        shutil.rmtree(ckpt_root / name, ignore_errors=True)
        try:
            (ckpt_root / "latest.tmp").unlink(missing_ok=True)
        except OSError:
            pass
    return published


def kept_note(ckpt_root: Path) -> str:
    """How a failed save leaves the run: `latest` as it was, or no checkpoint yet."""
    try:
        kept = (ckpt_root / "latest").is_file()
    except OSError:
        kept = False
    return "; `latest` still names the previous one" if kept else "; the run has no checkpoint yet"


def failure_text(exc: BaseException) -> str:
    """What went wrong in a save, in a few words: an OSError's reason and file, the first failed rank's
    error of a torch.distributed.checkpoint CheckpointException (a dict of every rank's), or the message."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"{failure_text(inner)} (rank {rank})"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def settle_save(dist, error: BaseException | None, *, update: int, ckpt_root: Path, name: str | None) -> None:
    """Every rank, after its part of a save: wait for the others and learn whether any part failed (one
    all-gather on the checkpoint group, whose timeout is run.save_timeout_s). On a failure rank 0 removes
    the unfinished checkpoint (`latest` keeps naming the previous one) and every rank raises: its own
    error when that is not a file or checkpoint fault (a bug shows its traceback), else CheckpointError."""
    text = None if error is None else failure_text(error)
    texts = [text]
    if dist is not None and dist.enabled:
        import torch.distributed

        texts = [None] * dist.world
        torch.distributed.all_gather_object(texts, text, group=dist.ckpt_group)
    failed = [(rank, t) for rank, t in enumerate(texts) if t is not None]
    if not failed:
        return
    main = dist is None or dist.is_main
    published = main and name is not None and discard(ckpt_root, name)
    user_fault = isinstance(error, (OSError, CheckpointError)) or type(error).__name__ == "CheckpointException"
    if error is not None and not user_fault:
        raise error
    rank, text = failed[0]
    if text.startswith("cannot save the checkpoint"):  # already worded by the rank that wrote (save_checkpoint)
        raise CheckpointError(text) from None
    who = f" (rank {rank})" if len(texts) > 1 and "(rank " not in text else ""
    after = "; it was published, but removing the older checkpoints failed" if published else kept_note(ckpt_root)
    raise CheckpointError(f"cannot save the checkpoint of update {update} in {ckpt_root}: {text}{who}{after}") \
        from None


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters masters align with (all of them unless some are frozen), in parameters() order."""
    return [p for p in module.parameters() if p.requires_grad]
