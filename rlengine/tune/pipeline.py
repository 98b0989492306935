"""Algorithm 1 of docs/METHOD.md end to end (`rlengine tune`) and the same accounting over existing runs
(`rlengine report`).

tune(spec, out_dir): stage 1 -> stage 2 -> Table 1 rows -> choice (max q / r_N among rows every seed
of which reached J*) -> confirmation: the chosen configuration against the best coupled one
(B_gen = B_train: what a user without the asymmetry would run; the job's own when that is the
chosen row) on FRESH seeds (the stage-1 seeds chose it, so their times are biased in its favour)
-> report files in out_dir.
report_runs(dirs, target_j): reads run directories a user already has and builds the same table,
grad-norm slope and figures, with no runs started.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Sequence

from rlengine.tune.curves import candidate_stats, group_curves, lr_effective, read_run, target_hit
from rlengine.tune.runner import TrainerRunner, plan_config, run_plans
from rlengine.plan.specs import PlanChange
from rlengine.tune.stage1 import budgets, curve_change, lr_scale, run_stage1
from rlengine.tune.stats import (CS_METHOD, faster_per_seed, log_confidence_sequence, sequential_verdict,
                                 sign_test_p)
from rlengine.tune.stage2 import run_stage2
from rlengine.tune.table import build_rows, choose_row
from rlengine.tune.stage_records import (Confirmation, GenPoint, GenSweep, RunCurve, RunPlan, RunsReport, TableRow,
                                 TuneResult, TuneSpec)

Runner = Callable[[RunPlan], "RunCurve | None"]


def chosen_change(spec: TuneSpec, b_train: int, b_gen: int, kv_blocks: int = 0, scale: float = 1.0) -> PlanChange:
    """The change that turns the job into a chosen (B_train, B_gen): the sqrt rule from (B0, eta0) times
    the retune's LR factor, and the lag B_gen implies when async."""
    change = curve_change(spec, b_train, b_gen=b_gen, num_kv_blocks=kv_blocks, lr_scale=scale)
    # how the tune evaluated is not part of the configuration
    return dataclasses.replace(change, eval_every_responses=None)


def confirm(spec: TuneSpec, chosen: tuple[str, PlanChange], baseline: tuple[str, PlanChange], runner: Runner,
            notes: list[str]) -> tuple[Confirmation | None, list[RunCurve]]:
    """(label, change) of the chosen configuration against a baseline's on fresh seeds, each run to J*
    (or its budget), one seed pair at a time (its baseline run next to its chosen run, side by side with
    two workers), until the answer is clear: the 95% confidence sequence on T_chosen / T_baseline
    (stats.log_confidence_sequence, over the pairs where both reached J*) excludes 1, or lies within
    [1 / (1 + spec.min_effect), 1 + spec.min_effect], or spec.confirm_seeds pairs (the cap) or the
    time budget are spent. The confidence sequence holds at every number of pairs at once, so stopping
    on it keeps its 95% (a t-interval recomputed after each pair would not)."""
    _, every = budgets(spec)
    (label, change), (base_label, base_change) = chosen, baseline
    chosen_over = dataclasses.replace(change, eval_every_responses=every)
    base_over = dataclasses.replace(base_change, eval_every_responses=every)
    probe = RunPlan(name="x", stage="confirm", label="", seed=0, change=PlanChange(), target_j=None)
    if _meaning(spec.job, _with(probe, chosen_over)) == _meaning(spec.job, _with(probe, base_over)):
        notes.append(f"confirmation: the chosen configuration {label} is {base_label}; nothing to compare")
        return None, []
    stop = spec.target_j if spec.stop_at_target else None
    t_c, t_d, end_c, end_d, curves, seeds = [], [], [], [], [], []
    ci, reason = None, f"the cap of {spec.confirm_seeds} pairs (--confirm-seeds)"
    for seed in range(max(spec.seeds) + 1, max(spec.seeds) + 1 + spec.confirm_seeds):
        plans = [RunPlan(name=f"cf-base-s{seed}", stage="confirm", label=base_label, seed=seed, change=base_over,
                         target_j=stop),
                 RunPlan(name=f"cf-tuned-s{seed}", stage="confirm", label=f"tuned {label}", seed=seed,
                         change=chosen_over, target_j=stop)]
        got = run_plans(runner, plans)
        if all(c is None for c in got):
            reason = f"the time budget, after {len(seeds)} pairs"
            notes += [f"confirmation: {p.label} seed {p.seed} not run (time budget spent)" for p in plans]
            break
        seeds.append(seed)
        for plan, curve in zip(plans, got):
            out, end = (t_c, end_c) if plan.name.startswith("cf-tuned") else (t_d, end_d)
            if curve is None:
                notes.append(f"confirmation: {plan.label} seed {plan.seed} not run (time budget spent)")
                out.append(None)
                end.append(0.0)
                continue
            curves.append(curve)
            out.append(target_hit(curve, spec.target_j).t_star)
            end.append(curve.update_t[-1] if curve.update_t else 0.0)
        pairs = [(c, d) for c, d in zip(t_c, t_d) if c and d]
        ci = log_confidence_sequence([math.log(c / d) for c, d in pairs])
        verdict = sequential_verdict(ci, spec.min_effect)
        if verdict is not None:
            reason = f"{verdict} after {len(seeds)} pairs"
            break
    return _confirmation(label, base_label, seeds, (t_c, t_d, end_c, end_d), ci, reason), curves


