"""Sharded and asynchronous run checkpoints: every rank writes its own shard with torch.distributed.checkpoint.

Layout: RUN_DIR/checkpoints/update-000040/{model/ (HF-format weights, written by rank 0 alone from
the unsharded model; with LoRA adapter/ + base.json instead, adapter_ckpt.py), shards/ (DCP's
safetensors shards, one file per rank; keys master.{i}, critic_master.{i}, ref.<name>, critic.<name>,
optim.actor.{i}.{k}, optim.critic.{i}.{k}),
optim.json, state.json}. checkpoint.py saves this layout when the learner is FSDP-sharded (no rank
gathers the masters or moments: each writes the shard it holds; only the model export is gathered,
by the unshard the rollouts do anyway, and copied to rank 0's host) or when run.async_checkpoint is
on (the tensors are staged on the host when the save is called and written while training goes
on). Shards load at any world size and in one process (DCP reshards on load). Publishing is
checkpoint.py's: a .tmp- directory renamed once complete, then `latest`. DCP's collectives run
on Dist.ckpt_group, whose timeout is run.save_timeout_s, not the training collectives' one. A save
that fails part way on any rank (a full disk while one rank writes its shard, or while rank 0 writes
the model or publishes) is settled on every rank: rank 0 removes the unfinished directory, `latest`
keeps naming the previous checkpoint, and every rank raises the same CheckpointError.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from rlengine.model.loader import CheckpointError, hf_export, write_hf_export
from rlengine.model.lora import lora_spec
from rlengine.rl.trainer.adapter_ckpt import adapter_export, write_adapter_export
from rlengine.rl.trainer.ckpt_files import (begin_checkpoint, failure_text, publish, settle_save, trainable,
                                           unique_state)

SHARDS = "shards"


def learner_state(learner) -> tuple[dict[str, torch.Tensor], dict]:
    """The learner's tensors under their shard keys (DTensors stay sharded: nothing is gathered), and
    optim.json's content (each optimizer's param_groups and which state keys each parameter has)."""
    out: dict[str, torch.Tensor] = {}
    for prefix in ("master", "critic_master"):
        for i, m in enumerate(getattr(learner, f"{prefix}_params", None) or []):
            out[f"{prefix}.{i}"] = m.detach()
    for prefix, module in (("ref", learner.ref), ("critic", learner.critic)):
        if module is not None:
            out.update({f"{prefix}.{n}": t.detach() for n, t in unique_state(module).items()})
    metas = {}
    for name, opt in _optimizers(learner):
        sd = opt.state_dict()
        out.update({f"optim.{name}.{i}.{k}": v.detach() for i, st in sd["state"].items()
                    for k, v in st.items() if torch.is_tensor(v)})
        metas[name] = {"param_groups": sd["param_groups"],
                       "state_keys": {str(i): [k for k, v in st.items() if torch.is_tensor(v)]
                                      for i, st in sd["state"].items()}}
    return out, metas


def _optimizers(learner):
    return [(n, o) for n, o in (("actor", learner.opt), ("critic", learner.critic_opt)) if o is not None]


@contextlib.contextmanager
def _quiet_dcp():
    """DCP's notes on a single-process save or load (it assumes one on purpose here): not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")
        yield


def _dcp_kwargs(dist) -> dict:
    return {"process_group": dist.ckpt_group} if dist.enabled else {"no_dist": True}


class PendingSave:
    """A checkpoint being written. wait() returns its directory (rank 0; None elsewhere) once this
    rank's part is on disk, and re-raises what failed there; settle() (every rank) also waits for the
    other ranks' parts and, when any failed, removes the unfinished checkpoint and raises on every rank
    (ckpt_files.settle_save); done() does not block."""

    def __init__(self, future: Future | None, finish: Callable[[], Path] | None, *, error: BaseException | None = None,
                 dist=None, update: int = 0, ckpt_root: Path | None = None, name: str | None = None):
        self._result: list = [error] if error is not None else []
        self._where = (dist, update, ckpt_root, name)
        self._thread = threading.Thread(target=self._run, args=(future, finish), daemon=True,
                                        name="rlengine-checkpoint")
        if error is None:
            self._thread.start()

    def _run(self, future, finish) -> None:
        try:
            with _quiet_dcp():  # an async save's writing goes on in this thread
                if future is not None:
                    future.result()
                self._result.append(finish() if finish is not None else None)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            self._result.append(exc)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        """Block until this rank's part is written (or failed); raises nothing."""
        if self._thread.ident is not None:
            self._thread.join()

    def wait(self) -> Path | None:
        self.join()
        if isinstance(self._result[0], BaseException):
            raise self._result[0]
        return self._result[0]

    def settle(self) -> Path | None:
        """wait(), then agree with every rank on the outcome (a collective on the checkpoint group)."""
        try:
            path, error = self.wait(), None
        except BaseException as exc:  # noqa: BLE001 - every rank learns of it before anyone raises
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            path, error = None, exc
        dist, update, ckpt_root, name = self._where
        settle_save(dist, error, update=update, ckpt_root=ckpt_root, name=name)
        return path


