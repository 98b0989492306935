"""Run checkpoints: HF-format weights plus fp32 masters, KL reference, optimizer, RNG, sampler and counters.

Two layouts, both loadable at any world size: the one below, written by rank 0 (one process, DDP),
and sharded.py's, where each rank writes its own shard (FSDP, and every run.async_checkpoint save).
Layout: RUN_DIR/checkpoints/update-000040/{model/ (config.json + model.safetensors),
master.safetensors, ref.safetensors, critic.safetensors, critic_master.safetensors,
optim.safetensors, optim.json, state.json} (master/ref/critic files only when the learner has
them; masters are fp32, key master.{i} for the i-th trainable parameter), and
RUN_DIR/checkpoints/latest, a text file naming the directory to resume from.
Crash safety: a save never deletes or overwrites the checkpoint `latest` names. It writes into
a fresh `.tmp-<name>` directory, fsyncs every file and directory, renames it to a name not yet
used (`update-000040`, or `update-000040.1`, ... when that update is saved again), fsyncs the
pointer and replaces `latest` atomically; only then are superseded directories of the same
update and leftover `.tmp-*` directories removed; a save that fails (a full disk) removes what it
wrote and raises CheckpointError, leaving `latest` as it was. state.json also carries the metrics
record of its update (written to metrics.jsonl only after the save), so a resume restores a line a
crash lost. Tensors go to safetensors, scalars to JSON: no pickle anywhere. A damaged or mismatched
checkpoint loads as a CheckpointError naming the file and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlengine.model.loader import CheckpointError, load_pretrained, save_pretrained
from rlengine.model.lora import lora_spec
from rlengine.rl.trainer.adapter_ckpt import (check_adapter_base, is_adapter_checkpoint, load_adapter_checkpoint,
                                              save_adapter_checkpoint)
from rlengine.rl.distributed import Dist, full_tensor, is_sharded
from rlengine.rl.trainer.ckpt_files import (begin_checkpoint, discard, failure_text, kept_note, publish, settle_save,
                                           trainable, unique_state)
from rlengine.rl.trainer.sharded import SHARDS, PendingSave, load_sharded, save_sharded

# The points of save_checkpoint at which `on_stage` is called, in order (crash tests kill there).
STAGES = (
    "partial",         # .tmp-<name>/ holds the model files only
    "written",         # .tmp-<name>/ is complete and fsynced, not yet renamed
    "before-pointer",  # <name>/ is in place and latest.tmp fsynced; `latest` still names the old checkpoint
    "after-pointer",   # `latest` names <name>/; superseded directories not yet removed
)


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `target`: this rank's shard when target is an FSDP DTensor (no communication:
    every rank reads the whole file), else the tensor itself."""
    if not hasattr(target, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                             src_data_rank=None)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v.detach()).cpu().contiguous() for k, v in tensors.items()}


