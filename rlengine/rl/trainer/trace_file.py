"""RUN_DIR/trace.jsonl: what the device clock needs to re-cost a run on another device.

T = N / q separates learning (N) from hardware (q): a run's T on another device is its step trace
re-costed with that device's step costs (rlengine/tune/clock.py, docs/METHOD.md "The device clock").
So each update boundary writes one line with its engine steps and its learner work, compactly:

    {"update": 7, "N": 224, "critic_only": false, "t_gen": 0.61, "t_train": 0.05, "step_seconds": 0.55,
     "decode":  [[B_act, steps, context_sum, seconds], ...],    # one row per (B_act, context bucket)
     "prefill": [[B_act, steps, tokens_sum, seconds], ...],     # one row per (B_act, token bucket)
     "learner": {"fwd_bwd": [tokens, ...], "forward": [tokens, ...], "optimizer_steps": 1}}

Steps with the same kind, B_act and context bucket (1/8 of an octave: contexts within ~9% of each
other) are one row: the count, the summed context (prefill: tokens) and the summed measured seconds.
The clock costs a row at its mean context, which is exact for a cost linear in context inside one
table cell. learner: the packed tokens of each micro-batch forward + backward, of each no-grad
forward (the learner's own old log-probs, a reference), and the optimizer steps (Learner.steps).
Only rank 0 writes (its own engine's steps; the ranks decode alike). The first line a run writes
drops any line of that update or later (a run resumed from an earlier checkpoint, or started over).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from rlengine.rl.trainer.run_outputs import append_lines, read_records, replace_lines
from rlengine.telemetry.records import StepRecord

BUCKETS_PER_OCTAVE = 8


def context_bucket(context: int) -> int:
    """The aggregation bucket of a context length: floor(8 log2(context)); 0 and 1 share bucket 0."""
    return int(math.floor(BUCKETS_PER_OCTAVE * math.log2(context))) if context > 1 else 0


def aggregate_steps(trace: Sequence[StepRecord]) -> dict[str, list[list]]:
    """{"decode": rows, "prefill": rows}, each row [B_act, steps, context_sum, seconds], sorted."""
    rows: dict[tuple[str, int, int], list] = {}
    for r in trace:
        context = r.context if r.context > 0 else r.tokens if r.kind == "prefill" else 1
        row = rows.setdefault((r.kind, r.b_act, context_bucket(context)), [r.b_act, 0, 0, 0.0])
        row[1] += 1
        row[2] += context
        row[3] += r.seconds
    out: dict[str, list[list]] = {"decode": [], "prefill": []}
    for (kind, _, _), row in sorted(rows.items()):
        out[kind].append([row[0], row[1], row[2], round(row[3], 7)])
    return out


def update_trace(trace: Sequence[StepRecord], learner_steps: Sequence[tuple[str, int]], *, update: int, n: int,
                 t_gen: float, t_train: float, critic_only: bool = False) -> dict:
    """The trace.jsonl line of one update: its engine steps (since the boundary's mark) and learner work."""
    return {"update": update, "N": n, "critic_only": critic_only, "t_gen": t_gen, "t_train": t_train,
            "step_seconds": sum(r.seconds for r in trace), **aggregate_steps(trace),
            "learner": {"fwd_bwd": [t for kind, t in learner_steps if kind == "fwd_bwd"],
                        "forward": [t for kind, t in learner_steps if kind == "forward"],
                        "optimizer_steps": sum(kind == "optimizer" for kind, _ in learner_steps)}}


class TraceFile:
    """Appends update lines to RUN_DIR/trace.jsonl (write=False on ranks other than 0: a no-op)."""

    def __init__(self, run_dir: str | Path, *, write: bool):
        self.path, self.write_lines, self._started = Path(run_dir) / "trace.jsonl", write, False

    def write(self, line: dict) -> None:
        if not self.write_lines:
            return
        if not self._started:  # keep only what came before this update (resume), nothing on a new run
            kept, _ = read_records(self.path)
            replace_lines(self.path, [json.dumps(r) for r in kept if r["update"] < line["update"]])
            self._started = True
        append_lines(self.path, [json.dumps(line)])


def read_trace(run_dir: str | Path) -> list[dict]:
    """The update lines of RUN_DIR/trace.jsonl (a line a crash cut short skipped); [] when there is none."""
    records, _ = read_records(Path(run_dir) / "trace.jsonl")
    return records
