"""Stage 1 of Algorithm 1 (docs/METHOD.md): sample-matched learning curves across B_train with the sqrt LR rule.

Every candidate B_train runs with eta = eta0 * sqrt(B_train / B0) from the job's reference
(B0 = the job's B_train, eta0 = its effective LR unless given), generation coupled (B_gen =
B_train), the same response budget N_max (updates = ceil(N_max / B_train)) and evaluations on
the same N grid (eval.every_responses). A candidate whose r_N exceeds 1 + eps then gets the LR
bracket of retune.py. Runs go seed-major (every candidate of seed 0, then of
seed 1, ...) so a drift in machine load spreads over all candidates instead of one. The optional
fixed-LR control runs the largest B_train at eta0 with no rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from rlengine.model.config import ConfigError
from rlengine.plan.specs import PlanChange
from rlengine.tune.curves import candidate_stats, group_curves, lr_effective
from rlengine.tune.ladder import implied_max_lag, window_point
from rlengine.tune.retune import retune
from rlengine.tune.runner import run_plans
from rlengine.tune.stage_records import RunCurve, RunPlan, Stage1Result, TuneSpec

Runner = Callable[[RunPlan], "RunCurve | None"]
# default N grid: about this many evaluations over N_max, at a multiple of the largest candidate B_train (so
# every candidate evaluates on update boundaries). N* comes from an isotonic fit between grid points, so a
# coarser grid moves it by at most half a step, while every evaluation costs a run as much as many updates
# (the long-response job: 128 prompts x 4 samples against 128 training responses per 4 updates).
EVALS_PER_BUDGET = 100


def reference(spec: TuneSpec) -> tuple[int, float]:
    """(B0, eta0): the spec's, else the job's B_train and the LR the job actually uses there."""
    train = spec.job["train"]
    return spec.b0 or int(train["b_train"]), spec.eta0 or lr_effective(train)


def budgets(spec: TuneSpec) -> tuple[int, int]:
    """(N_max, eval.every_responses) of every curve: the spec's eval_every, else about EVALS_PER_BUDGET
    evaluations over N_max, at least one per largest candidate B_train."""
    train = spec.job["train"]
    n_max = spec.n_max or int(train["updates"]) * int(train["b_train"])
    b = max(spec.b_train)
    return n_max, spec.eval_every or b * max(1, -(-n_max // (EVALS_PER_BUDGET * b)))


def candidate_batches(spec: TuneSpec) -> list[int]:
    """The candidate B_train values, sorted, with B0 added when missing (the reference is measured)."""
    g = int(spec.job["train"]["group_size"])
    b0, _ = reference(spec)
    batches = sorted(set(spec.b_train) | {b0})
    bad = [b for b in batches if b % g]
    if bad:
        raise ConfigError(f"tune: B_train {bad} not divisible by the job's group size G={g} (B_train = P*G)")
    return batches


def curve_change(spec: TuneSpec, b_train: int, *, rule: str = "sqrt", b_gen: int = 0,
                 num_kv_blocks: int = 0, lr_scale: float = 1.0) -> PlanChange:
    """The plan change of one sample-matched curve at b_train: coupled unless b_gen is given (then
    the lag B_gen implies), the engine's own KV pool unless num_kv_blocks is (stage 2 under
    --kv-bytes), eta0 x lr_scale at B0 (the retune bracket) under `rule`."""
    b0, eta0 = reference(spec)
    n_max, every = budgets(spec)
    return PlanChange(b_train=b_train, b0=b0, lr=eta0 * lr_scale, lr_rule=rule, updates=math.ceil(n_max / b_train),
                      b_gen=b_gen or b_train, eval_every_responses=every,
                      # async: the lag this B_gen implies, so lag aborts do not cap its q
                      max_lag=implied_max_lag(b_gen, b_train) if b_gen > b_train else None,
                      num_kv_blocks=num_kv_blocks or None)


def plan_stage1(spec: TuneSpec) -> list[RunPlan]:
    """Runs of stage 1, seed-major: each candidate (label str(B)) and the fixed-LR control ("B fixed")."""
    batches = candidate_batches(spec)
    plans = []
    for seed in spec.seeds:
        for b in batches:
            plans.append(RunPlan(name=f"s1-b{b}-s{seed}", stage="stage1", label=f"{b}", seed=seed,
                                 change=curve_change(spec, b), target_j=_stop(spec)))
        if spec.fixed_lr:
            b = max(batches)
            plans.append(RunPlan(name=f"ctl-b{b}-fixed-s{seed}", stage="control", label=f"{b} fixed", seed=seed,
                                 change=curve_change(spec, b, rule="none"), target_j=_stop(spec)))
    return plans


def _stop(spec: TuneSpec) -> float | None:
    return spec.target_j if spec.stop_at_target else None


def run_stage1(spec: TuneSpec, runner: Runner, notes: list[str]) -> Stage1Result:
    """Execute stage 1 (skipping what the budget does not allow) and summarise each configuration."""
    curves: list[RunCurve] = []
    plans = plan_stage1(spec)
    for plan, curve in zip(plans, run_plans(runner, plans)):
        if curve is None:
            notes.append(f"stage 1: {plan.label} seed {plan.seed} not run (time budget spent)")
            continue
        if curve.eval_j[0] >= spec.target_j:
            raise ConfigError(f"tune: J = {curve.eval_j[0]:.3f} already reaches J* = {spec.target_j} at N = 0 "
                              f"({plan.label}, seed {plan.seed}); choose a higher --target-j")
        curves.append(curve)
    b0, eta0 = reference(spec)
    n_max, every = budgets(spec)
    main = [c for c in curves if c.stage == "stage1" and c.update_n]
    window = min((c.update_n[-1] for c in main), default=0.0)
    cands = [candidate_stats(cs, spec.target_j, window) for cs in group_curves(curves).values()]
    scales: dict[int, float] = {}
    if spec.retune:
        def plan_for(b: int, seed: int, f: float, n_cap: float) -> RunPlan:
            change = curve_change(spec, b, lr_scale=f)
            change = dataclasses.replace(change, updates=min(change.updates, math.ceil(n_cap / b)))
            return RunPlan(name=f"rt-b{b}-x{f:.3f}-s{seed}", stage="retune", label=f"{b} lr x{f:.3f}", seed=seed,
                           change=change, target_j=_stop(spec))
        cands, curves, scales = retune(spec, cands, curves, f"{b0}", window, plan_for, runner, notes, n_max,
                                       win_caps(spec, curves, cands, f"{b0}"))
    for c in cands:
        if not c.all_reached:
            notes.append(f"stage 1: {c.label} reached J* = {spec.target_j} on {c.reached}/{len(c.hits)} seeds "
                         f"within N_max = {n_max}")
    return Stage1Result(reference=f"{b0}", b0=b0, eta0=eta0, n_max=n_max, eval_every=every,
                        candidates=tuple(cands), curves=tuple(curves), grad_window=window,
                        lr_scales=tuple(sorted(scales.items())))


def win_caps(spec: TuneSpec, curves: list[RunCurve], cands, reference: str) -> dict[tuple[str, int], float]:
    """(label, seed) -> the N past which that candidate cannot beat the reference on that seed even
    with free generation: N*_ref,s x q_free(B, s) / q_ref,s, from the coupled stage-1 windows
    (the updates stage 2's probes measure), where the reference reached J* on the seed."""
    ref = next((c for c in cands if c.label == reference), None)
    if ref is None:
        return {}
    ref_n = {s: h.n_star for s, h in zip(ref.seeds, ref.hits) if h.reached}
    win = {(c.label, c.seed): window_point(c, c.b_train, spec.probe_skip, spec.probe_updates)
           for c in curves if c.stage == "stage1" and c.update_n}
    out = {}
    for (label, seed), p in win.items():
        r = win.get((reference, seed))
        if label != reference and r is not None and seed in ref_n and r.q > 0 and math.isfinite(p.q_free):
            out[(label, seed)] = ref_n[seed] * p.q_free / r.q
    return out


def lr_scale(s1: Stage1Result, b_train: int) -> float:
    """The LR factor the retune kept for b_train (1: the sqrt rule's own eta)."""
    return dict(s1.lr_scales).get(b_train, 1.0)
