"""The markdown pieces of report.md (rlengine.tune.report writes the files): header, Table 1 with 95%
intervals, per-candidate generation diagnostics, the B_gen sweeps, the confirmation, the grad-norm slope.

Every interval is stats.Interval as a dict: the geometric-mean ratio over paired seeds and its
95% t-interval on the log ratios; "resolvable" is the smallest effect that interval can tell from none.
"""

from __future__ import annotations

import math
from typing import Sequence

from rlengine.tune.gradnorm import SlopeFit
from rlengine.tune.stage_records import CandidateStats, GenSweep, TableRow, TuneResult


def _f(v, fmt="{:.3g}") -> str:
    return "-" if v is None else fmt.format(v)


def ci_text(ci: dict | None) -> str:
    """"1.05 [0.92, 1.20]" (geometric mean [95% interval]); "-" without pairs; one seed: no interval."""
    if not ci:
        return "-"
    if ci["lo"] is None:
        return f"{ci['ratio']:.2f} (1 seed)"
    return f"{ci['ratio']:.2f} [{ci['lo']:.2f}, {ci['hi']:.2f}]"


def clock_name(result: TuneResult) -> str:
    """The clock T was measured on, as every table and verdict names it: wall, cpu or a device clock."""
    return "+".join(result.header.get("clock", [])) or "?"


def header_markdown(result: TuneResult) -> str:
    h = result.header
    clock = "+".join(h.get("clock", [])) or "?"
    what = ("process CPU seconds (CPU-clock: other processes' load stays out of T)" if clock == "cpu"
            else "wall-clock seconds" if clock == "wall"
            else f"device clock, {clock} (each run's step trace re-costed on that table; the runs' own times "
                 "are kept in their metrics.jsonl)")
    load = (f"{h['load_min']:.2f} to {h['load_max']:.2f}" if h.get("load_min") is not None else "unknown")
    busy = _f(h.get("cpu_per_wall"), "{:.2f}")
    flags = " ".join(h.get("cpu_isa") or []) or "flags unknown"
    side = (f"; {h['workers']} runs side by side, one process each" if h.get("workers", 1) > 1
            else "; one run at a time")
    return (f"Conditions: torch threads {h.get('threads', '?')} (fixed for every run){side}; clock: {what}; "
            f"1-minute load average over the runs {load} on {h.get('cores', '?')} cores "
            f"(CPU s / wall s per run {busy}); host {h.get('host', '?')} ({flags}); {h.get('time', '')}.")


