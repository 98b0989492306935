"""Stage 2's B_gen ladder for one candidate: repeated, interleaved probes and the paper's stopping rule.

Probe order (rungs 0, 1, 2, ... = B_gen ascending): 0, 1, 0', 2, 1', 3, 2', ... each rung's second
probe runs after its upper neighbour's first, so a drift in machine load lands on neighbouring
rungs alike instead of on one of them. A rung is judged once both its probes are in (q = their
mean). The ladder stops after two successive rungs fall below (1 - delta) q_max (q_max over the
judged rungs), at B_KV (the last rung is B_KV rounded down to G), or at the ladder's end; the rung
already started is finished so every point has two probes. The critical B_gen is the smallest
judged B_gen with q >= (1 - delta) q_max. Its gain over the coupled point is "inconclusive" when
smaller than twice the larger repeat spread of the two. Each probe sets gen.max_lag to the lag
its B_gen implies (implied_max_lag), so lag aborts do not cap q, and skips the pipeline fill
(probe_window).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from rlengine.tune.stats import repeat_spread
from rlengine.tune.stage_records import GenPoint, GenSweep, RunCurve, RunPlan

Runner = Callable[[RunPlan], "RunCurve | None"]


def implied_max_lag(b_gen: int, b_train: int) -> int:
    """The policy lag B_gen implies: a response joins B_gen in flight and is consumed about
    B_gen / B_train updates later; one more update covers length spread and filtered groups."""
    if b_gen < b_train or b_train < 1:
        raise ValueError(f"implied_max_lag needs b_gen >= b_train >= 1, got {b_gen}, {b_train}")
    return math.ceil(b_gen / b_train) + 1


def probe_window(b_gen: int, b_train: int, skip: int, updates: int) -> tuple[int, int]:
    """(skip, updates) of a probe at b_gen: the first fill of B_gen in flight holds about B_gen / B_train
    updates' worth of responses, so at least that many leading updates are skipped (their t_gen
    is the fill, later ones would be pre-generated); the measured window keeps its length."""
    lead = max(skip, math.ceil(b_gen / b_train))
    return lead, lead + (updates - skip)


def window(curve: RunCurve, skip: int, updates: int) -> tuple[int, int]:
    """[lo, end) of the probe window: updates skip+1 .. updates (all when the run stopped earlier)."""
    end = min(updates, len(curve.update_t))
    return (skip if end > skip else 0), end


def window_point(curve: RunCurve, b_gen: int, skip: int, updates: int) -> GenPoint:
    """q and what explains it over updates skip+1 .. updates of one run."""
    lo, end = window(curve, skip, updates)
    t = curve.update_t[end - 1] - (curve.update_t[lo - 1] if lo else 0.0)
    t_gen = sum(curve.update_t_gen[lo:end])
    responses = (end - lo) * curve.b_train
    k = end - lo

    def mean(xs):
        xs = list(xs[lo:end])
        return sum(xs) / len(xs) if xs else 0.0

    b_act = mean(curve.update_b_act)
    steps = [tok / b for tok, b in zip(curve.update_gen_tokens[lo:end], curve.update_b_act[lo:end]) if b > 0]
    stale = curve.update_stale[lo:end]
    return GenPoint(b_gen=b_gen, q=responses / t, q_gen=responses / t_gen if t_gen > 0 else 0.0,
                    lag_mean=sum(curve.policy_lag[lo:end]) / k, source=curve.name, q_reps=(responses / t,),
                    max_lag=curve.max_lag, q_free=responses / (t - t_gen) if t > t_gen else math.inf,
                    gen_share=t_gen / t if t > 0 else 0.0, b_act=b_act,
                    decode_steps=sum(steps) / len(steps) if steps else 0.0, resp_len=mean(curve.update_resp_len),
                    stale_aborted=sum(a for a, _ in stale), stale_dropped=sum(d for _, d in stale))


def merge_points(points: Sequence[GenPoint]) -> GenPoint:
    """Repeated probes of one B_gen as one point: means of every rate, sums of the stale counts."""
    if not points or len({p.b_gen for p in points}) != 1:
        raise ValueError("merge_points needs probes of one B_gen")
    n = len(points)

    def m(attr):
        return sum(getattr(p, attr) for p in points) / n

    qs = tuple(p.q for p in points)
    return GenPoint(b_gen=points[0].b_gen, q=sum(qs) / n, q_gen=m("q_gen"), lag_mean=m("lag_mean"),
                    source=", ".join(p.source for p in points), q_reps=qs, spread=repeat_spread(qs),
                    max_lag=points[0].max_lag, q_free=m("q_free"), gen_share=m("gen_share"), b_act=m("b_act"),
                    decode_steps=m("decode_steps"), resp_len=m("resp_len"),
                    stale_aborted=sum(p.stale_aborted for p in points),
                    stale_dropped=sum(p.stale_dropped for p in points))


def probe_order(rungs: int) -> list[tuple[int, int]]:
    """(rung, repeat) in run order for a ladder of `rungs`: 0, 1, 0', 2, 1', ..., last'."""
    order = [(0, 0)]
    for i in range(1, rungs):
        order += [(i, 0), (i - 1, 1)]
    return order + ([(rungs - 1, 1)] if rungs else [])