def _confirmation(label: str, base_label: str, seeds: list[int], times, ci, reason: str) -> Confirmation:
    """The Confirmation record of the pairs run: per-seed times, the interval, the per-seed order."""
    t_c, t_d, end_c, end_d = times
    ratio = tuple(c / d for c, d in zip(t_c, t_d) if c is not None and d is not None)
    mc = [t for t in t_c if t is not None]
    md = [t for t in t_d if t is not None]
    rom = (sum(mc) / len(mc)) / (sum(md) / len(md)) if mc and md else None
    order = faster_per_seed(t_c, t_d, end_c, end_d)
    known = [f for f in order if f is not None]
    return Confirmation(chosen=label, default=base_label, seeds=tuple(seeds), t_chosen=tuple(t_c),
                        t_default=tuple(t_d), ratio=ratio, ratio_of_means=rom,
                        interval=dataclasses.asdict(ci) if ci else None, t_chosen_end=tuple(end_c),
                        t_default_end=tuple(end_d), faster=tuple(order),
                        sign_p=sign_test_p(sum(known), len(known)) if known else None,
                        method=CS_METHOD, stop_reason=reason)


def coupled_best(rows: Sequence[TableRow], reference: str) -> TableRow | None:
    """The best eligible coupled (B_gen = B_train) row: what a user without the asymmetry would run."""
    coupled = [r for r in rows if r.b_gen == r.b_train]
    return choose_row(coupled, reference) if any(r.label == reference for r in coupled) else None


def baseline_for(spec: TuneSpec, s1, s2, rows: Sequence[TableRow], best: TableRow) -> tuple[str, PlanChange]:
    """What the confirmation compares the chosen row with: the best coupled configuration
    (T_coupled-best); when the chosen row is that one, the job's own configuration."""
    base = coupled_best(rows, s1.reference)
    if base is not None and base.label != best.label:
        change = chosen_change(spec, base.b_train, base.b_gen, s2.kv_blocks, lr_scale(s1, base.b_train))
        return f"{base.label} (coupled best)", change
    return "job", PlanChange()


def _meaning(job: dict, plan: RunPlan) -> dict:
    """What a config computes: the run section (seed, directory) left out and (lr, b0, lr_rule) as
    the one LR they give, so the job's b0 = 0 and the tune's b0 = B_train compare equal."""
    d = plan_config(job, plan, Path("unused")).to_dict()
    d.pop("run")
    train = d["train"]
    train["eta"] = lr_effective(train)
    for key in ("lr", "b0", "lr_rule"):
        train.pop(key)
    return d


