"""Time-to-target accounting (docs/METHOD.md decision rule and Table 1).

Each run that reached the target J* contributes (batch, N*, T). Against a reference run:
r_N = N*/N*_ref (samples-to-target penalty), q = N*/T (end-to-end throughput), q/q_ref, and the
normalised time T/T_ref = r_N / (q/q_ref). A larger batch wins exactly when q2/q1 > r_N. Units
are the caller's (Table 1 uses thousands of responses and hours); only ratios are reported.
Where N* and T come from: `first_crossing` reads N* off a learning curve (J linearly interpolated
between evaluations) and `value_at` reads the wall-clock T at that N* off the same run's clock;
`best_q_over_r` is the choice rule of docs/METHOD.md's Algorithm 1 (maximise q / r_N among feasible rows).
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
    """T2 < T1  <=>  q2/q1 > r_N (docs/METHOD.md decision rule)."""
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


def first_crossing(n: Sequence[float], j: Sequence[float], target: float) -> float | None:
    """N*: the first N at which J reaches `target`, J linearly interpolated between evaluations.

    n [E] nondecreasing evaluation points (N at each evaluation), j [E] the scores there. Returns
    n[0] when the first evaluation already reaches the target and None when no evaluation does
    (the run never reached J* within its budget: the caller reports it, it is not dropped).
    """
    if len(n) != len(j):
        raise ValueError(f"first_crossing: {len(n)} N values but {len(j)} J values")
    if any(b < a for a, b in zip(n, n[1:])):
        raise ValueError("first_crossing: N must be nondecreasing")
    for i, (x, y) in enumerate(zip(n, j)):
        if y >= target:
            if i == 0:
                return float(x)
            x0, y0 = n[i - 1], j[i - 1]
            # y0 < target <= y here, so the denominator is > 0
            return float(x0 + (target - y0) / (y - y0) * (x - x0))
    return None


def value_at(x: Sequence[float], y: Sequence[float], x0: float) -> float:
    """y linearly interpolated at x0 (x [E] nondecreasing, x[0] <= x0 <= x[-1]); e.g. the cumulative
    wall-clock of a run at its N*. Repeated x values take the first."""
    if len(x) != len(y) or not x:
        raise ValueError(f"value_at: needs equal, nonempty x and y, got {len(x)} and {len(y)} values")
    if not x[0] <= x0 <= x[-1]:
        raise ValueError(f"value_at: {x0} is outside [{x[0]}, {x[-1]}]")
    for i in range(1, len(x)):
        if x0 <= x[i]:
            if x[i] == x[i - 1]:
                return float(y[i - 1])
            w = (x0 - x[i - 1]) / (x[i] - x[i - 1])
            return float(y[i - 1] + w * (y[i] - y[i - 1]))
    return float(y[0])


def best_q_over_r(rows: Sequence[TargetRow], eligible: Sequence[str] | None = None) -> TargetRow:
    """Algorithm 1's choice (docs/METHOD.md): the row maximising (q/q_ref) / r_N among `eligible` run names (all
    rows when None). With q = N*/T this is the row with the smallest T, whichever row is the
    reference; ties keep the first row."""
    pool = [r for r in rows if eligible is None or r.run.name in eligible]
    if not pool:
        raise ValueError(f"best_q_over_r: no eligible rows among {[r.run.name for r in rows]}")
    return max(pool, key=lambda r: r.q_ratio / r.r_n)
