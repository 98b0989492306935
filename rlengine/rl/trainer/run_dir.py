"""Run directories: the saved config of a run and what a resume may change in it.

A run directory holds config.json (what the user wrote), plan.json (what the plan stage resolved
from it on this machine), metrics.jsonl and checkpoints/ (checkpoint.py); `rlengine train
--resume DIR` reads DIR's config back through resume_config, with only the overrides that keep
the run's meaning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlengine.model.config import ConfigError
from rlengine.rl.config import TrainConfig, load_job_config, split_overrides
from rlengine.rl.trainer.checkpoint import latest_checkpoint


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
    its metrics to the directory it was given, wherever it was first started.
    """
    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.json there (not a run directory)")
    overrides = list(overrides or [])
    for key, _ in split_overrides(overrides):
        section = key.split(".", 1)[0]
        _check(key in RESUME_OVERRIDABLE or f"{section}.*" in RESUME_OVERRIDABLE,
               f"--{key} cannot change on --resume (it would change what the run computes); "
               f"allowed: {', '.join(RESUME_OVERRIDABLE)}")
    try:
        latest_checkpoint(run_dir)
        base = json.loads(saved.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--resume {run_dir}: {saved} is not valid JSON ({exc})") from None
    _check(isinstance(base, dict), f"--resume {run_dir}: {saved} is not a config object")
    _check(isinstance(base.setdefault("run", {}), dict), f"--resume {run_dir}: {saved} has no [run] table")
    base["run"]["out_dir"] = str(run_dir)
    return load_job_config(None, overrides, base=base)


def keep_metrics_through(resume_dir: Path, run_dir: Path, update: int, cfg: TrainConfig, outputs, dist) -> list[dict]:
    """A resumed run's history: RESUME_DIR's metrics lines of updates <= `update` (the checkpoint's),
    rewritten by rank 0 into RUN_DIR with the run's config and its outputs trimmed alike."""
    metrics = resume_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    kept = [ln for ln in lines if ln and json.loads(ln)["update"] <= update]
    dist.barrier()  # every rank has read the old metrics before rank 0 rewrites them
    if dist.is_main:
        (run_dir / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        outputs.reset(keep_through=update)
    return [json.loads(ln) for ln in kept]


RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "telemetry.json", "plan.json")


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


def check_new_run(path: Path, overwrite: bool) -> None:
    """A new (not resumed) run into `path`: refused when a run is there, unless run.overwrite."""
    if holds_run(path) and not overwrite:
        raise ConfigError(f"run.out_dir {str(path)!r} already holds a run (config.json / metrics.jsonl / "
                          f"checkpoints): resume it with `rlengine train --resume {path}`, choose another "
                          "--run.out_dir, or pass --run.overwrite true to replace it")


def clear_run(path: Path) -> None:
    """Remove a previous run's own files from `path` (run.overwrite): its config, metrics, samples,
    telemetry, TensorBoard events and checkpoints. Anything else in the directory is left alone."""
    path = Path(path)
    for name in RUN_FILES:
        (path / name).unlink(missing_ok=True)
    for events in path.glob("events.out.tfevents.*"):
        events.unlink()
    if (path / "checkpoints").is_dir():
        shutil.rmtree(path / "checkpoints")


def start_new_run(path: Path, cfg: TrainConfig, outputs) -> None:
    """Rank 0 of a new run: the previous run's files gone (run.overwrite), the config written, the
    outputs started empty."""
    clear_run(path)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    outputs.reset()


def write_plan(path: Path, plan, *, announce: bool) -> None:
    """Rank 0: RUN_DIR/plan.json (JobPlan.to_dict: rewritten on every start, resumes included, since the
    plan depends on the machine), and with `announce` one line of it on the console."""
    (path / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2, default=str))
    if announce:
        r, e, lr = plan.rollout, plan.engine, plan.learner
        micro = lr.micro_batch or "the rank's whole share"
        print(f"plan: B_train {r.b_train} (P {r.prompts_per_step} x G {r.group_size}), B_gen {r.b_gen}, "
              f"{lr.algo} ({lr.algorithm.estimator_name} + {lr.algorithm.loss_name}), micro-batch {micro}, "
              f"KV blocks {e.num_kv_blocks}, backend {e.attention_backend} ({path / 'plan.json'})", flush=True)
