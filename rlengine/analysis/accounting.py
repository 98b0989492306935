"""Time-to-target accounting (PAPER.md decision rule and Table 1).

Each run that reached the target J* contributes (batch, N*, T). Against a reference run:
r_N = N*/N*_ref (samples-to-target penalty), q = N*/T (end-to-end throughput), q/q_ref, and the
normalised time T/T_ref = r_N / (q/q_ref). A larger batch wins exactly when q2/q1 > r_N. Units
are the caller's (Table 1 uses thousands of responses and hours); only ratios are reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetRun:
    """One configuration that reached J*."""

    batch: float         # P (prompts per update) or B_train; only used for labels and plots
    n_star: float        # N*: retained responses consumed to reach J*
    t: float             # T: wall-clock time to reach J*
    label: str = ""      # distinguishes runs with the same batch (e.g. "256 fixed LR"); default str(batch)

    @property
    def name(self) -> str:
        return self.label or f"{self.batch:g}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetRow:
    """A run against the reference."""

    run: TargetRun
    r_n: float       # N* / N*_ref
    q: float         # N* / T
    q_ratio: float   # q / q_ref
    t_norm: float    # T / T_ref
    wins: bool       # larger_batch_wins(q_ratio, r_n): reaches J* sooner than the reference


def larger_batch_wins(q2_over_q1: float, r_n: float) -> bool:
    """T2 < T1  <=>  q2/q1 > r_N (PAPER.md decision rule)."""
    if not q2_over_q1 > 0 or not r_n > 0:
        raise ValueError(f"larger_batch_wins: q2/q1 and r_N must be > 0, got {q2_over_q1}, {r_n}")
    return q2_over_q1 > r_n


def throughput_ratio(responses1: float, t1: float, responses2: float, t2: float) -> float:
    """(responses2/t2) / (responses1/t1): e.g. 4x responses in 68 s vs 39 s gives 4*39/68 = 2.29."""
    for name, value in (("responses1", responses1), ("t1", t1), ("responses2", responses2), ("t2", t2)):
        if not value > 0:
            raise ValueError(f"throughput_ratio: {name} must be > 0, got {value}")
    return (responses2 / t2) / (responses1 / t1)


def time_to_target(runs: Sequence[TargetRun], reference: str) -> list[TargetRow]:
    """Rows for every run against the run named `reference` (its label, or str(batch))."""
    if not runs:
        raise ValueError("time_to_target: no runs given")
    for r in runs:
        if not r.n_star > 0 or not r.t > 0:
            raise ValueError(f"time_to_target: run {r.name!r} needs N* > 0 and T > 0, got {r.n_star}, {r.t}")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"time_to_target: run names must be unique (set label), got {names}")
    if reference not in names:
        raise ValueError(f"time_to_target: reference {reference!r} is not among the runs {names}")
    ref = runs[names.index(reference)]
    q_ref = ref.n_star / ref.t
    rows = []
    for r in runs:
        r_n, q = r.n_star / ref.n_star, r.n_star / r.t
        rows.append(TargetRow(run=r, r_n=r_n, q=q, q_ratio=q / q_ref, t_norm=r.t / ref.t,
                              wins=r is not ref and larger_batch_wins(q / q_ref, r_n)))
    return rows


def best_configuration(rows: Sequence[TargetRow]) -> TargetRow:
    """The row with the smallest time-to-target."""
    if not rows:
        raise ValueError("best_configuration: no rows given")
    return min(rows, key=lambda row: row.run.t)