def _with(plan: RunPlan, change: PlanChange) -> RunPlan:
    return dataclasses.replace(plan, change=change)


def tune(spec: TuneSpec, out_dir: str | Path, *, runner: Runner | None = None, resume: bool = False,
         log: Callable[[str], None] = print) -> TuneResult:
    """Run Algorithm 1 (docs/METHOD.md) for `spec`, writing every run under out_dir/runs and the report in out_dir."""
    from rlengine.tune.report import write_report

    from rlengine.tune.clock import DeviceClock

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    clock = DeviceClock.load(spec.cost_table) if spec.cost_table else None
    runner = runner or TrainerRunner(spec.job, out_dir, resume=resume, budget_s=spec.budget_s, clock=spec.clock,
                                     threads=spec.threads, workers=spec.workers, log=log, device_clock=clock)
    notes: list[str] = []
    if clock is not None:
        log(f"tune: clock: {clock.label} (each run's step trace re-costed; the runs time themselves too)")
    log(f"tune: stage 1 (training batch): B_train {sorted(spec.b_train)}, seeds {list(spec.seeds)}, "
        f"J* = {spec.target_j}")
    s1 = run_stage1(spec, runner, notes)
    log("tune: stage 2 (generation concurrency)")
    s2 = run_stage2(spec, s1, runner, notes)
    rows = build_rows(list(s1.candidates) + list(s2.rechecks), s1.reference, b_kv=s2.b_kv)
    best = choose_row(rows, s1.reference)
    conf, curves, change = None, [], PlanChange()
    if best is None:
        notes.append("choice: no configuration reached J* on every seed; nothing chosen")
    else:
        change = chosen_change(spec, best.b_train, best.b_gen, s2.kv_blocks, lr_scale(s1, best.b_train))
        if spec.confirm_seeds:
            base = baseline_for(spec, s1, s2, rows, best)
            log(f"tune: confirmation: {best.label} against {base[0]}, fresh seed pairs until the 95% confidence "
                f"sequence is decisive (at most {spec.confirm_seeds})")
            conf, curves = confirm(spec, (best.label, change), base, runner, notes)
    header = run_header(spec, s1)
    if clock is not None:
        notes += clock.notes()
        header["device_clock"] = clock.summary()
    result = TuneResult(spec=spec, stage1=s1, stage2=s2, rows=tuple(rows), chosen=best.label if best else "",
                        chosen_overrides=change.overrides(), confirmation=conf, confirm_curves=tuple(curves),
                        notes=tuple(notes), wall_s=time.perf_counter() - t0, header=header,
                        chosen_lr=best.lr if best else 0.0)
    write_report(result, out_dir)
    log(f"tune: report in {out_dir} ({result.wall_s:.0f} s)")
    return result


