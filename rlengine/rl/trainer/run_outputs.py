"""What a run writes besides checkpoints: metrics.jsonl, samples.jsonl, TensorBoard event files, wandb.

The trainer hands every update-boundary record to RunOutputs.log() (one JSON line in
RUN_DIR/metrics.jsonl; with run.tensorboard = true also one scalar per numeric field, at
step = update, in TensorBoard event files in RUN_DIR itself, next to metrics.jsonl; with
run.wandb = true the same scalars under the same names to a wandb run in RUN_DIR/wandb) and, every
run.samples_every updates, the update's responses to samples() (one JSON line per response in
RUN_DIR/samples.jsonl: update, N, prompt and completion text, reward, advantage, token count,
mean and min token log-prob, finish reason). Only rank 0 writes. torch.utils.tensorboard is
imported only when asked for, and so is wandb (both packages are optional; the config checks them).
Crash safety: every line is written whole and flushed and fsynced before the next checkpoint is
taken, and read_records skips a line a crash cut short (or any line that is not a record), so a
killed run always resumes; a write that fails (a full disk, a read-only directory) is a ConfigError
naming the file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rlengine.model.config import ConfigError
from rlengine.rl.rollout.trajectories import trajectory_row


def cannot_write(path: Path, exc: OSError) -> ConfigError:
    """The one-line error for a run file that could not be written (full disk, read-only, not a directory)."""
    return ConfigError(f"cannot write {path}: {exc.strerror or exc}")


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines (each ending in a newline), flushed and fsynced: durable before anything after it."""
    try:
        with open(path, "a") as f:
            f.write("".join(ln + "\n" for ln in lines))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise cannot_write(path, exc) from None


def replace_lines(path: Path, lines: list[str]) -> None:
    """Rewrite `path` as `lines` atomically (a temporary file, fsynced, renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write("".join(ln + "\n" for ln in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise cannot_write(path, exc) from None


def read_records(path: Path) -> tuple[list[dict], list[int]]:
    """The records of a metrics.jsonl / samples.jsonl (JSON objects with an integer "update"), and the
    line numbers skipped: a last line a crash cut short, or any other line that is not a record.
    A missing file has no records."""
    if not path.is_file():
        return [], []
    records, skipped = [], []
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            record = None
        if isinstance(record, dict) and type(record.get("update")) is int:
            records.append(record)
        else:
            skipped.append(lineno)
    return records, skipped


def skipped_note(path: Path, skipped: list[int]) -> str:
    """One line on the lines read_records skipped."""
    where = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
    return f"{path}: skipped {len(skipped)} unreadable line(s) (line {where}; a write cut short by a crash)"


def scalars(record: dict) -> dict[str, float]:
    """The fields of a metrics record that TensorBoard and wandb log: finite numbers (not bools, not
    None, not the step itself)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "update" and math.isfinite(v)}


def start_wandb(run_dir: Path, *, project: str, config: dict):
    """A wandb run named after run_dir, its files in RUN_DIR/wandb, the job's config attached."""
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(f"run.wandb = true needs the wandb package (`pip install rlengine[wandb]`): {exc}") from None
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config)


class RunOutputs:
    def __init__(self, run_dir: Path, *, tensorboard: bool, write: bool, wandb: dict | None = None,
                 wandb_project: str = "rlengine"):
        """wandb: the job's config (to_dict) to log to a wandb run in `wandb_project`; None: no wandb."""
        self.run_dir, self.write = run_dir, write
        self.tb = self.wandb = None
        if tensorboard and write:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir))
        if wandb is not None and write:
            self.wandb = start_wandb(run_dir, project=wandb_project, config=wandb)

    def reset(self, keep_through: int | None = None, source: Path | None = None) -> None:
        """A new run (keep_through None): empty metrics.jsonl, no samples.jsonl. A resumed one: keep
        the samples.jsonl lines of updates <= keep_through, read from `source` (default: this run's
        own; a forked run's source is the run it continues). The trainer rewrites metrics.jsonl itself."""
        samples = self.run_dir / "samples.jsonl"
        if keep_through is None:
            replace_lines(self.run_dir / "metrics.jsonl", [])
            samples.unlink(missing_ok=True)
            return
        source = source or samples
        if source.is_file():
            records, _ = read_records(source)
            replace_lines(samples, [json.dumps(r) for r in records if r["update"] <= keep_through])

    def log(self, record: dict) -> None:
        if not self.write:
            return
        append_lines(self.run_dir / "metrics.jsonl", [json.dumps(record)])
        values = scalars(record)
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=record["update"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=record["update"])

    def samples(self, rows: list[dict]) -> None:
        """Append rows (see samples_rows) to samples.jsonl."""
        if not self.write or not rows:
            return
        append_lines(self.run_dir / "samples.jsonl", [json.dumps(r) for r in rows])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def samples_rows(groups, advantages: list[float], tok, *, update: int, n: int) -> list[dict]:
    """One row per response of `groups` (RolloutGroups, in batch order) with its advantage."""
    rows, b = [], 0
    for g in groups:
        prompt = tok.decode(g.prompt_ids, skip_special_tokens=False)
        for i, ids in enumerate(g.completions):
            lp = g.logprobs[i]
            rows.append({"update": update, "N": n, "prompt": prompt,
                         "completion": tok.decode(ids, skip_special_tokens=False),
                         "reward": g.rewards[i], "score": (g.scores or g.rewards)[i], "advantage": advantages[b],
                         "length": len(ids), "logprob_mean": sum(lp) / max(1, len(lp)),
                         "logprob_min": min(lp, default=0.0), "finish_reason": g.finish_reasons[i],
                         "loss_weight": g.loss_weights[i] if g.loss_weights else 1.0})
            if g.roles:  # a multi-turn trajectory: turn by turn, with roles (rollout/trajectories.py)
                rows[-1].update(trajectory_row(g, i, tok))
            b += 1
    return rows


def write_samples(outputs: RunOutputs, groups, batch, tok, *, update: int, n: int, dist) -> None:
    """samples.jsonl rows of this update's responses (every rank's, gathered on rank 0); a write that
    fails is a ConfigError on every rank."""
    advantages = [float(batch.advantages[e - 1]) for e in batch.cu_seqlens[1:]]  # a response's last token
    rows = samples_rows(groups, advantages, tok, update=update, n=n)
    rows = [r for part in dist.all_gather_objects(rows) for r in part] if dist.enabled else rows
    try:
        outputs.samples(rows)
        fault = None
    except ConfigError as exc:  # a full disk: every rank ends on it, before the update's checkpoint
        fault = exc
    if dist.enabled and dist.broadcast_object(None if fault is None else str(fault)) is not None:
        raise fault or ConfigError("rank 0 could not write samples.jsonl (its error says why)")
    if fault is not None:
        raise fault
