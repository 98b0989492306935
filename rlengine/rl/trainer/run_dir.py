"""Run directories: the saved config of a run and what a resume may change in it.

A run directory holds config.json, metrics.jsonl and checkpoints/ (checkpoint.py); `rlengine train
--resume DIR` reads DIR's config back through resume_config, with only the overrides that keep
the run's meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlengine.config import ConfigError
from rlengine.rl.config import TrainConfig, load_config, split_overrides
from rlengine.rl.trainer.checkpoint import latest_checkpoint


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# Overrides a resumed run accepts: they change how long it runs, how it is evaluated, logged and
# saved, never what an update computes. Any other override on --resume is an error.
RESUME_OVERRIDABLE = ("train.updates", "eval.*", "run.checkpoint_every", "run.progress", "run.out_dir",
                      "run.samples_every", "run.tensorboard")


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
    return load_config(None, overrides, base=base)


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