def table_markdown(rows: Sequence[TableRow], reference: str) -> str:
    head = ("| config | B_train | B_gen | eta | reached | K* | N* (sd) | T s (sd) | r_N | r_N 95% | q/q_ref 95% "
            "| T/T_ref 95% | wins | eligible |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        rn = _f(r.r_n, "{:.2f}")
        if r.r_n_lower is not None:
            rn += f"; >= {r.r_n_lower:.2f} with misses censored"
        lines.append(
            f"| {r.label}{' (ref)' if r.label == reference else ''} | {r.b_train} | {r.b_gen} | {r.lr:.3g} | "
            f"{r.reached} | {_f(r.k_star, '{:.1f}')} | {_f(r.n_star, '{:.0f}')} ({_f(r.n_star_sd, '{:.0f}')}) | "
            f"{_f(r.t, '{:.2f}')} ({_f(r.t_sd, '{:.2f}')}) | {rn} | {ci_text(r.r_n_ci)} | {ci_text(r.q_ci)} | "
            f"{ci_text(r.t_ci)} | {'-' if r.wins is None else r.wins} | "
            f"{'yes' if r.eligible else 'no: ' + r.why} |")
    lines.append("\nr_N: ratio of mean N* over the seeds both reached (the paper's); the 95% columns: geometric "
                 "mean of the per-seed ratios [t-interval on their logs]. A seed that missed J* is censored "
                 "(N* > N_max): counted in `reached`, never paired.")
    return "\n".join(lines)


def candidates_markdown(result: TuneResult) -> str:
    """Per candidate: what its generation costs and why it was pruned, lost or chosen."""
    rows = {r.label: r for r in result.rows}
    chosen = rows.get(result.chosen)
    score = {lab: 1 / r.t_norm for lab, r in rows.items() if r.t_norm}
    lines = ["| config | gen share | q | free-gen ceiling q | mean resp len | decode steps / rollout | mean B_act "
             "| stale aborted / dropped | LR | outcome |\n|" + "---|" * 10]
    sweeps = {sw.label: sw for sw in result.stage2.sweeps}
    for c in (c for c in result.stage1.candidates if c.stage == "stage1"):
        sw = sweeps.get(c.label)
        p = sw.points[0] if sw and sw.points else None
        row = rows.get(c.label)
        lines.append(f"| {c.label} | {_f(p and p.gen_share, '{:.0%}')} | {_f(p and p.q, '{:.0f}')} | "
                     f"{_f(p and p.q_free, '{:.0f}')} | {_f(p and p.resp_len, '{:.1f}')} | "
                     f"{_f(p and p.decode_steps, '{:.1f}')} | {_f(p and p.b_act, '{:.1f}')} | "
                     f"{(f'{p.stale_aborted} / {p.stale_dropped}') if p else '-'} | "
                     f"{c.lr:.3g}{' (' + c.retuned + ')' if c.retuned else ''} | "
                     f"{_outcome(c, row, sw, chosen, score)} |")
    lines.append("\nFrom the coupled probe window (B_gen = B_train) of the first seed; free-gen ceiling = "
                 "responses / t_train, the q this B_train reaches if generation cost nothing.")
    return "\n".join(lines)


def _outcome(c: CandidateStats, row: TableRow | None, sw: GenSweep | None, chosen: TableRow | None,
             score: dict) -> str:
    if row is None:
        return "-"
    if chosen is not None and row.label == chosen.label:
        return "chosen"
    if not row.eligible:
        return row.why
    if sw is not None and sw.stop_reason.startswith("pruned"):
        return sw.stop_reason
    if chosen is not None and row.t_norm and chosen.t_norm:
        return f"lost: T/T_ref {row.t_norm:.2f} vs {chosen.t_norm:.2f} chosen"
    return "lost"


def sweeps_markdown(sweeps: Sequence[GenSweep]) -> str:
    lines = ["| B_train | B_gen | q (resp/s) | probes | spread | q_gen | gen share | B_act | resp len | max_lag "
             "| mean lag | stale ab/dr |\n|" + "---|" * 12]
    for sw in sweeps:
        for p in sw.points:
            star = " (critical)" if p.b_gen == sw.critical_b_gen else ""
            reps = ", ".join(f"{q:.0f}" for q in p.q_reps) or f"{p.q:.0f}"
            lines.append(f"| {sw.b_train} | {p.b_gen}{star} | {p.q:.0f} | {reps} | {p.spread:.0%} | {p.q_gen:.0f} | "
                         f"{p.gen_share:.0%} | {p.b_act:.1f} | {p.resp_len:.1f} | {p.max_lag} | {p.lag_mean:.2f} | "
                         f"{p.stale_aborted}/{p.stale_dropped} |")
    lines.append("")
    for sw in sweeps:
        gain = ""
        if sw.points and sw.critical_b_gen != sw.b_train:
            crit = next(p for p in sw.points if p.b_gen == sw.critical_b_gen)
            gain = f", gain {crit.q / sw.points[0].q - 1:+.0%} over coupled"
        lines.append(f"- B_train {sw.b_train}: critical B_gen {sw.critical_b_gen}{gain} ({sw.verdict or 'n/a'}); "
                     f"stopped: {sw.stop_reason}; B_KV = {sw.b_kv or 'unknown'} ({sw.b_kv_source})")
    return "\n".join(lines)


def confirm_markdown(result: TuneResult) -> str:
    c = result.confirmation
    if c is None:
        return "not run (" + ("the chosen configuration is its own baseline" if result.chosen else "nothing chosen") \
            + " or --confirm-seeds 0)"
    lines = [f"Baseline: {c.default}.", "", f"| seed | T chosen (s) | T {c.default} (s) | ratio |\n|---|---|---|---|"]
    for s, a, b in zip(c.seeds, c.t_chosen, c.t_default):
        ratio = f"{a / b:.2f}" if a is not None and b is not None else "-"
        lines.append(f"| {s} | {_f(a, '{:.2f}')} | {_f(b, '{:.2f}')} | {ratio} |")
    ci = c.interval
    method = c.method or "95% t-interval on log ratios"
    if c.stop_reason:
        lines.append(f"\nPairs added one at a time; stopped: {c.stop_reason}. Interval: {method}.")
    if ci:
        lines.append(f"\nT_chosen / T_baseline: {ci_text(ci)} (geometric mean over {ci['k']} paired seeds, "
                     f"{ci.get('method', 't-interval')}); ratio of mean times {_f(c.ratio_of_means, '{:.2f}')}; "
                     f"clock: {clock_name(result)}.")
        if ci["resolvable"] is not None:
            lines.append(f"Smallest effect this confirmation can resolve: {ci['resolvable']:.0%} (the interval's "
                         f"half-width; a true effect smaller than that is indistinguishable from none here).")
            verdict = ("faster" if ci["hi"] < 1 else "slower" if ci["lo"] > 1 else "no resolvable difference")
            lines.append(f"Verdict: {verdict}.")
    known = [(s, f) for s, f in zip(c.seeds, c.faster) if f is not None]
    if known:
        won = [s for s, f in known if f]
        lines.append(f"\nOrder per seed, the seeds where one run missed J* included when the other reached it "
                     f"before the missed run stopped: the chosen configuration was faster on {len(won)} of "
                     f"{len(known)} seeds ({', '.join(map(str, won)) or 'none'}); two-sided sign test p = "
                     f"{c.sign_p:.3f}. The interval above pairs only the seeds where both reached J*.")
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


def grad_lines(cands: Sequence[CandidateStats], window: float) -> str:
    lines = [f"Mean actor grad norm (before clipping) over the updates with N <= {window:.0f}:", "",
             "| config | per seed | mean |\n|---|---|---|"]
    for c in cands:
        if not c.grad_norm or any(math.isnan(g) for g in c.grad_norm):
            continue
        lines.append(f"| {c.label} | {', '.join(f'{g:.3f}' for g in c.grad_norm)} | "
                     f"{sum(c.grad_norm) / len(c.grad_norm):.3f} |")
    return "\n".join(lines)
