"""Table 1 from seed-replicated configurations, and Algorithm 1's choice among its rows
(docs/METHOD.md).

Each configuration's N*, T and K* are means over the seeds that reached J*; the arithmetic
(r_N, q/q_ref, T/T_ref, wins) is rlengine.analysis.accounting.time_to_target on those means, so
it is the same code that reproduces the paper's Table 1. The spread of r_N (and of T/T_ref) is
the range of the per-seed ratios N*_s / N*_ref,s (T_s / T_ref,s) over seeds where both reached,
and each of r_N, q/q_ref and T/T_ref has its 95% interval (stats.paired_log_ratio) over the
same seeds. A seed that missed J* is censored at its budget (N* > N_max): counted, in r_n_lower,
never paired. A row may be chosen only when every seed reached J*, it is not a control or a
retune bracket member, and its batches fit the KV limit; `why` says what kept a row out.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from rlengine.analysis.accounting import TargetRun, best_q_over_r, time_to_target
from rlengine.tune.curves import mean_sd
from rlengine.tune.stats import paired_log_ratio
from rlengine.tune.stage_records import CandidateStats, TableRow


def _reached(c: CandidateStats) -> dict[int, tuple[float, float]]:
    """seed -> (N*, T) for the seeds that reached J*."""
    return {s: (h.n_star, h.t_star) for s, h in zip(c.seeds, c.hits) if h.reached}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def build_rows(cands: Sequence[CandidateStats], reference: str, *, b_kv: int = 0) -> list[TableRow]:
    """One TableRow per configuration, ratios against the configuration labelled `reference`.

    N*, T and K* are means over the row's own reaching seeds; r_N, q/q_ref and T/T_ref compare the
    row with the reference over the seeds where BOTH reached (paired: a seed that is hard for one
    batch size is hard for all, and unpaired means would mix that into the ratios)."""
    labels = [c.label for c in cands]
    if reference not in labels:
        raise ValueError(f"build_rows: reference {reference!r} is not among {labels}")
    ref_hits = _reached(cands[labels.index(reference)])
    rows = []
    for c in cands:
        hits = _reached(c)
        n, n_sd = mean_sd([v[0] for v in hits.values()])
        t, t_sd = mean_sd([v[1] for v in hits.values()])
        both = [s for s in hits if s in ref_hits]
        acc = None
        if both and c.label != reference:
            pair = [TargetRun(batch=0, n_star=_mean(ref_hits[s][0] for s in both),
                              t=_mean(ref_hits[s][1] for s in both), label=reference),
                    TargetRun(batch=c.b_train, n_star=_mean(hits[s][0] for s in both),
                              t=_mean(hits[s][1] for s in both), label=c.label)]
            acc = time_to_target(pair, reference)[1]
        is_ref = c.label == reference and bool(hits)
        lower = None
        ref_seeds = [s for s in c.seeds if s in ref_hits]
        if not c.all_reached and ref_seeds and c.label != reference:
            at = {s: c.censored_n(i) for i, s in enumerate(c.seeds)}
            lower = sum(at[s] for s in ref_seeds) / sum(ref_hits[s][0] for s in ref_seeds)
        feasible = not b_kv or (c.b_gen <= b_kv and c.b_train <= b_kv)
        cis = _intervals(hits, ref_hits, both) if c.label != reference else (None, None, None)
        why = _why(c, feasible, b_kv)
        rows.append(TableRow(
            label=c.label, stage=c.stage, b_train=c.b_train, b_gen=c.b_gen, lr=c.lr,
            reached=f"{c.reached}/{len(c.hits)}", k_star=n / c.b_train if n is not None else None,
            n_star=n, n_star_sd=n_sd, t=t, t_sd=t_sd, r_n=1.0 if is_ref else (acc.r_n if acc else None),
            r_n_lower=lower, r_n_range=_range([hits[s][0] / ref_hits[s][0] for s in both]),
            t_norm_range=_range([hits[s][1] / ref_hits[s][1] for s in both]),
            q_ratio=1.0 if is_ref else (acc.q_ratio if acc else None),
            t_norm=1.0 if is_ref else (acc.t_norm if acc else None),
            wins=False if is_ref else (acc.wins if acc else None),
            eligible=not why, r_n_ci=cis[0], q_ci=cis[1], t_ci=cis[2], censored=len(c.hits) - c.reached,
            why=why))
    return rows


def _intervals(hits: dict, ref_hits: dict, both: list[int]) -> tuple:
    """95% intervals (as dicts) of N*/N*_ref, q/q_ref and T/T_ref, paired over the seeds in `both`."""
    if not both:
        return None, None, None
    n, t = [hits[s][0] for s in both], [hits[s][1] for s in both]
    n0, t0 = [ref_hits[s][0] for s in both], [ref_hits[s][1] for s in both]
    if any(v <= 0 for v in n + t + n0 + t0):
        return None, None, None
    q, q0 = [a / b for a, b in zip(n, t)], [a / b for a, b in zip(n0, t0)]
    return tuple(dataclasses.asdict(paired_log_ratio(a, b)) for a, b in ((n, n0), (q, q0), (t, t0)))


def _why(c: CandidateStats, feasible: bool, b_kv: int) -> str:
    """What keeps a row from being chosen ("" when nothing does)."""
    if c.stage == "control":
        return "control (fixed LR)"
    if c.stage == "retune":
        return "retune bracket member, not kept"
    if not c.all_reached:
        return f"censored: {len(c.hits) - c.reached}/{len(c.hits)} seeds missed J* (N* > N_max)"
    if not feasible:
        return f"infeasible: B_gen or B_train > B_KV = {b_kv}"
    return ""


def _range(values: list[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if values else None


def choose_row(rows: Sequence[TableRow], reference: str) -> TableRow | None:
    """The eligible row maximising q / r_N against `reference` (= the smallest mean T); None when no
    row is eligible. Without reference ratios (the reference never reached J*) the T ordering is used."""
    eligible = [r for r in rows if r.eligible]
    if not eligible:
        return None
    if any(r.r_n is None for r in eligible):
        return min(eligible, key=lambda r: r.t)
    runs = [TargetRun(batch=r.b_train, n_star=r.n_star, t=r.t, label=r.label) for r in rows if r.n_star]
    best = best_q_over_r(time_to_target(runs, reference), eligible=[r.label for r in eligible])
    return next(r for r in eligible if r.label == best.run.name)