def run_header(spec: TuneSpec, s1) -> dict:
    """The conditions every number of the report was measured under: threads, load, clock, host."""
    import os

    from rlengine.telemetry.provenance import cpu_isa, cpu_model

    curves = s1.curves
    loads = [x for c in curves for x in c.load if x >= 0]
    busy = [c.cpu_s / c.wall_s for c in curves if c.wall_s > 0 and c.cpu_s > 0]
    return {"threads": spec.threads, "workers": spec.workers, "clock": sorted({c.clock for c in curves}) or [spec.clock],
            "load_min": min(loads, default=None), "load_max": max(loads, default=None),
            "cpu_per_wall": (sum(busy) / len(busy)) if busy else None, "cores": os.cpu_count(),
            "host": cpu_model(), "cpu_isa": cpu_isa(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories among `paths`: each path itself if it holds config.json and metrics.jsonl,
    else its immediate subdirectories that do (so OUT/runs of a tune works as one argument)."""
    found = []
    for p in map(Path, paths):
        if (p / "config.json").is_file() and (p / "metrics.jsonl").is_file():
            found.append(p)
        elif p.is_dir():
            found += sorted(d for d in p.iterdir() if (d / "config.json").is_file() and (d / "metrics.jsonl").is_file())
        else:
            raise ValueError(f"{p}: no such run directory")
    if not found:
        raise ValueError(f"no run directories (config.json + metrics.jsonl) under {[str(p) for p in paths]}")
    return found


def report_runs(paths: Sequence[str | Path], target_j: float, *, reference: str = "", delta: float = 0.1,
                stages: Sequence[str] = ("stage1", "control", "recheck", "run"), clock=None) -> RunsReport:
    """The accounting of existing runs: seeds of one configuration (same B_train, B_gen, LR rule) are
    grouped; `reference` is a configuration label (default: the first run's). Probe and confirmation
    runs of a tune are left out unless `stages` names them. clock: a tune.clock.DeviceClock; T is then
    each run's step trace re-costed on its table."""
    notes: list[str] = []
    curves = [c for c in (read_run(d, clock) for d in find_run_dirs(paths)) if c.stage in stages]
    if not curves:
        raise ValueError(f"no runs of stages {list(stages)} among the given directories")
    clocks = sorted({c.clock for c in curves})
    if len(clocks) > 1:
        notes.append(f"the runs timed t_gen / t_train on different clocks ({', '.join(clocks)}): T, q and "
                     f"T/T_ref mix them and mean nothing; N*, r_N and the grad norms are unaffected")
    groups = group_curves(curves)
    reference = reference or curves[0].label
    if reference not in groups:
        raise ValueError(f"reference {reference!r} is not a configuration among {list(groups)}")
    window = min(c.update_n[-1] for c in curves if c.update_n)
    order = {"stage1": 0, "run": 0, "control": 1, "recheck": 2}
    cands = sorted((candidate_stats(cs, target_j, window) for cs in groups.values()),
                   key=lambda c: (order.get(c.stage, 3), c.b_train, c.b_gen))
    for c in cands:
        if not c.all_reached:
            notes.append(f"{c.label} reached J* = {target_j} on {c.reached}/{len(c.hits)} seeds")
    rows = build_rows(cands, reference)
    best = choose_row(rows, reference)
    if clock is not None:
        notes += clock.notes()
    return RunsReport(target_j=target_j, reference=reference, candidates=tuple(cands), curves=tuple(curves),
                      rows=tuple(rows), sweeps=tuple(_run_sweeps(cands, delta)), chosen=best.label if best else "",
                      grad_window=window, notes=tuple(notes), clock=clock.summary() if clock is not None else {})


def _run_sweeps(cands: Sequence, delta: float) -> list[GenSweep]:
    """q against B_gen from whole runs, for each B_train that was run at two or more B_gen values."""
    from rlengine.analysis.fits import critical_generation_batch

    out = []
    by_b: dict[int, list] = {}
    for c in cands:
        if c.lr_rule != "none" or c.stage == "control":
            by_b.setdefault(c.b_train, []).append(c)
    for b, cs in sorted(by_b.items()):
        if len({c.b_gen for c in cs}) < 2:
            continue
        cs = sorted(cs, key=lambda c: c.b_gen)
        pts = tuple(GenPoint(b_gen=c.b_gen, q=sum(c.q_run) / len(c.q_run), q_gen=0.0, lag_mean=0.0, source=c.label)
                    for c in cs)
        crit = int(critical_generation_batch([p.b_gen for p in pts], [p.q for p in pts], delta))
        out.append(GenSweep(b_train=b, label=f"{b}", points=pts, b_kv=0, b_kv_source="not measured",
                            critical_b_gen=crit, plateau=crit < pts[-1].b_gen, stop_reason="the runs given"))
    return out