def save_sharded(run_dir: Path, update: int, *, model, learner, state: dict, dist, asynchronous: bool = False,
                 keep: int = 0, on_stage: Callable[[str], None] | None = None) -> PendingSave:
    """Every rank calls it; returns the save in flight (its writing done unless `asynchronous`): call
    settle() on every rank, which raises CheckpointError on all of them when any part failed.

    Rank 0 names the checkpoint and makes its .tmp- directory; every rank writes its shards there;
    rank 0 then writes model/ and the JSON files and publishes. Asynchronous: the shard tensors and
    the model export are copied to the host here, and the writing goes on in the background. A part
    that fails (a full disk on one rank) is caught and handed to settle(), so no rank is left waiting.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    on_stage = on_stage or (lambda stage: None)
    ckpt_root, name, began = run_dir / "checkpoints", None, None
    if dist.is_main:
        try:
            ckpt_root, name, _ = begin_checkpoint(run_dir, update)
        except OSError as exc:
            began = exc
    # after rank 0 made the directory every rank writes into (or failed to: then no rank writes)
    name, failed = dist.broadcast_object((name, None if began is None else failure_text(began)))
    where = {"dist": dist, "update": update, "ckpt_root": ckpt_root, "name": name}
    if failed is not None:
        return PendingSave(None, None, error=began or CheckpointError(failed), **where)
    tmp = ckpt_root / f".tmp-{name}"
    lora = lora_spec(model) is not None  # LoRA: the adapter in PEFT's format + base.json, not the frozen base
    with dist.unsharded(model):  # the HF export: full weights (a device all-gather), on rank 0's host only
        export = (adapter_export(model) if lora else hf_export(model)) if dist.is_main else None
    tensors, metas = learner_state(learner)
    writer = HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True)

    def finish() -> Path:  # rank 0, once every rank's shards are written
        if lora:
            write_adapter_export(export, tmp)
        else:
            write_hf_export(*export, tmp / "model")
        on_stage("partial")
        (tmp / "optim.json").write_text(json.dumps(metas))
        (tmp / "state.json").write_text(json.dumps(state))
        return publish(ckpt_root, name, update, keep=keep, on_stage=on_stage)

    try:
        with _quiet_dcp():
            if asynchronous:
                future = dcp.async_save(tensors, storage_writer=writer, **_dcp_kwargs(dist))
            else:  # a rank whose writing fails fails it on every rank (DCP gathers the outcome)
                dcp.save(tensors, storage_writer=writer, **_dcp_kwargs(dist))
                future = None
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - settle() reports it on every rank
        return PendingSave(None, None, error=exc, **where)
    pending = PendingSave(future, finish if dist.is_main else None, **where)
    if not asynchronous:
        pending.join()
    return pending


@torch.no_grad()
def load_sharded(path: Path, *, model, learner, dist) -> None:
    """Restore the learner from path/shards in place, at this run's world size and sharding: masters,
    ref, critic, optimizers; then every parameter with a master holds its rounded master."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path / SHARDS))
    saved = reader.read_metadata().state_dict_metadata
    metas = json.loads((path / "optim.json").read_text())
    targets, _ = learner_state(learner)
    targets = {k: v for k, v in targets.items() if not k.startswith("optim.")}
    for name, opt in _optimizers(learner):
        if name not in metas:
            raise CheckpointError(f"{path}: no {name} optimizer state in optim.json")
        params = [p for group in opt.param_groups for p in group["params"]]
        for i, keys in metas[name]["state_keys"].items():
            for k in keys:
                key, p = f"optim.{name}.{i}.{k}", params[int(i)]
                if key not in saved:
                    raise CheckpointError(f"{path / SHARDS}: missing tensor {key!r}")
                size, dtype = tuple(saved[key].size), saved[key].properties.dtype
                targets[key] = torch.empty_like(p, dtype=dtype) if size == tuple(p.shape) else \
                    torch.empty(size, dtype=dtype, device="cpu")
    masters_saved = {prefix: any(k.startswith(prefix + ".") for k in saved) for prefix in ("master", "critic_master")}
    for key in list(targets):
        prefix = key.split(".", 1)[0]
        if prefix in masters_saved and not masters_saved[prefix]:
            del targets[key]  # saved without masters: the loaded weights are all there is
        elif key not in saved:
            raise CheckpointError(f"{path / SHARDS}: missing tensor {key!r}")
    with _quiet_dcp():
        dcp.load(targets, storage_reader=reader, **_dcp_kwargs(dist))
    for name, opt in _optimizers(learner):
        state = {int(i): {k: targets[f"optim.{name}.{i}.{k}"] for k in keys}
                 for i, keys in metas[name]["state_keys"].items()}
        opt.load_state_dict({"state": state, "param_groups": metas[name]["param_groups"]})
    for prefix, module in (("master", model), ("critic_master", learner.critic)):
        masters = getattr(learner, f"{prefix}_params", None)
        if masters is None:
            continue
        params = trainable(module)
        if not masters_saved[prefix]:
            for m, p in zip(masters, params):
                m.copy_(p)
        for m, p in zip(masters, params):
            p.copy_(m)