def stop_after(qs: Sequence[float], delta: float) -> bool:
    """The stopping rule on judged rung means (ascending B_gen): the last two are below (1 - delta) q_max."""
    if len(qs) < 3:
        return False
    bar = (1 - delta) * max(qs)
    return qs[-1] < bar and qs[-2] < bar


def critical(points: Sequence[GenPoint], delta: float) -> GenPoint:
    """The smallest-B_gen point with q >= (1 - delta) q_max."""
    bar = (1 - delta) * max(p.q for p in points)
    return next(p for p in sorted(points, key=lambda p: p.b_gen) if p.q >= bar)


def verdict(points: Sequence[GenPoint], crit: GenPoint) -> str:
    """gain | no gain | inconclusive. The gain judged is the critical point's over the coupled one (the
    best point's when the critical one is coupled); under twice the larger repeat spread of the two
    it cannot be told from noise: inconclusive, neither a gain nor a plateau."""
    base = points[0]
    other = crit if crit.b_gen != base.b_gen else max(points, key=lambda p: p.q)
    if other is base:
        return "no gain"
    gain = other.q / base.q - 1
    if abs(gain) < 2 * max(base.spread, other.spread):
        return "inconclusive"
    return "gain" if crit.b_gen != base.b_gen else "no gain"


def run_ladder(values: Sequence[int], make_plan: Callable[[int, int], RunPlan], runner: Runner, *,
               b_train: int, label: str, delta: float, window_for: Callable[[int], tuple[int, int]], b_kv: int,
               b_kv_source: str, capped: bool) -> GenSweep:
    """Probe the rungs `values` (ascending, values[0] = B_train) in probe_order, stopping by stop_after;
    make_plan(b_gen, repeat) gives each probe's RunPlan, window_for(b_gen) its (skip, updates) window;
    capped: the last rung is B_KV's."""
    probes: dict[int, list[GenPoint]] = {}
    judged: list[GenPoint] = []
    reason = "B_KV" if capped else "ladder end"
    for rung, rep in probe_order(len(values)):
        b_gen = values[rung]
        curve = runner(make_plan(b_gen, rep))
        if curve is None:
            reason = "budget"
            break
        probes.setdefault(b_gen, []).append(window_point(curve, b_gen, *window_for(b_gen)))
        if rep == 1:
            judged.append(merge_points(probes[b_gen]))
            if stop_after([p.q for p in judged], delta):
                reason = "plateau"
                pending = values[rung + 1] if rung + 1 < len(values) else None
                if pending in probes:  # finish the rung already started: every point has two probes
                    more = runner(make_plan(pending, 1))
                    if more is not None:
                        probes[pending].append(window_point(more, pending, *window_for(pending)))
                        judged.append(merge_points(probes[pending]))
                break
    points = judged or [merge_points(v) for v in probes.values()][:1]
    if not points:
        return GenSweep(b_train=b_train, label=label, points=(), b_kv=b_kv, b_kv_source=b_kv_source,
                        critical_b_gen=b_train, plateau=False, stop_reason=reason, verdict="")
    crit = critical(points, delta)
    return GenSweep(b_train=b_train, label=label, points=tuple(points), b_kv=b_kv, b_kv_source=b_kv_source,
                    critical_b_gen=crit.b_gen, plateau=reason == "plateau", stop_reason=reason,
                    verdict=verdict(points, crit))
