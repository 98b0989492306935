"""Report files of `rlengine tune` and `rlengine report`, written into one directory.

    report.md     Table 1 (B_train, eta, K*, N*, T, r_N, q/q_ref, T/T_ref, wins), the B_gen sweeps,
                  the re-check, the confirmation against the best coupled configuration, the grad-norm slope, the notes
    report.json   every dataclass of the result (dataclasses.asdict), the input of rlengine.plots.tune
    chosen.toml   the chosen configuration as a ready-to-run job (`rlengine train --config chosen.toml`)
    runs.jsonl    one line per run directory under OUT/runs: its plan and every metric record
    figures/      J vs N, J vs wall-clock, q vs B_gen (rlengine.plots.tune; skipped, with the reason
                  in report.md, when matplotlib is not installed)
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Sequence

from rlengine.tune.gradnorm import SlopeFit, grad_norm_slope
from rlengine.tune.report_md import (candidates_markdown, clock_name, confirm_markdown, grad_lines, header_markdown,
                                     slopes_markdown, sweeps_markdown, table_markdown)
from rlengine.tune.stage_records import CandidateStats, RunsReport, TableRow, TuneResult

__all__ = ["chosen_toml", "draw_figures", "grad_fits", "table_markdown", "to_toml", "write_report",
           "write_runs_report"]

INVARIANT_TOL = 1.2  # r_N within [1/1.2, 1.2] of the reference counts as sample-matched invariance


def grad_fits(cands: Sequence[CandidateStats], rows: Sequence[TableRow]) -> dict[str, SlopeFit]:
    """Grad-norm slopes over every sqrt-rule candidate and over the invariant range only."""
    r = {row.label: row.r_n for row in rows}
    inside = [c for c in cands if r.get(c.label) is not None and c.all_reached
              and 1 / INVARIANT_TOL <= r[c.label] <= INVARIANT_TOL]
    return {"all": grad_norm_slope(cands), "invariant": grad_norm_slope(inside)}


def to_toml(d: dict) -> str:
    """A config dict of sections of scalars and lists as TOML (what TrainConfig.to_dict gives)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"to_toml: {v} has no TOML form here")
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # e.g. eval.sets: an inline table
            return "{" + ", ".join(f"{json.dumps(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        raise ValueError(f"to_toml: cannot write {type(v).__name__}")

    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        out += [f"{k} = {value(v)}" for k, v in values.items() if v is not None]  # TOML has no null: absent = None
        out.append("")
    text = "\n".join(out)
    tomllib.loads(text)  # what we write must read back
    return text


def chosen_toml(result: TuneResult) -> str:
    """The chosen configuration as a job TOML that reads right: the validated config (b_train = P x G,
    prompts_per_step with it), lr = the LR the configuration actually ran with at its own batch (b0 = 0)."""
    from rlengine.plan.specs import PlanChange
    from rlengine.rl.config import TrainConfig

    job = PlanChange.from_overrides(result.chosen_overrides).apply_to_dict(json.loads(json.dumps(result.spec.job)))
    job["run"]["out_dir"] = "runs/tuned"
    chosen = TrainConfig.from_dict(job)
    cfg, eta = chosen.to_dict(), chosen.train.lr_effective
    cfg["train"].update(lr=eta, b0=0)
    t = cfg["train"]
    head = (f"# rlengine tune: {result.chosen} reaches J* = {result.spec.target_j} soonest of the candidates\n"
            f"# B_train = P x G = {t['prompts_per_step']} x {t['group_size']} = {t['b_train']}; lr = {eta:.6g}, the LR "
            f"it ran with (b0 = 0: lr is used as is at this batch); gen.b_gen = {cfg['gen']['b_gen']}, "
            f"gen.max_lag = {cfg['gen']['max_lag']}\n")
    return head + to_toml(cfg)


def draw_figures(report_json: Path, fig_dir: Path) -> str:
    """Draw the figures with rlengine.plots.tune; returns what happened."""
    from rlengine.plots import require_matplotlib

    try:
        require_matplotlib()
    except ImportError as exc:
        return f"figures not drawn: {exc} (then: python -m rlengine.plots.tune {report_json})"
    from rlengine.plots.tune import draw_all

    paths = draw_all(json.loads(report_json.read_text()), fig_dir)
    return "figures: " + ", ".join(str(p) for p in paths)


def _write_runs_jsonl(out_dir: Path) -> tuple[int, float]:
    """runs.jsonl from OUT/runs; returns (runs, their summed wall seconds: the compute a resume reuses)."""
    runs, count, wall = out_dir / "runs", 0, 0.0
    with open(out_dir / "runs.jsonl", "w") as f:
        for d in sorted(runs.iterdir()) if runs.is_dir() else []:
            if not (d / "tune_run.json").is_file():
                continue
            meta = json.loads((d / "tune_run.json").read_text())
            meta["records"] = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln]
            f.write(json.dumps(meta) + "\n")
            count, wall = count + 1, wall + meta.get("wall_s", 0.0)
    return count, wall


