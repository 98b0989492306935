"""Sharded and asynchronous run checkpoints: every rank writes its own shard with torch.distributed.checkpoint.

Layout: RUN_DIR/checkpoints/update-000040/{model/ (HF-format weights, written by rank 0 alone from
the unsharded model), shards/ (DCP's safetensors shards, one file per rank; keys master.{i},
critic_master.{i}, ref.<name>, critic.<name>, optim.actor.{i}.{k}, optim.critic.{i}.{k}),
optim.json, state.json}. checkpoint.py saves this layout when the learner is FSDP-sharded (no rank
gathers the masters or moments: each writes the shard it holds; only the model export is gathered,
by the unshard the rollouts do anyway, and copied to rank 0's host) or when run.async_checkpoint is
on (the tensors are staged on the host when the save is called and written while training goes
on). Shards load at any world size and in one process (DCP reshards on load). Publishing is
checkpoint.py's: a .tmp- directory renamed once complete, then `latest`. DCP's collectives run
on Dist.ckpt_group, whose timeout is run.save_timeout_s, not the training collectives' one.
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
from rlengine.rl.trainer.ckpt_files import begin_checkpoint, publish, trainable, unique_state

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
    rank's part is on disk, and re-raises what failed; done() does not block."""

    def __init__(self, future: Future | None, finish: Callable[[], Path] | None):
        self._result: list = []
        self._thread = threading.Thread(target=self._run, args=(future, finish), daemon=True,
                                        name="rlengine-checkpoint")
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

    def wait(self) -> Path | None:
        self._thread.join()
        if isinstance(self._result[0], BaseException):
            raise self._result[0]
        return self._result[0]


def save_sharded(run_dir: Path, update: int, *, model, learner, state: dict, dist, asynchronous: bool = False,
                 keep: int = 0, on_stage: Callable[[str], None] | None = None) -> PendingSave:
    """Every rank calls it; returns the save in flight (already finished unless `asynchronous`).

    Rank 0 names the checkpoint and makes its .tmp- directory; every rank writes its shards there;
    rank 0 then writes model/ and the JSON files and publishes. Asynchronous: the shard tensors and
    the model export are copied to the host here, and the writing goes on in the background.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    on_stage = on_stage or (lambda stage: None)
    ckpt_root, name = run_dir / "checkpoints", None
    if dist.is_main:
        ckpt_root, name, _ = begin_checkpoint(run_dir, update)
    name = dist.broadcast_object(name)  # after rank 0 made the directory every rank writes into
    tmp = ckpt_root / f".tmp-{name}"
    with dist.unsharded(model):  # the HF export: full weights (a device all-gather), on rank 0's host only
        export = hf_export(model) if dist.is_main else None
    tensors, metas = learner_state(learner)
    writer = HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True)

    def finish() -> Path:  # rank 0, once every rank's shards are written
        write_hf_export(*export, tmp / "model")
        on_stage("partial")
        (tmp / "optim.json").write_text(json.dumps(metas))
        (tmp / "state.json").write_text(json.dumps(state))
        return publish(ckpt_root, name, update, keep=keep, on_stage=on_stage)

    with _quiet_dcp():
        if asynchronous:
            future = dcp.async_save(tensors, storage_writer=writer, **_dcp_kwargs(dist))
        else:
            dcp.save(tensors, storage_writer=writer, **_dcp_kwargs(dist))
            future = None
    pending = PendingSave(future, finish if dist.is_main else None)
    if not asynchronous:
        pending.wait()
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
