"""Figures of an `rlengine tune` / `rlengine report` result (matplotlib, Agg backend).

  python -m rlengine.plots.tune OUT/report.json [-o OUT/figures]   (or tools/tune_plots.py)
      tune_j_vs_n.png      J against N (retained responses): one panel per seed with every
                           configuration overlaid, J* dotted, each run's N* marked
      tune_j_vs_time.png   the same curves against the run's own clock (t_gen + t_train), labelled
                           CPU-clock or wall-clock as the runs measured it
      tune_q_vs_bgen.png   q against B_gen per B_train (mean of the repeated probes, bars: their
                           min..max; y from 0): the (1 - delta) q_max threshold, the critical
                           B_gen (star) and B_KV (vertical line) when known
rlengine.tune.report calls draw_all() itself after writing report.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _curves(report: dict) -> list[dict]:
    if "stage1" in report:  # a tune
        return (report["stage1"]["curves"] + report["stage2"]["recheck_curves"] + report.get("confirm_curves", []))
    return report["curves"]


def _target(report: dict) -> float:
    return report["spec"]["target_j"] if "spec" in report else report["target_j"]


def _save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _first_crossing(xs, js, target):
    """N* as the report computes it: on the isotonic fit of J."""
    from rlengine.analysis.isotonic import monotone_crossing

    return monotone_crossing(xs, js, target) if xs else None


def clock_label(report: dict) -> str:
    """"CPU-clock" / "wall-clock" (or both) from what the runs' t_gen / t_train measured."""
    clocks = sorted({c.get("clock", "wall") for c in _curves(report)})
    return " + ".join({"cpu": "CPU-clock", "wall": "wall-clock"}.get(c, c) for c in clocks) or "wall-clock"


def plot_j(report: dict, out: Path, *, x_key: str, x_label: str, title: str) -> Path:
    """J of every run against eval_n or eval_t: one panel per seed (the batch sizes overlaid there),
    one colour per configuration label, J* dotted, each run's N* marked."""
    curves = [c for c in _curves(report) if c["stage"] != "probe"]
    target = _target(report)
    keys = list(dict.fromkeys(_key(c) for c in curves))
    colour = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(keys)}
    seeds = sorted({c["seed"] for c in curves})
    cols = min(3, len(seeds))
    rows = -(-len(seeds) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False, sharey=True)
    for ax, seed in zip(axes.flat, seeds):
        for c in (cc for cc in curves if cc["seed"] == seed):
            k = _key(c)
            ax.plot(c[x_key], c["eval_j"], color=colour[k], lw=1.3, label=k,
                    ls="--" if c["stage"] in ("control", "confirm") else "-")
            hit = _first_crossing(c["eval_n"], c["eval_j"], target)
            if hit is not None:
                x_hit = hit if x_key == "eval_n" else _interp(c["eval_n"], c["eval_t"], hit)
                ax.plot([x_hit], [target], "o", color=colour[k], ms=4)
        ax.axhline(target, color="k", lw=0.8, ls=":")
        ax.set(title=f"seed {seed}", xlabel=x_label)
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(seeds):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("J (held-out)")
    fig.suptitle(f"{title}\nJ* = {target} dotted, N* (isotonic fit) marked", fontsize=10)
    return _save(fig, out)


def _key(c: dict) -> str:
    return c["label"] if c["stage"] in ("stage1", "run") else f"{c['label']} ({c['stage']})"


def _interp(xs, ys, x0):
    for i in range(1, len(xs)):
        if x0 <= xs[i]:
            if xs[i] == xs[i - 1]:
                return ys[i - 1]
            return ys[i - 1] + (x0 - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])
    return ys[-1]


def plot_q_vs_bgen(report: dict, out: Path) -> Path | None:
    """q against B_gen (log2 x) per B_train sweep; None when there is no sweep with points."""
    sweeps = report["stage2"]["sweeps"] if "stage2" in report else report.get("sweeps", [])
    sweeps = [s for s in sweeps if s["points"]]
    if not sweeps:
        return None
    delta = report["spec"]["plateau_delta"] if "spec" in report else 0.1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    b_kv = max(s["b_kv"] for s in sweeps)
    for i, sw in enumerate(sweeps):
        colour = plt.get_cmap("tab10")(i)
        pts = sw["points"]
        b, q = [p["b_gen"] for p in pts], [p["q"] for p in pts]
        reps = [p.get("q_reps") or [p["q"]] for p in pts]
        err = [[v - min(r) for v, r in zip(q, reps)], [max(r) - v for v, r in zip(q, reps)]]
        reason = sw["stop_reason"].split(":")[0]
        ax.errorbar(b, q, yerr=err, fmt="o-", color=colour, capsize=3,
                    label=f"B_train {sw['b_train']} ({reason}; {sw.get('verdict') or '-'})")
        ax.axhline((1 - delta) * max(q), color=colour, lw=0.7, ls="--")
        crit = next(p for p in pts if p["b_gen"] == sw["critical_b_gen"]) if sw["critical_b_gen"] in b else None
        if crit:
            ax.plot([crit["b_gen"]], [crit["q"]], "*", color=colour, ms=14)
    top = max(p["b_gen"] for sw in sweeps for p in sw["points"])
    if b_kv and b_kv <= 4 * top:
        ax.axvline(b_kv, color="r", lw=1.0, label=f"B_KV = {b_kv}")
    elif b_kv:  # far right of every point: named, not drawn, so the points keep the axis
        ax.plot([], [], " ", label=f"B_KV = {b_kv} (off the axis)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylim(bottom=0)
    ax.set(xlabel="B_gen (responses in flight)", ylabel=f"q = responses / {clock_label(report)} s",
           title=f"end-to-end throughput (bars: repeat min..max)\ndashed: (1 - {delta}) q_max, star: critical B_gen")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, out)


def draw_all(report: dict, fig_dir: str | Path) -> list[Path]:
    """The three figures into fig_dir (the q figure only when there is a sweep)."""
    fig_dir = Path(fig_dir)
    clock = clock_label(report)
    paths = [plot_j(report, fig_dir / "tune_j_vs_n.png", x_key="eval_n", x_label="N (retained responses)",
                    title="J against samples (sample-matched curves)"),
             plot_j(report, fig_dir / "tune_j_vs_time.png", x_key="eval_t",
                    x_label=f"{clock} t_gen + t_train (s)", title=f"J against {clock} time")]
    q = plot_q_vs_bgen(report, fig_dir / "tune_q_vs_bgen.png")
    return paths + ([q] if q else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", help="report.json written by rlengine tune / rlengine report")
    p.add_argument("-o", "--out", default=None, help="figure directory (default: figures/ next to the report)")
    args = p.parse_args(argv)
    src = Path(args.report)
    for path in draw_all(json.loads(src.read_text()), args.out or src.parent / "figures"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
