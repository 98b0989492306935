"""Stage 2 of Algorithm 1 (docs/METHOD.md): raise B_gen (decode concurrency, async partial rollouts) per candidate.

For each B_train that reached J* on every seed, B_gen climbs a ladder (1, 2, 4, 8 x B_train by
default; ladder.py): every rung probed twice, interleaved with its neighbours, each probe at the
policy lag its B_gen implies (gen.max_lag); the ladder stops after two successive rungs fall
below (1 - delta) q_max, at B_KV or at its end, and the critical B_gen is the smallest with q >=
(1 - delta) q_max. A gain under twice its probes' repeat spread is called inconclusive. q is
measured with one counter: the same window of updates (probe_skip, probe_updates] of a short
probe run per B_gen. B_KV is the engine's real capacity (blocks per sequence at the job's
longest context, no prefix sharing counted: a bound that holds for any group size);
--kv-bytes shrinks the pool to emulate a smaller device. Only the coupled stage-1 runs of the
first seed enter here, for the prune below and as the base the ladder's gain scales. A
candidate whose throughput could not win even with free generation (q bounded by N / t_train)
is not probed. Async rollouts change learning (policy lag), so the best async configurations
are re-run on every seed to measure their N* again (the re-check).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from rlengine.plan.specs import PlanChange

from rlengine.tune.curves import candidate_stats, mean_sd
from rlengine.tune.ladder import probe_window, run_ladder, window_point
from rlengine.tune.runner import run_plans
from rlengine.tune.stage1 import curve_change, lr_scale
from rlengine.tune.stage_records import (CandidateStats, EngineFacts, GenPoint, GenSweep, RunCurve, RunPlan, Stage1Result,
                                 Stage2Result, TuneSpec)

Runner = Callable[[RunPlan], "RunCurve | None"]
# B_KV of a CPU job without --kv-bytes: the trainer sizes its CPU pool for B_gen full-length sequences
# (no device limit), so tune assumes this much host memory for KV
CPU_KV_BYTES = 2 * 2**30


def kv_limit(facts: EngineFacts, kv_bytes: int = 0) -> tuple[int, str, int]:
    """(B_KV in sequences, where it comes from, gen.num_kv_blocks to set or 0) for the engine `facts`."""
    per_seq = math.ceil(facts.max_model_len / facts.block_size)
    if kv_bytes:
        blocks = kv_bytes // facts.block_bytes
        # the paper's m_KV(S) without block rounding, for comparison
        m_kv = facts.block_bytes / facts.block_size * facts.max_model_len
        return (blocks // per_seq, f"--kv-bytes {kv_bytes}: {blocks} blocks of {facts.block_bytes} B, {per_seq} "
                f"per sequence of S={facts.max_model_len} (floor(kv_bytes / m_KV(S)) = {int(kv_bytes // m_kv)})",
                blocks)
    if facts.device == "cuda":  # the pool was sized from free device memory: its size is the capacity
        return (facts.num_kv_blocks // per_seq,
                f"engine KV pool: {facts.num_kv_blocks} blocks, {per_seq} per sequence", 0)
    blocks = CPU_KV_BYTES // facts.block_bytes
    return blocks // per_seq, f"CPU KV budget {CPU_KV_BYTES} B: {blocks} blocks, {per_seq} per sequence", 0


def ladder(spec: TuneSpec, b_train: int, group: int) -> list[int]:
    """B_gen values to try for b_train, ascending, starting at b_train, multiples of G."""
    if spec.explicit_b_gen:
        values = {v for v in spec.b_gen if v >= b_train and v % group == 0}
    else:
        values = {m * b_train for m in (spec.b_gen or (1, 2, 4, 8)) if m >= 1}
    return sorted(values | {b_train})


def capped_ladder(spec: TuneSpec, b_train: int, group: int, b_kv: int) -> tuple[list[int], bool]:
    """The ladder with rungs past B_KV replaced by one rung at B_KV rounded down to G; (values, capped)."""
    values = ladder(spec, b_train, group)
    if not b_kv or values[-1] <= b_kv:
        return values, False
    kept = [v for v in values if v <= b_kv]
    top = b_kv // group * group
    return (kept + [top] if top > kept[-1] else kept), True


def sweep_candidate(spec: TuneSpec, cand: CandidateStats, first: RunCurve, runner: Runner, *, b_kv: int,
                    b_kv_source: str, kv_blocks: int, scale: float = 1.0) -> GenSweep:
    """The B_gen ladder of one candidate (ladder.run_ladder), every probe on the seed of `first` (its
    stage-1 run), the B_gen = B_train rung included: the points of one ladder run minutes apart, so
    a change in the machine's load between stage 1 and stage 2 does not enter their ratios."""
    group = int(spec.job["train"]["group_size"])
    values, capped = capped_ladder(spec, cand.b_train, group, b_kv)

    def plan(b_gen: int, rep: int) -> RunPlan:
        return RunPlan(name=f"p-b{cand.b_train}-g{b_gen}-s{first.seed}-r{rep}", stage="probe",
                       label=f"{cand.b_train} gen {b_gen}", seed=first.seed, target_j=None,
                       change=_probe_change(spec, cand.b_train, b_gen, kv_blocks, scale))

    return run_ladder(values, plan, runner, b_train=cand.b_train, label=cand.label, delta=spec.plateau_delta,
                      window_for=lambda g: probe_window(g, cand.b_train, spec.probe_skip, spec.probe_updates),
                      b_kv=b_kv, b_kv_source=b_kv_source, capped=capped)