def write_report(result: TuneResult, out_dir: str | Path) -> Path:
    """All report files of a tune; returns the path of report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s1, s2 = result.stage1, result.stage2
    fits = grad_fits(s1.candidates, result.rows)
    payload = dataclasses.asdict(result)
    payload["grad_fits"] = {k: dataclasses.asdict(v) for k, v in fits.items()}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1))
    if result.chosen_overrides:
        (out_dir / "chosen.toml").write_text(chosen_toml(result))
    n_runs, run_wall = _write_runs_jsonl(out_dir)
    figures = draw_figures(out_dir / "report.json", out_dir / "figures")
    md = [f"# rlengine tune: J* = {result.spec.target_j}", "", header_markdown(result), "",
          f"Reference (B0, eta0) = ({s1.b0}, {s1.eta0:.3g}); every curve: N_max = {s1.n_max} responses, evaluated "
          f"each {s1.eval_every} responses; seeds {list(result.spec.seeds)}; T = t_gen + t_train up to N* "
          f"(evaluation excluded); N* where the isotonic fit of J crosses J*; means over the seeds that "
          f"reached J*. {n_runs} runs, {run_wall:.0f} s of wall time in them (this invocation "
          f"{result.wall_s:.0f} s).", "",
          "## Table 1", "", f"Clock (T, q): {clock_name(result)}.", "", table_markdown(result.rows, s1.reference), "",
          f"Chosen: **{result.chosen or 'none'}**" + (" (chosen.toml)" if result.chosen_overrides else ""), "",
          "## Per candidate: where the time goes", "", candidates_markdown(result), "",
          "## Stage 2: q against B_gen", "", sweeps_markdown(s2.sweeps) if s2.sweeps else "(no sweep)", ""]
    stage1_n = {c.label: c for c in s1.candidates if c.stage == "stage1"}
    for rc in s2.rechecks:
        base = stage1_n.get(f"{rc.b_train}")
        n_rc = [h.n_star for h in rc.hits if h.reached]
        n_s1 = [h.n_star for h in base.hits if h.reached] if base else []
        if n_rc and n_s1:
            change = (sum(n_rc) / len(n_rc)) / (sum(n_s1) / len(n_s1)) - 1
            md.append(f"- re-check {rc.label}: N* {sum(n_rc) / len(n_rc):.0f} vs {sum(n_s1) / len(n_s1):.0f} "
                      f"coupled ({change:+.0%}), reached {rc.reached}/{len(rc.hits)}")
    md += ["", "## Confirmation: chosen vs the best coupled configuration on fresh seeds", "", confirm_markdown(result), "",
           "## Gradient norm against B_train", "", grad_lines(s1.candidates, s1.grad_window), "",
           slopes_markdown(fits), "", "## Notes", ""]
    return _write_md(md, result.notes, figures, out_dir)


def write_runs_report(result: RunsReport, out_dir: str | Path) -> Path:
    """report.md / report.json / figures for `rlengine report`; returns the path of report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fits = grad_fits(result.candidates, result.rows)
    payload = dataclasses.asdict(result)
    payload["grad_fits"] = {k: dataclasses.asdict(v) for k, v in fits.items()}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1))
    figures = draw_figures(out_dir / "report.json", out_dir / "figures")
    clocks = ", ".join(sorted({c.clock for c in result.curves}))
    md = [f"# rlengine report: J* = {result.target_j}", "",
          f"Clock (T, q): {result.clock['label'] if result.clock else clocks}" + (
              " (each run's step trace re-costed on that table)" if result.clock else ""), "",
          table_markdown(result.rows, result.reference), "",
          f"Best (max q / r_N among configurations that reached J* on every seed): **{result.chosen or 'none'}**", "",
          sweeps_markdown(result.sweeps) if result.sweeps else "", "",
          grad_lines(result.candidates, result.grad_window), "",
          slopes_markdown(fits), "", "## Notes", ""]
    return _write_md(md, result.notes, figures, out_dir)


def _write_md(md: list[str], notes: list[str], figures: str, out_dir: Path) -> Path:
    """The notes and figure links that end every report, then out_dir/report.md."""
    md += [f"- {n}" for n in notes] or ["- none"]
    md += ["", figures, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return path