def _optim_to_files(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors = {f"{prefix}.{i}.{k}": full_tensor(v.detach()).cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    return tensors, {"param_groups": sd["param_groups"], "state_keys": {str(i): list(st) for i, st in sd["state"].items()}}


def _optim_from_files(opt: torch.optim.Optimizer, tensors: dict, meta: dict, prefix: str, device) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]

    def placed(i: int, k: str) -> torch.Tensor:
        t = tensors[f"{prefix}.{i}.{k}"]
        return t if k == "step" else _like(t.to(device), params[i])
    state = {int(i): {k: placed(int(i), k) for k in keys} for i, keys in meta["state_keys"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _gather(learner) -> dict[str, dict]:
    """Every tensor file of a checkpoint but the model's, as CPU tensors: {file stem: tensors}.
    Under FSDP the masters and optimizer states are all-gathered here, on every rank in the same order."""
    files: dict[str, dict] = {}
    for file, masters in (("master", getattr(learner, "master_params", None)),
                          ("critic_master", getattr(learner, "critic_master_params", None))):
        if masters is not None:
            files[file] = _cpu({f"master.{i}": m for i, m in enumerate(masters)})
    if learner.ref is not None:
        files["ref"] = _cpu(unique_state(learner.ref))
    tensors, meta = _optim_to_files(learner.opt, "actor")
    files["_metas"] = {"actor": meta}
    if learner.critic is not None:
        files["critic"] = _cpu(learner.critic.state_dict())
        ct, cm = _optim_to_files(learner.critic_opt, "critic")
        tensors.update(ct)
        files["_metas"]["critic"] = cm
    files["optim"] = tensors
    return files


def _write_files(out: Path, files: dict[str, dict], *, model, state: dict, on_stage) -> None:
    if lora_spec(model) is not None:  # LoRA: adapter/ in PEFT's format + base.json, not the frozen base
        save_adapter_checkpoint(model, out)
    else:
        save_pretrained(model, out / "model")
    on_stage("partial")
    metas = files.pop("_metas")
    for stem, tensors in files.items():
        save_file(tensors, str(out / f"{stem}.safetensors"))
    (out / "optim.json").write_text(json.dumps(metas))
    (out / "state.json").write_text(json.dumps(state))


def save_checkpoint(run_dir: Path, update: int, *, model, learner, state: dict,
                    on_stage: Callable[[str], None] | None = None, write: bool = True, keep: int = 0) -> Path:
    """Write a checkpoint of `update` and point checkpoints/latest at it; returns its directory.

    learner: .opt, .critic/.critic_opt (or None), .ref (or None), and optionally .master_params
    and .critic_master_params (fp32, one per trainable parameter in parameters() order, or None).
    on_stage(stage) is called at each of STAGES (tests inject crashes there). Copies every tensor
    to the CPU (a host sync) and fsyncs every file and directory it writes. Several unsharded
    ranks: every rank calls it, only the one with write=True writes (FSDP-sharded learners are
    saved by sharded.py instead). keep > 0: afterwards only the newest `keep` checkpoints stay
    (the one `latest` names always among them).
    """
    on_stage = on_stage or (lambda stage: None)
    files = _gather(learner)
    if not write:
        return run_dir / "checkpoints"
    try:
        ckpt_root, name, tmp = begin_checkpoint(run_dir, update)
    except OSError as exc:
        raise CheckpointError(f"cannot save the checkpoint of update {update} in {run_dir / 'checkpoints'}: "
                              f"{failure_text(exc)}{kept_note(run_dir / 'checkpoints')}") from None
    try:
        _write_files(tmp, files, model=model, state=state, on_stage=on_stage)
        return publish(ckpt_root, name, update, keep=keep, on_stage=on_stage)
    except BaseException as exc:  # a failed (or interrupted) save leaves no partial directory behind
        discard(ckpt_root, name)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot save the checkpoint of update {update} in {ckpt_root}: "
                                  f"{exc.strerror or exc}{kept_note(ckpt_root)}") from None
        raise


def has_checkpoint(run_dir: Path) -> bool:
    return (Path(run_dir) / "checkpoints" / "latest").is_file()


def latest_checkpoint(run_dir: Path) -> Path:
    """The directory checkpoints/latest names; FileNotFoundError when there is none, CheckpointError when
    the pointer names no checkpoint."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest (nothing to resume from)")
    name = pointer.read_text(errors="replace").strip()
    path = run_dir / "checkpoints" / name
    if not name or "/" in name or not path.is_dir():
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a checkpoint directory in {pointer.parent}")
    return path


def read_state(path: Path) -> dict:
    """A checkpoint directory's state.json (update, N, RNGs, ...); CheckpointError when it is unreadable."""
    file = path / "state.json"
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (the checkpoint is incomplete)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc}); the file is damaged") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: not a checkpoint state (a JSON object)")
    return state


@torch.no_grad()
def _load_masters(file: Path, module: torch.nn.Module, masters: list[torch.Tensor]) -> None:
    """Saved fp32 masters into `masters` in place, then each rounded master into its parameter in place."""
    params = trainable(module)
    if len(masters) != len(params):
        raise CheckpointError(f"{len(masters)} master tensors for {len(params)} trainable parameters")
    if file.is_file():
        saved = load_file(str(file))
        if len(saved) != len(masters):
            raise CheckpointError(f"{file}: {len(saved)} masters, the learner has {len(masters)}")
        for i, m in enumerate(masters):
            m.copy_(_like(saved[f"master.{i}"], m))
    else:  # a checkpoint from before masters were saved: the rounded weights are all there is
        for m, p in zip(masters, params):
            m.copy_(p)
    for m, p in zip(masters, params):
        p.copy_(m)


@torch.no_grad()
def _load_ref(file: Path, ref: torch.nn.Module) -> None:
    saved = load_file(str(file))
    for name, t in unique_state(ref).items():
        if name not in saved:
            raise CheckpointError(f"{file}: missing tensor {name!r}")
        t.copy_(_like(saved[name], t))


def load_checkpoint(path: Path, *, model, learner, dist=None) -> dict:
    """load_checkpoint_files with every damaged or mismatched file a CheckpointError naming it."""
    state = read_state(path)
    _check_readable(path)
    try:
        if is_adapter_checkpoint(path):
            check_adapter_base(path, model)
        else:
            _check_model_shapes(path / "model", model)
        load_checkpoint_files(path, model=model, learner=learner, dist=dist)
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, IndexError, RuntimeError) as exc:
        what = getattr(exc, "filename", None) or path
        raise CheckpointError(f"{what}: cannot load this checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); the file is damaged or from "
                              "another job") from None
    return state


def _check_readable(path: Path) -> None:
    """Every safetensors and JSON file of the checkpoint parses (headers and sizes): a truncated or
    damaged one is a CheckpointError naming it, before anything is loaded."""
    from safetensors import safe_open

    for file in sorted(path.rglob("*")):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt") as f:
                    f.keys()
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: damaged ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                                  "the checkpoint cannot be loaded") from None


