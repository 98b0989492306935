"""Stage 1's LR retune ("retune as needed", Algorithm 1 of docs/METHOD.md): a small bracket around the sqrt rule.

A candidate whose samples-to-target penalty r_N (paired over seeds against the reference,
censored seeds at their budget, so it is a lower bound when any missed) exceeds 1 + eps is run
again at eta x 1/sqrt2 and eta x sqrt2 on every seed. The bracket member that reached J* on the
most seeds, then with the smallest censored mean N* (x1 on a tie), is kept under the candidate's
own label (stage1), stated as retuned; the others
stay in the table as "B lr xF" rows of stage "retune" (never chosen). The reference is not retuned.
A bracket run stops at the first of two bounds, each a point past which it cannot matter:
- CAP x the N* its seed's x1 run needed (N_max when that run missed): it has lost to x1 there;
- N*_ref x q_free / q_ref on its seed (stage-1 windows; q_free = responses / t_train, the
  candidate's throughput if generation cost nothing): past it, T > T_ref whatever B_gen does.
A run stalled on a plateau would otherwise take the whole budget. It is then censored where it
stopped (N* > its run's N), as every miss is. A candidate whose q_free is below q_ref on every
seed cannot win even at r_N = 1 and is not retuned.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from rlengine.tune.curves import candidate_stats
from rlengine.tune.runner import run_plans
from rlengine.tune.stage_records import CandidateStats, RunCurve, RunPlan, TuneSpec

Runner = Callable[[RunPlan], "RunCurve | None"]
BRACKET = (1 / math.sqrt(2), math.sqrt(2))   # with the rule's own x1, the bracket x{1/sqrt2, 1, sqrt2}
CAP = 2.0                                    # a bracket run stops at CAP x its seed's x1 N*


def censored_mean_n(c: CandidateStats) -> float:
    """Mean N* over every seed with a miss counted at the budget (N* > N_max censored the same way everywhere)."""
    return sum(c.censored_n(i) for i in range(len(c.hits))) / len(c.hits)


def censored_r_n(c: CandidateStats, ref: CandidateStats) -> float | None:
    """Geometric-mean r_N over the seeds where the reference reached J*, c's misses at its budget
    (a lower bound then); None when the reference reached on no seed of c."""
    ref_n = {s: h.n_star for s, h in zip(ref.seeds, ref.hits) if h.reached}
    logs = [math.log(c.censored_n(i) / ref_n[s]) for i, s in enumerate(c.seeds) if s in ref_n]
    return math.exp(sum(logs) / len(logs)) if logs else None


def needs_retune(cands: Sequence[CandidateStats], reference: str, eps: float) -> list[CandidateStats]:
    """The sqrt-rule candidates (not the reference) with censored r_N > 1 + eps."""
    ref = next((c for c in cands if c.label == reference), None)
    if ref is None:
        return []
    out = []
    for c in cands:
        if c.stage != "stage1" or c.label == reference:
            continue
        r = censored_r_n(c, ref)
        if r is not None and r > 1 + eps:
            out.append(c)
    return out


def _scale_label(f: float) -> str:
    return {1.0: "x1"}.get(round(f, 6), "x1/sqrt2" if f < 1 else "xsqrt2")


def keep_order(c: CandidateStats, factor: float) -> tuple:
    """Sort key of the bracket members, best first: more seeds that reached J*, then the smaller
    censored mean N*, then the rule's own x1. A censored N* is a lower bound, so a member that
    missed J* where another reached it never wins on a smaller censored mean."""
    return -c.reached, censored_mean_n(c), factor != 1.0


def bracket_cap(hit, n_max: float, win_cap: float | None = None) -> float:
    """Where a bracket run stops: CAP x its seed's x1 N* (when x1 reached J*), the seed's win cap
    (N*_ref x q_free / q_ref, when known), at most n_max."""
    cap = min(n_max, CAP * hit.n_star) if hit.reached else n_max
    return min(cap, win_cap) if win_cap is not None else cap


def retune(spec: TuneSpec, cands: list[CandidateStats], curves: list[RunCurve], reference: str, window: float,
           plan_for: Callable[[int, int, float, float], RunPlan], runner: Runner, notes: list[str], n_max: float,
           win_caps: dict[tuple[str, int], float] | None = None
           ) -> tuple[list[CandidateStats], list[RunCurve], dict[int, float]]:
    """Run the bracket of every candidate that needs it, all of them as one list of plans (runner.map
    may run them side by side); plan_for(B_train, seed, factor, N cap); win_caps: (label, seed) ->
    N*_ref x q_free / q_ref. Returns (candidates, curves, {B_train: LR scale kept})."""
    win_caps = win_caps or {}
    todo = []
    for cand in needs_retune(cands, reference, spec.retune_eps):  # (empty without the reference)
        ref = next(c for c in cands if c.label == reference)
        ref_n = {s: h.n_star for s, h in zip(ref.seeds, ref.hits) if h.reached}
        caps = [win_caps.get((cand.label, s)) for s in cand.seeds]
        if caps and all(c is not None and s in ref_n and c <= ref_n[s] for c, s in zip(caps, cand.seeds)):
            notes.append(f"stage 1: {cand.label}: r_N > 1 + {spec.retune_eps}, not retuned: its free-generation "
                         f"throughput is below the reference's q on every seed, so it cannot win even at r_N = 1")
            continue
        todo.append(cand)
    plans, keys = [], []
    for cand in todo:
        for f in BRACKET:
            for seed, hit in zip(cand.seeds, cand.hits):
                plans.append(plan_for(cand.b_train, seed, f, bracket_cap(hit, n_max, win_caps.get((cand.label, seed)))))
                keys.append((cand.label, f, seed))
    runs: dict[tuple[str, float], list[RunCurve]] = {}
    for (label, f, seed), curve in zip(keys, run_plans(runner, plans)):
        if curve is None:
            notes.append(f"retune: {label} {_scale_label(f)} seed {seed} not run (time budget spent)")
            continue
        runs.setdefault((label, f), []).append(curve)
    scales: dict[int, float] = {}
    for cand in todo:
        members = {1.0: (cand, [c for c in curves if c.label == cand.label])}
        for f in BRACKET:
            got = runs.get((cand.label, f), [])
            if len(got) == len(cand.seeds):
                members[f] = (candidate_stats(got, spec.target_j, window), got)
        best = min(members, key=lambda f: keep_order(members[f][0], f))
        scales[cand.b_train] = best
        summary = ", ".join(f"{_scale_label(f)}: N* {censored_mean_n(m[0]):.0f} ({m[0].reached}/{len(m[0].hits)})"
                            for f, m in sorted(members.items()))
        text = f"retuned: eta {_scale_label(best)} kept" if best != 1.0 else "bracket run: the sqrt-rule eta kept"
        notes.append(f"stage 1: {cand.label}: r_N > 1 + {spec.retune_eps}; {text} (censored mean N* {summary}; "
                     f"bracket runs stop at {CAP:g} x their seed's x1 N* or where they can no longer win)")
        cands, curves = _swap(cands, curves, cand, members, best, text)
    return cands, curves, scales


def _swap(cands, curves, cand, members, best, text):
    """The kept bracket member takes the candidate's label and stage; the others become retune rows."""
    out_c = [c for c in cands if c.label != cand.label]
    out_r = [c for c in curves if c.label != cand.label]
    for f, (stats, runs) in sorted(members.items()):
        if f == best:
            out_c.append(dataclasses.replace(stats, label=cand.label, stage="stage1", retuned=text))
            out_r += [dataclasses.replace(r, label=cand.label, stage="stage1") for r in runs]
        else:
            lab = f"{cand.b_train} lr {_scale_label(f)}"
            out_c.append(dataclasses.replace(stats, label=lab, stage="retune"))
            out_r += [dataclasses.replace(r, label=lab, stage="retune") for r in runs]
    order = {c.label: i for i, c in enumerate(cands)}
    out_c.sort(key=lambda c: (order.get(c.label, len(order)), c.label))
    return out_c, out_r
