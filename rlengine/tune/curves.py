"""Learning curves on the N axis: metric records -> RunCurve -> TargetHit -> CandidateStats.

A run's records are the lines of its metrics.jsonl (or Trainer.history): one per update, with N,
t_gen, t_train, actor_grad_norm, policy_lag_mean, and J where it was evaluated (always at N = 0).
T is the run's own clock (or a device clock, tune/clock.py: its step trace re-costed on a device's
table): cumulative t_gen + t_train, evaluation excluded (every configuration is
evaluated on the same N grid, so leaving it out favours none). N* is the first crossing of J*
with J linearly interpolated between evaluations, T at N* interpolated on the same clock.
Seeds of one configuration are summarised by their mean and spread; a seed that never reached
J* is counted (k/K reached), never dropped silently.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from rlengine.analysis.accounting import value_at
from rlengine.rl.algo.schedule import lr_by_rule
from rlengine.tune.stats import monotone_crossing
from rlengine.tune.stage_records import CandidateStats, EngineFacts, RunCurve, TargetHit


def lr_effective(train: dict) -> float:
    """eta of a saved [train] section: the LR rule (schedule.lr_by_rule, as TrainSection.lr_effective)."""
    return lr_by_rule(train["lr"], train["b_train"], train.get("b0") or 0, train.get("lr_rule", "sqrt"))


def curve_from_records(records: Sequence[dict], config: dict, *, name: str, label: str = "", stage: str = "run",
                       stopped_at_target: bool = False, wall_s: float = 0.0, cpu_s: float = 0.0,
                       load: tuple[float, ...] = (), engine: EngineFacts | None = None,
                       clock: str = "wall", threads: int = 0) -> RunCurve:
    """A RunCurve from metric records (update 0 first) and the run's config dict."""
    if not records or records[0].get("update") != 0 or records[0].get("J") is None:
        raise ValueError(f"run {name}: the records must start with the update-0 evaluation")
    train, gen = config["train"], config["gen"]
    b_train = int(train["b_train"])
    eval_n, eval_j, eval_t = [], [], []
    update_n, update_t, t_gen, grad, lag = [], [], [], [], []
    b_act, tokens, resp_len, stale = [], [], [], []
    elapsed = 0.0
    for r in records:
        if r["update"] > 0:
            if r.get("critic_only"):
                continue  # PPO critic warm-up: not counted in N, and its time is not on the curve's clock
            elapsed += r["t_gen"] + r["t_train"]
            update_n.append(float(r["N"]))
            update_t.append(elapsed)
            t_gen.append(float(r["t_gen"]))
            grad.append(float(r.get("actor_grad_norm") or 0.0))
            lag.append(float(r.get("policy_lag_mean") or 0.0))
            b_act.append(float(r.get("b_act_mean") or 0.0))
            tokens.append(float(r.get("gen_tokens") or 0.0))
            resp_len.append(float(r.get("response_length/mean") or 0.0))
            stale.append((int(r.get("stale_aborted") or 0), int(r.get("stale_dropped") or 0)))
        if r.get("J") is not None:
            eval_n.append(float(r["N"]))
            eval_j.append(float(r["J"]))
            eval_t.append(elapsed)
    return RunCurve(name=name, label=label or config_label(config), stage=stage, seed=int(config["run"]["seed"]),
                    b_train=b_train, b_gen=int(gen.get("b_gen") or b_train), lr=lr_effective(train),
                    lr_rule=train.get("lr_rule", "sqrt"), eval_n=tuple(eval_n), eval_j=tuple(eval_j),
                    eval_t=tuple(eval_t), update_n=tuple(update_n), update_t=tuple(update_t),
                    update_t_gen=tuple(t_gen), grad_norm=tuple(grad), policy_lag=tuple(lag),
                    stopped_at_target=stopped_at_target, wall_s=wall_s, cpu_s=cpu_s, load=tuple(load),
                    engine=engine, clock=clock, threads=threads, max_lag=int(gen.get("max_lag", 1)),
                    update_b_act=tuple(b_act), update_gen_tokens=tuple(tokens), update_resp_len=tuple(resp_len),
                    update_stale=tuple(stale))