def _check_model_shapes(model_dir: Path, model) -> None:
    """The checkpoint's model config describes the model the job built (same layers, sizes, vocabulary)."""
    file = model_dir / "config.json"
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
    want = model.config.to_hf_dict() if hasattr(model.config, "to_hf_dict") else {}
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "num_experts", "moe_intermediate_size")
    diff = [f"{k} {saved.get(k)} != {want.get(k)}" for k in keys if k in want and saved.get(k) != want.get(k)]
    if diff:
        raise CheckpointError(f"{file}: the checkpoint's model differs from the job's model.name "
                              f"({', '.join(diff)}; checkpoint vs job): was the run's config.json edited?")


def load_checkpoint_files(path: Path, *, model, learner, dist=None) -> dict:
    """Restore in place (the engine keeps sharing the weights): model, masters, ref, optimizers, critic.

    Returns state.json. With master_params the model ends up holding the rounded saved masters;
    a checkpoint without ref.safetensors (older layout) leaves learner.ref as it is. Either layout
    (one file per kind, or sharded.py's shards) loads into any world size and sharding; dist: this
    rank (the shards' loading is collective), default one process.
    """
    if is_adapter_checkpoint(path):
        load_adapter_checkpoint(path, model)
    else:
        saved = load_pretrained(path / "model", dtype=model.dtype, device="cpu")
        with torch.no_grad():
            for p, q in zip(model.parameters(), saved.parameters()):
                p.copy_(_like(q, p))
    if (path / SHARDS).is_dir():
        load_sharded(path, model=model, learner=learner, dist=dist or Dist())
        return json.loads((path / "state.json").read_text())
    masters = getattr(learner, "master_params", None)
    if masters is not None:
        _load_masters(path / "master.safetensors", model, masters)
    if learner.ref is not None and (path / "ref.safetensors").is_file():
        _load_ref(path / "ref.safetensors", learner.ref)
    tensors = load_file(str(path / "optim.safetensors"))
    metas = json.loads((path / "optim.json").read_text())
    _optim_from_files(learner.opt, tensors, metas["actor"], "actor", model.device)
    if learner.critic is not None:
        critic_saved = load_file(str(path / "critic.safetensors"))
        with torch.no_grad():
            for name, t in learner.critic.state_dict().items():
                t.copy_(_like(critic_saved[name], t))
        critic_masters = getattr(learner, "critic_master_params", None)
        if critic_masters is not None:
            _load_masters(path / "critic_master.safetensors", learner.critic, critic_masters)
        _optim_from_files(learner.critic_opt, tensors, metas["critic"], "critic", model.device)
    return json.loads((path / "state.json").read_text())


def save_run(run_dir: Path, *, update: int, n: int, model, learner, llm, collector, sampler, dist,
             keep: int = 0, asynchronous: bool = False, record: dict | None = None) -> PendingSave | Path:
    """Checkpoint a run at an update boundary: the weights, the learner's state and everything the
    loop needs to continue as if never stopped (counters, prompt sampler, torch and engine RNGs).
    Async in-flight rollouts are drained, not saved: they are regenerated after a resume.

    An FSDP-sharded learner, or `asynchronous`, saves shards (sharded.py); `asynchronous` returns the
    PendingSave
    while it is still being written (settle() on every rank); otherwise every rank returns once the
    checkpoint is published (its directory on rank 0), or raises CheckpointError on every rank when any
    rank's part failed (the unfinished directory removed, `latest` unchanged). record: this update's
    metrics record when it is not yet in metrics.jsonl (kept in state.json: a resume restores it).
    """
    collector.drain()
    state = {"update": update, "N": n, "weight_version": llm.weight_version,
             "sampler": sampler.state_dict(), "torch_rng": torch.get_rng_state().tolist(),
             "engine_rng": llm.runner.sampler.generator.get_state().tolist(),
             "ready": len(collector.ready), "next_request": collector.next_request, "world_size": dist.world}
    if record is not None:
        state["record"] = record
    collector.ready.clear()
    if asynchronous or is_sharded(model):
        pending = save_sharded(run_dir, update, model=model, learner=learner, state=state, dist=dist,
                               asynchronous=asynchronous, keep=keep)
        return pending if asynchronous else pending.settle()
    path, error = None, None
    try:
        path = save_checkpoint(run_dir, update, model=model, learner=learner, state=state, write=dist.is_main,
                               keep=keep)
    except CheckpointError as exc:  # rank 0's write failed (and was cleaned up): every rank raises it
        error = exc
    # no rank resumes or exits before the checkpoint is complete, however long it took, nor goes on after a
    # failed one (a collective on the checkpoint group)
    settle_save(dist, error, update=update, ckpt_root=run_dir / "checkpoints", name=None)
    return path


def resume_run(resume_dir: Path, *, model, learner, llm, collector, sampler, dist=None) -> tuple[int, int]:
    """Load RESUME_DIR's latest checkpoint into a freshly built run; returns (update, N)."""
    path = latest_checkpoint(resume_dir)
    state = load_checkpoint(path, model=model, learner=learner, dist=dist)
    try:
        collector.next_request = state.get("next_request", 0)
        llm.weight_version = state["weight_version"]
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        llm.runner.sampler.generator.set_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path / 'state.json'}: damaged ({type(exc).__name__}: {exc})") from None
    return state["update"], state["N"]
