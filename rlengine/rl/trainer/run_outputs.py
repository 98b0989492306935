"""What a run writes besides checkpoints: metrics.jsonl, samples.jsonl, TensorBoard event files, wandb.

The trainer hands every update-boundary record to RunOutputs.log() (one JSON line in
RUN_DIR/metrics.jsonl; with run.tensorboard = true also one scalar per numeric field, at
step = update, in TensorBoard event files in RUN_DIR itself, next to metrics.jsonl; with
run.wandb = true the same scalars under the same names to a wandb run in RUN_DIR/wandb) and, every
run.samples_every updates, the update's responses to samples() (one JSON line per response in
RUN_DIR/samples.jsonl: update, N, prompt and completion text, reward, advantage, token count,
mean and min token log-prob, finish reason). Only rank 0 writes. torch.utils.tensorboard is
imported only when asked for, and so is wandb (both packages are optional; the config checks them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlengine.model.config import ConfigError


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

    def reset(self, keep_through: int | None = None) -> None:
        """A new run (keep_through None): empty metrics.jsonl, no samples.jsonl. A resumed one: keep
        the samples.jsonl lines of updates <= keep_through (the trainer rewrites metrics.jsonl itself)."""
        samples = self.run_dir / "samples.jsonl"
        if keep_through is None:
            (self.run_dir / "metrics.jsonl").write_text("")
            samples.unlink(missing_ok=True)
        elif samples.is_file():
            kept = [ln for ln in samples.read_text().splitlines() if ln and json.loads(ln)["update"] <= keep_through]
            samples.write_text("".join(ln + "\n" for ln in kept))

    def log(self, record: dict) -> None:
        if not self.write:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
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
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

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
            b += 1
    return rows


def write_samples(outputs: RunOutputs, groups, batch, tok, *, update: int, n: int, dist) -> None:
    """samples.jsonl rows of this update's responses (every rank's, gathered on rank 0)."""
    advantages = [float(batch.advantages[e - 1]) for e in batch.cu_seqlens[1:]]  # a response's last token
    rows = samples_rows(groups, advantages, tok, update=update, n=n)
    rows = [r for part in dist.all_gather_objects(rows) for r in part] if dist.enabled else rows
    outputs.samples(rows)