def _probe_change(spec: TuneSpec, b_train: int, b_gen: int, kv_blocks: int, scale: float = 1.0) -> PlanChange:
    change = curve_change(spec, b_train, b_gen=b_gen, num_kv_blocks=kv_blocks, lr_scale=scale)
    return dataclasses.replace(change, updates=probe_window(b_gen, b_train, spec.probe_skip, spec.probe_updates)[1])


def n_star_mean(cand: CandidateStats) -> float:
    return mean_sd([h.n_star for h in cand.hits if h.reached])[0]


def run_stage2(spec: TuneSpec, s1: Stage1Result, runner: Runner, notes: list[str]) -> Stage2Result:
    """Sweeps for the candidates that reached J* on every seed, then the re-check of the best async ones."""
    first_seed = spec.seeds[0]
    firsts = {c.label: c for c in s1.curves if c.stage == "stage1" and c.seed == first_seed}
    survivors = [c for c in s1.candidates if c.stage == "stage1" and c.all_reached and c.label in firsts]
    if not survivors:
        notes.append("stage 2: no candidate reached J* on every seed; nothing to sweep")
        return Stage2Result(sweeps=(), rechecks=(), recheck_curves=(), b_kv=0, kv_blocks=0)
    facts = next((firsts[c.label].engine for c in survivors if firsts[c.label].engine), None)
    b_kv, source, kv_blocks = kv_limit(facts, spec.kv_bytes) if facts else (0, "unknown (no engine facts)", 0)
    skip, updates = spec.probe_skip, spec.probe_updates
    coupled = {c.label: window_point(firsts[c.label], c.b_train, skip, updates) for c in survivors}
    best_label = max(coupled, key=lambda k: coupled[k].q / n_star_mean(_by(survivors, k)))
    best_score = coupled[best_label].q / n_star_mean(_by(survivors, best_label))
    sweeps = []
    for cand in survivors:
        first = firsts[cand.label]
        if b_kv and cand.b_train > b_kv:
            notes.append(f"stage 2: B_train {cand.b_train} exceeds B_KV = {b_kv}: infeasible")
            sweeps.append(GenSweep(b_train=cand.b_train, label=cand.label, points=(), b_kv=b_kv, b_kv_source=source,
                                   critical_b_gen=cand.b_train, plateau=False, stop_reason="B_train > B_KV"))
            continue
        bound = coupled[cand.label].q_free / n_star_mean(cand)
        if cand.label != best_label and bound <= best_score:
            reason = (f"pruned: even with free generation q/N* <= {bound:.4g} does not beat {best_label} "
                      f"({best_score:.4g})")
            sweeps.append(GenSweep(b_train=cand.b_train, label=cand.label, points=(coupled[cand.label],),
                                   b_kv=b_kv, b_kv_source=source, critical_b_gen=cand.b_train, plateau=False,
                                   stop_reason=reason))
            continue
        sweeps.append(sweep_candidate(spec, cand, first, runner, b_kv=b_kv, b_kv_source=source,
                                      kv_blocks=kv_blocks, scale=lr_scale(s1, cand.b_train)))
    for sw in sweeps:
        if sw.stop_reason == "budget":
            notes.append(f"stage 2: {sw.label}: B_gen ladder stopped after {len(sw.points)} point(s) "
                         f"(time budget spent)")
        if sw.stop_reason in ("ladder end", "B_KV") and sw.points:
            notes.append(f"stage 2: {sw.label}: no q plateau within the ladder (stopped at {sw.stop_reason}, "
                         f"B_gen {sw.points[-1].b_gen})")
        if sw.verdict == "inconclusive":
            crit = next(p for p in sw.points if p.b_gen == sw.critical_b_gen)
            notes.append(f"stage 2: {sw.label}: the gain at B_gen {sw.critical_b_gen} ({crit.q / sw.points[0].q - 1:+.0%})"
                         f" is under twice its probes' repeat spread "
                         f"({max(crit.spread, sw.points[0].spread):.0%}): inconclusive, not a plateau")
    stats, curves = _recheck(spec, s1, sweeps, survivors, best_score, runner, kv_blocks, notes)
    return Stage2Result(sweeps=tuple(sweeps), rechecks=tuple(stats), recheck_curves=tuple(curves), b_kv=b_kv,
                        kv_blocks=kv_blocks)


