"""Report files of `rlengine tune` and `rlengine report`, written into one directory.

    report.md     Table 1 (B_train, eta, K*, N*, T, r_N, q/q_ref, T/T_ref, wins), the B_gen sweeps,
                  the re-check, the confirmation against the job, the grad-norm slope, the notes
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
from rlengine.tune.types import CandidateStats, GenSweep, RunsReport, TableRow, TuneResult

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


def _f(v, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v)


def table_markdown(rows: Sequence[TableRow], reference: str) -> str:
    head = ("| config | B_train | B_gen | eta | reached | K* | N* (sd) | T s (sd) | r_N [seed range] | q/q_ref "
            "| T/T_ref [seed range] | wins | eligible |\n|" + "---|" * 13)
    lines = [head]
    for r in rows:
        rng = f" [{r.r_n_range[0]:.2f}, {r.r_n_range[1]:.2f}]" if r.r_n_range else ""
        if r.r_n_lower is not None:
            rng += f"; >= {r.r_n_lower:.2f} all seeds"
        t_rng = f" [{r.t_norm_range[0]:.2f}, {r.t_norm_range[1]:.2f}]" if r.t_norm_range else ""
        lines.append(
            f"| {r.label}{' (ref)' if r.label == reference else ''} | {r.b_train} | {r.b_gen} | {r.lr:.3g} | "
            f"{r.reached} | {_f(r.k_star, '{:.1f}')} | {_f(r.n_star, '{:.0f}')} ({_f(r.n_star_sd, '{:.0f}')}) | "
            f"{_f(r.t, '{:.2f}')} ({_f(r.t_sd, '{:.2f}')}) | {_f(r.r_n, '{:.2f}')}{rng} | "
            f"{_f(r.q_ratio, '{:.2f}')} | {_f(r.t_norm, '{:.2f}')}{t_rng} | {'-' if r.wins is None else r.wins} | "
            f"{'yes' if r.eligible else 'no'} |")
    return "\n".join(lines)


def sweeps_markdown(sweeps: Sequence[GenSweep]) -> str:
    lines = ["| B_train | B_gen | q (resp/s) | q_gen | mean lag | from |\n|---|---|---|---|---|---|"]
    for sw in sweeps:
        for p in sw.points:
            star = " (critical)" if p.b_gen == sw.critical_b_gen else ""
            lines.append(f"| {sw.b_train} | {p.b_gen}{star} | {p.q:.0f} | {p.q_gen:.0f} | {p.lag_mean:.2f} | "
                         f"{p.source} |")
    lines.append("")
    for sw in sweeps:
        lines.append(f"- B_train {sw.b_train}: critical B_gen {sw.critical_b_gen}; stopped: {sw.stop_reason}; "
                     f"B_KV = {sw.b_kv or 'unknown'} ({sw.b_kv_source})")
    return "\n".join(lines)


def slopes_markdown(fits: dict[str, SlopeFit]) -> str:
    lines = []
    for name, f in fits.items():
        if f.slope_of_means is None:
            lines.append(f"- {name}: fewer than 2 batch sizes, no slope")
            continue
        per_seed = ", ".join(f"{s:.3f}" for s in f.slopes)
        lines.append(f"- {name} (B_train {list(f.batches)}): slope of seed means {f.slope_of_means:.3f}; per seed "
                     f"[{per_seed}], mean {_f(f.slope_mean, '{:.3f}')} sd {_f(f.slope_sd, '{:.3f}')} "
                     f"(B^-1/2 gives -0.5); ratio per doubling between neighbours "
                     f"[{', '.join(f'{r:.3f}' for r in f.ratios)}] (B^-1/2: 0.707)")
    return "\n".join(lines)


def _grad_lines(cands: Sequence[CandidateStats], window: float) -> str:
    lines = [f"Mean actor grad norm (before clipping) over the updates with N <= {window:.0f}:", "",
             "| config | per seed | mean |\n|---|---|---|"]
    for c in cands:
        lines.append(f"| {c.label} | {', '.join(f'{g:.3f}' for g in c.grad_norm)} | "
                     f"{sum(c.grad_norm) / len(c.grad_norm):.3f} |")
    return "\n".join(lines)


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
        job = json.loads(json.dumps(result.spec.job))
        for key, v in result.chosen_overrides:
            section, name = key.split(".", 1)
            job[section][name] = v
        job["run"]["out_dir"] = "runs/tuned"
        (out_dir / "chosen.toml").write_text(f"# rlengine tune: {result.chosen} reaches J* = {result.spec.target_j} "
                                             f"soonest of the candidates\n" + to_toml(job))
    n_runs, run_wall = _write_runs_jsonl(out_dir)
    figures = draw_figures(out_dir / "report.json", out_dir / "figures")
    md = [f"# rlengine tune: J* = {result.spec.target_j}", "",
          f"Reference (B0, eta0) = ({s1.b0}, {s1.eta0:.3g}); every curve: N_max = {s1.n_max} responses, evaluated "
          f"each {s1.eval_every} responses; seeds {list(result.spec.seeds)}; T = t_gen + t_train up to N* "
          f"(evaluation excluded), measured in {_clock(result)} seconds; means over the seeds that reached J*. "
          f"{n_runs} runs, {run_wall:.0f} s of wall time in them (this invocation {result.wall_s:.0f} s).", "",
          "## Table 1", "", table_markdown(result.rows, s1.reference), "",
          f"Chosen: **{result.chosen or 'none'}**" + (" (chosen.toml)" if result.chosen_overrides else ""), "",
          "## Stage 2: q against B_gen", "", sweeps_markdown(s2.sweeps) if s2.sweeps else "(no sweep)", ""]
    stage1_n = {c.label.split(" ")[0]: c for c in s1.candidates if c.stage == "stage1"}
    for rc in s2.rechecks:
        base = stage1_n.get(f"{rc.b_train}")
        n_rc = [h.n_star for h in rc.hits if h.reached]
        n_s1 = [h.n_star for h in base.hits if h.reached] if base else []
        if n_rc and n_s1:
            change = (sum(n_rc) / len(n_rc)) / (sum(n_s1) / len(n_s1)) - 1
            md.append(f"- re-check {rc.label}: N* {sum(n_rc) / len(n_rc):.0f} vs {sum(n_s1) / len(n_s1):.0f} "
                      f"coupled ({change:+.0%}), reached {rc.reached}/{len(rc.hits)}")
    md += ["", "## Confirmation: chosen vs the job on fresh seeds", "", _confirm_md(result), "",
           "## Gradient norm against B_train", "", _grad_lines(s1.candidates, s1.grad_window), "",
           slopes_markdown(fits), "", "## Notes", ""]
    return _write_md(md, result.notes, figures, out_dir)


def _clock(result: TuneResult) -> str:
    clocks = sorted({c.clock for c in result.stage1.curves})
    return " + ".join(clocks) + (" (process CPU time)" if clocks == ["cpu"] else "")


def _confirm_md(result: TuneResult) -> str:
    c = result.confirmation
    if c is None:
        return "not run (" + ("the chosen configuration is the job's own" if result.chosen else "nothing chosen") \
            + " or --confirm-seeds 0)"
    lines = ["| seed | T chosen (s) | T job (s) | ratio |\n|---|---|---|---|"]
    for s, a, b in zip(c.seeds, c.t_chosen, c.t_default):
        ratio = f"{a / b:.2f}" if a is not None and b is not None else "-"
        lines.append(f"| {s} | {_f(a, '{:.2f}')} | {_f(b, '{:.2f}')} | {ratio} |")
    if c.ratio:
        m = sum(c.ratio) / len(c.ratio)
        sd = math.sqrt(sum((x - m) ** 2 for x in c.ratio) / (len(c.ratio) - 1)) if len(c.ratio) > 1 else None
        lines.append(f"\nT_chosen / T_job per seed: mean {m:.2f}, sd {_f(sd, '{:.2f}')}, range "
                     f"[{min(c.ratio):.2f}, {max(c.ratio):.2f}]; ratio of mean times {_f(c.ratio_of_means, '{:.2f}')}")
    return "\n".join(lines)


def write_runs_report(result: RunsReport, out_dir: str | Path) -> Path:
    """report.md / report.json / figures for `rlengine report`; returns the path of report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fits = grad_fits(result.candidates, result.rows)
    payload = dataclasses.asdict(result)
    payload["grad_fits"] = {k: dataclasses.asdict(v) for k, v in fits.items()}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1))
    figures = draw_figures(out_dir / "report.json", out_dir / "figures")
    md = [f"# rlengine report: J* = {result.target_j}", "", table_markdown(result.rows, result.reference), "",
          f"Best (max q / r_N among configurations that reached J* on every seed): **{result.chosen or 'none'}**", "",
          sweeps_markdown(result.sweeps) if result.sweeps else "", "", _grad_lines(result.candidates,
                                                                                   result.grad_window), "",
          slopes_markdown(fits), "", "## Notes", ""]
    return _write_md(md, result.notes, figures, out_dir)


def _write_md(md: list[str], notes: list[str], figures: str, out_dir: Path) -> Path:
    """The notes and figure links that end every report, then out_dir/report.md."""
    md += [f"- {n}" for n in notes] or ["- none"]
    md += ["", figures, ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return path