def read_run(run_dir: str | Path, clock=None) -> RunCurve:
    """A RunCurve from a run directory (config.json + metrics.jsonl; tune_run.json when tune wrote it).
    clock: a tune.clock.DeviceClock; T is then the run's trace.jsonl re-costed on its table."""
    run_dir = Path(run_dir)
    cfg_path, metrics = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics.is_file():
        raise ValueError(f"{run_dir}: not a run directory (needs config.json and metrics.jsonl)")
    config = json.loads(cfg_path.read_text())
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    meta = json.loads((run_dir / "tune_run.json").read_text()) if (run_dir / "tune_run.json").is_file() else {}
    if clock is not None:
        from rlengine.rl.trainer.trace_file import read_trace

        records = clock.recost(records, read_trace(run_dir), run=str(run_dir))
        clock.check_model(str(config["model"]["name"]), str(config["model"]["dtype"]))
        meta = {**meta, "clock": clock.label}
    return curve_from_records(records, config, name=meta.get("name", run_dir.name), label=meta.get("label", ""),
                              stage=meta.get("stage", "run"), stopped_at_target=meta.get("stopped_at_target", False),
                              wall_s=meta.get("wall_s", 0.0), cpu_s=meta.get("cpu_s", 0.0),
                              load=tuple(meta.get("load", ())),
                              engine=EngineFacts(**meta["engine"]) if meta.get("engine") else None,
                              clock=meta.get("clock", "wall"), threads=meta.get("threads", 0))


def config_label(config: dict) -> str:
    """"128", "128 gen 512" (async B_gen), "512 fixed" (lr_rule none away from B0)."""
    train, gen = config["train"], config["gen"]
    b, b_gen = int(train["b_train"]), int(gen.get("b_gen") or train["b_train"])
    label = f"{b}"
    if train.get("lr_rule") == "none" and train.get("b0") not in (0, b):
        label += " fixed"
    if b_gen != b:
        label += f" gen {b_gen}"
    return label


def target_hit(curve: RunCurve, target_j: float) -> TargetHit:
    """N*, T and K* of one run from the isotonic fit of its J (TargetHit(reached=False): censored)."""
    n_star = monotone_crossing(curve.eval_n, curve.eval_j, target_j)
    if n_star is None:
        return TargetHit(reached=False, n_star=None, t_star=None, k_star=None)
    t_star = value_at(curve.eval_n, curve.eval_t, n_star)
    return TargetHit(reached=True, n_star=n_star, t_star=t_star, k_star=n_star / curve.b_train)


def window_mean(values: Sequence[float], n: Sequence[float], n_window: float) -> float:
    """Mean of per-update values over the updates with N <= n_window (at least the first update)."""
    inside = [v for v, x in zip(values, n) if x <= n_window] or list(values[:1])
    if not inside:
        raise ValueError("window_mean: the run has no updates")
    return sum(inside) / len(inside)


def candidate_stats(curves: Sequence[RunCurve], target_j: float, grad_window: float) -> CandidateStats:
    """Summary of one configuration's seeds (all curves must share its label)."""
    if not curves:
        raise ValueError("candidate_stats: no curves")
    labels = {c.label for c in curves}
    if len(labels) != 1:
        raise ValueError(f"candidate_stats: curves of several configurations {sorted(labels)}")
    c0 = curves[0]
    curves = sorted(curves, key=lambda c: c.seed)
    return CandidateStats(
        label=c0.label, stage=c0.stage, b_train=c0.b_train, b_gen=c0.b_gen, lr=c0.lr, lr_rule=c0.lr_rule,
        seeds=tuple(c.seed for c in curves), hits=tuple(target_hit(c, target_j) for c in curves),
        n_budget=max(c.update_n[-1] if c.update_n else 0.0 for c in curves),
        n_ran=tuple(c.update_n[-1] if c.update_n else 0.0 for c in curves),
        grad_norm=tuple(window_mean(c.grad_norm, c.update_n, grad_window) for c in curves),
        q_run=tuple(c.update_n[-1] / c.update_t[-1] if c.update_t and c.update_t[-1] > 0 else 0.0 for c in curves))


def group_curves(curves: Sequence[RunCurve]) -> dict[str, list[RunCurve]]:
    """Curves by configuration label, in first-seen order."""
    groups: dict[str, list[RunCurve]] = {}
    for c in curves:
        groups.setdefault(c.label, []).append(c)
    return groups


def mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (sd None with one value; both None with none)."""
    v = [float(x) for x in values]
    if not v:
        return None, None
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