def _by(cands: Sequence[CandidateStats], label: str) -> CandidateStats:
    return next(c for c in cands if c.label == label)


def _recheck(spec, s1, sweeps, survivors, best_score, runner, kv_blocks, notes
             ) -> tuple[list[CandidateStats], list[RunCurve]]:
    """J re-check on every seed at the critical B_gen, best predicted q/N* first, up to spec.recheck."""
    predicted = []
    for sw in sweeps:
        if sw.critical_b_gen == sw.b_train or not sw.points:
            continue
        # the ladder's own gain (same-time probes) applied to the stage-1 throughput best_score uses
        gain = next(p.q for p in sw.points if p.b_gen == sw.critical_b_gen) / sw.points[0].q
        first = next(c for c in s1.curves if c.stage == "stage1" and c.label == sw.label and c.seed == spec.seeds[0])
        q = window_point(first, sw.b_train, spec.probe_skip, spec.probe_updates).q * gain
        score = q / n_star_mean(_by(survivors, sw.label))
        if score > best_score:
            predicted.append((score, sw))
        else:
            notes.append(f"stage 2: {sw.label} gen {sw.critical_b_gen} not re-checked: predicted q/N* {score:.4g} "
                         f"does not beat the best coupled {best_score:.4g}")
    out, every = [], []
    for _, sw in sorted(predicted, key=lambda x: -x[0])[:spec.recheck]:
        plans = [RunPlan(name=f"rc-b{sw.b_train}-g{sw.critical_b_gen}-s{seed}", stage="recheck",
                         label=f"{sw.b_train} gen {sw.critical_b_gen}", seed=seed,
                         target_j=spec.target_j if spec.stop_at_target else None,
                         change=curve_change(spec, sw.b_train, b_gen=sw.critical_b_gen,
                                             num_kv_blocks=kv_blocks, lr_scale=lr_scale(s1, sw.b_train)))
                 for seed in spec.seeds]
        curves = []
        for plan, curve in zip(plans, run_plans(runner, plans)):
            if curve is None:
                notes.append(f"re-check: {plan.label} seed {plan.seed} not run (time budget spent)")
                continue
            curves.append(curve)
        if curves:
            out.append(candidate_stats(curves, spec.target_j, s1.grad_window))
            every += curves
    return out, every
