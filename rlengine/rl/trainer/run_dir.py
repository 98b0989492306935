"""Run directories: the saved config of a run and what a resume may change in it.

A run directory holds config.json (what the user wrote), plan.json (what the plan stage resolved
from it on this machine), metrics.jsonl and checkpoints/ (checkpoint.py); `rlengine train
--resume DIR` reads DIR's config back through resume_config, with only the overrides that keep
the run's meaning. Nothing here writes into a directory that holds another run: a new run needs
an empty one (or run.overwrite, which removes the old run's own files only), a resume continues
in place or forks into a new or empty directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlengine.model.config import ConfigError
from rlengine.model.loader import CheckpointError
from rlengine.rl.config import TrainConfig, load_job_config, split_overrides
from rlengine.rl.trainer.checkpoint import has_checkpoint, latest_checkpoint, read_state
from rlengine.rl.trainer.ckpt_files import begin_checkpoint, publish
from rlengine.rl.trainer.run_outputs import cannot_write, read_records, replace_lines, skipped_note


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# Overrides a resumed run accepts: they change how long it runs, how it is evaluated, logged and
# saved, never what an update computes. Any other override on --resume is an error.
RESUME_OVERRIDABLE = ("train.updates", "eval.*", "run.checkpoint_every", "run.progress", "run.out_dir",
                      "run.samples_every", "run.tensorboard", "run.wandb", "run.wandb_project", "run.keep_checkpoints",
                      "run.dist_timeout_s", "run.save_timeout_s", "run.async_checkpoint")


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The saved config of RUN_DIR (config.json) with the overrides a resume allows (RESUME_OVERRIDABLE).

    run.out_dir defaults to RUN_DIR itself, so a resumed run reads its checkpoint from and writes
    its metrics to the directory it was given, wherever it was first started; another --run.out_dir
    must be new or empty (the run is forked there, history and checkpoint copied). train.updates may
    extend the run, never end it before the update it has reached.
    """
    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: is a file, not a run directory")
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.json there (not a run directory)")
    overrides = list(overrides or [])
    pairs = split_overrides(overrides)
    for key, _ in pairs:
        section = key.split(".", 1)[0]
        _check(key in RESUME_OVERRIDABLE or f"{section}.*" in RESUME_OVERRIDABLE,
               f"--{key} cannot change on --resume (it would change what the run computes); "
               f"allowed: {', '.join(RESUME_OVERRIDABLE)}")
    try:
        base = json.loads(saved.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {run_dir}: {saved} is not valid JSON ({exc})") from None
    _check(isinstance(base, dict), f"--resume {run_dir}: {saved} is not a config object")
    _check(isinstance(base.setdefault("run", {}), dict), f"--resume {run_dir}: {saved} has no [run] table")
    base["run"]["out_dir"] = str(run_dir)
    cfg = load_job_config(None, overrides, base=base)
    reached = resume_point(run_dir)
    if reached is not None and any(key == "train.updates" for key, _ in pairs):
        _check(cfg.train.updates >= reached,
               f"--train.updates {cfg.train.updates} is below update {reached}, which the run has reached "
               f"(its latest checkpoint); give >= {reached} (a larger value extends the run)")
    check_resume_target(run_dir, Path(cfg.run_dir))
    return cfg


def resume_point(run_dir: Path) -> int | None:
    """The update of RUN_DIR's latest checkpoint; None for a run stopped before its first checkpoint
    (during set-up or the warm start), which a resume starts over. A run whose metrics went past
    update 0 without a checkpoint has nothing to resume from: ConfigError."""
    run_dir = Path(run_dir)
    if has_checkpoint(run_dir):
        path = latest_checkpoint(run_dir)
        update = read_state(path).get("update")
        if type(update) is not int:
            raise CheckpointError(f"{path / 'state.json'}: no integer 'update' (the file is damaged)")
        return update
    records, _ = read_records(run_dir / "metrics.jsonl")
    reached = max((r["update"] for r in records), default=0)
    _check(reached == 0, f"--resume {run_dir}: no checkpoints/latest (nothing to resume from): its metrics reach "
                         f"update {reached} but no checkpoint was saved (run.checkpoint_every = 0 saves only at "
                         "the end)")
    return None


def _empty_or_absent(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def check_resume_target(resume_dir: Path, run_dir: Path) -> None:
    """A resume writes into RESUME_DIR itself or forks it into a new or empty RUN_DIR: never into a
    directory that holds anything else (another run's files would be replaced)."""
    if Path(resume_dir).resolve() == Path(run_dir).resolve():
        return
    _check(_empty_or_absent(Path(run_dir)),
           f"--resume {resume_dir} --run.out_dir {run_dir}: {run_dir} is not empty"
           f"{' (it holds a run)' if holds_run(Path(run_dir)) else ''}; a resume continues the run in place "
           "(leave out --run.out_dir) or forks it into a new or empty directory")


def prepare_run_dir(run_dir: Path, resume_dir: Path | None, overwrite: bool) -> Path | None:
    """Where a run continues from: RESUME_DIR when it holds a checkpoint; None for a new run, or for a
    resumed one stopped before its first checkpoint, which starts over from its config. Refuses a new
    run into a directory holding one (unless run.overwrite) and a resume into another run's directory."""
    if resume_dir is None:
        check_new_run(run_dir, overwrite)
        return None
    check_resume_target(resume_dir, run_dir)
    return resume_dir if resume_point(resume_dir) is not None else None


def keep_metrics_through(resume_dir: Path, run_dir: Path, update: int, cfg: TrainConfig, outputs, dist) -> list[dict]:
    """A resumed run's history: RESUME_DIR's metrics records of updates <= `update` (the checkpoint's;
    a line a crash cut short is skipped and reported, the checkpoint's own record restored when its
    line was lost), rewritten by rank 0 into RUN_DIR with the run's config and its outputs trimmed alike.
    A fork (RUN_DIR not RESUME_DIR) also gets a copy of the checkpoint, so it resumes on its own, and the
    step trace's lines through `update`."""
    metrics = resume_dir / "metrics.jsonl"
    records, skipped = read_records(metrics)
    kept = [r for r in records if r["update"] <= update]
    carried = read_state(latest_checkpoint(resume_dir)).get("record")
    if isinstance(carried, dict) and carried.get("update") == update and all(r["update"] != update for r in kept):
        kept.append(carried)
    fork = resume_dir.resolve() != run_dir.resolve()
    dist.barrier()  # every rank has read the old metrics before rank 0 rewrites them
    if dist.is_main:
        if skipped:
            print(skipped_note(metrics, skipped), flush=True)
        if fork:
            copy_checkpoint(latest_checkpoint(resume_dir), run_dir, update)
            trace, _ = read_records(resume_dir / "trace.jsonl")  # the device clock's history too
            replace_lines(run_dir / "trace.jsonl", [json.dumps(r) for r in trace if r["update"] <= update])
        replace_lines(run_dir / "metrics.jsonl", [json.dumps(r) for r in kept])
        replace_lines(run_dir / "config.json", [json.dumps(cfg.to_dict(), indent=2)])
        outputs.reset(keep_through=update, source=resume_dir / "samples.jsonl")
    return kept


def copy_checkpoint(src: Path, run_dir: Path, update: int) -> Path:
    """SRC (a checkpoint directory) published as RUN_DIR's latest checkpoint of `update`."""
    try:
        ckpt_root, name, tmp = begin_checkpoint(run_dir, update)
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        return publish(ckpt_root, name, update)
    except OSError as exc:
        raise cannot_write(run_dir / "checkpoints", exc) from None


RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "telemetry.json", "plan.json", "trace.jsonl")


def holds_run(path: Path) -> bool:
    """Whether `path` already holds a run (its config, metrics or checkpoints)."""
    path = Path(path)
    return any((path / f).exists() for f in RUN_FILES[:2]) or (path / "checkpoints").is_dir()


def fresh_run_dir(base: str | Path) -> Path:
    """`base` when it holds no run, else the first free `base-1`, `base-2`, ... (never an existing run)."""
    base = Path(base)
    n, path = 0, base
    while holds_run(path):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_out_dir(path: str | Path) -> None:
    """run.out_dir can hold a run: not a file, not under one, its checkpoints/ not a file, and writable
    (checked by creating it and writing a probe file there, which is removed)."""
    text, path = str(path), Path(path)
    _check(bool(text.strip()), "run.out_dir is empty; give a directory for the run (e.g. runs/my-run)")
    for part in (path, *path.parents):
        if part.exists():
            _check(part.is_dir(), f"run.out_dir {text!r}: {part} is a file, not a directory")
            break
    ckpts = path / "checkpoints"
    _check(not ckpts.exists() or ckpts.is_dir(), f"run.out_dir {text!r}: {ckpts} is a file, not a directory (the "
                                                  "run keeps its checkpoints there)")
    probe = path / f".write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"run.out_dir {text!r}: cannot write there ({exc.strerror or exc})") from None


def check_new_run(path: Path, overwrite: bool) -> None:
    """A new (not resumed) run into `path`: refused when a run is there, unless run.overwrite."""
    if holds_run(path) and not overwrite:
        raise ConfigError(f"run.out_dir {str(path)!r} already holds a run (config.json / metrics.jsonl / "
                          f"checkpoints): resume it with `rlengine train --resume {path}`, choose another "
                          "--run.out_dir, or pass --run.overwrite true to replace it")


def _own_checkpoint_entry(name: str) -> bool:
    """A name in checkpoints/ that a run writes: update-NNNNNN[.k], their .tmp- twins, latest, latest.tmp."""
    base = name.removeprefix(".tmp-")
    return name in ("latest", "latest.tmp") or (base.startswith("update-") and base[7:].split(".")[0].isdigit())


def clear_run(path: Path) -> None:
    """Remove a previous run's own files from `path` (run.overwrite): its config, plan, metrics, samples,
    telemetry, step trace, TensorBoard events and checkpoints (by their names: update-*, latest). Anything else,
    in the directory or in checkpoints/, is left alone; checkpoints/ goes only when that leaves it empty."""
    path = Path(path)
    try:
        for name in RUN_FILES:
            (path / name).unlink(missing_ok=True)
        for events in path.glob("events.out.tfevents.*"):
            events.unlink()
        ckpt_root = path / "checkpoints"
        if ckpt_root.is_dir():
            for entry in ckpt_root.iterdir():
                if _own_checkpoint_entry(entry.name):
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            if not any(ckpt_root.iterdir()):
                ckpt_root.rmdir()
    except OSError as exc:
        raise cannot_write(path, exc) from None


def start_new_run(path: Path, cfg: TrainConfig, outputs) -> None:
    """Rank 0 of a new run: the previous run's files gone (run.overwrite), the config written, the
    outputs started empty."""
    clear_run(path)
    replace_lines(path / "config.json", [json.dumps(cfg.to_dict(), indent=2)])
    outputs.reset()


def write_plan(path: Path, plan, *, announce: bool) -> None:
    """Rank 0: RUN_DIR/plan.json (JobPlan.to_dict: rewritten on every start, resumes included, since the
    plan depends on the machine), and with `announce` one line of it on the console."""
    replace_lines(path / "plan.json", [json.dumps(plan.to_dict(), indent=2, default=str)])
    if announce:
        r, e, lr = plan.rollout, plan.engine, plan.learner
        micro = lr.micro_batch or "the rank's whole share"
        print(f"plan: B_train {r.b_train} (P {r.prompts_per_step} x G {r.group_size}), B_gen {r.b_gen}, "
              f"{lr.algo} ({lr.algorithm.estimator_name} + {lr.algorithm.loss_name}), micro-batch {micro}, "
              f"KV blocks {e.num_kv_blocks}, backend {e.attention_backend} ({path / 'plan.json'})", flush=True)
