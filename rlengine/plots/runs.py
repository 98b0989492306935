"""Figures of training runs from their metrics.jsonl: `rlengine plot RUN_DIR... [-o DIR]`.

Two PNGs, metrics_vs_N.png and metrics_vs_time.png, each a grid of panels (J, reward, response length,
KL, grad norm) with every run overlaid in its own colour and labelled by its name (run.name from the
run's config.json, else the directory's name). N is the retained-response count; time is the run's own
clock, the running sum of t_gen + t_train (evaluation and checkpoints excluded, as in the accounting of
docs/METHOD.md). Each metric is read from the record's top-level key (J, reward_mean, ...) and, when
that is absent, from the verl-style key (critic/score/mean, response_length/mean, actor/grad_norm, ...),
so runs written either way plot alike. A run still being written may end in a partial line: it is skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (title, y label, [(series label, keys tried in order)]): one panel each
PANELS = [
    ("J: held-out accuracy", "J (mean@k)", [("J", ("J", "eval_mean"))]),
    ("reward", "mean reward per response", [("reward", ("reward_mean", "critic/score/mean", "critic/rewards/mean"))]),
    ("response length", "tokens per response", [("length", ("response_len_mean", "response_length/mean"))]),
    ("KL", "KL (nats per token)", [("to reference (k3)", ("kl_ref", "actor/kl_loss")),
                                   ("behaviour to current (approx)", ("approx_kl", "actor/ppo_kl"))]),
    ("actor grad norm", "global grad norm (before clipping)", [("grad norm", ("actor_grad_norm", "actor/grad_norm",
                                                                              "grad_norm"))]),
]
X_AXES = {"N": ("N (retained responses)", "metrics_vs_N.png"),
          "time": ("time in rollouts + updates, t_gen + t_train (s)", "metrics_vs_time.png")}
T_GEN, T_TRAIN = ("t_gen", "timing_s/gen"), ("t_train", "timing_s/update_actor")


def _first(rec: dict, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = rec.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


@dataclass(slots=True)
class RunSeries:
    """One run's records as columns: x values per axis and the records they belong to."""

    name: str
    records: list[dict]
    x: dict[str, list[float]] = field(default_factory=dict)  # axis -> one value per record

    def points(self, axis: str, keys: tuple[str, ...]) -> tuple[list[float], list[float]]:
        pts = [(x, y) for x, rec in zip(self.x[axis], self.records) if (y := _first(rec, keys)) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]


def read_run(run_dir: str | Path) -> RunSeries:
    """The run's metric records and x axes; ValueError naming the file when there is nothing to plot."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl there (is it a run directory of `rlengine train`?)")
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines):  # the line a running job is writing
                break
            raise ValueError(f"{path}:{i}: not a JSON record ({exc.msg})") from None
    records = [r for r in records if isinstance(r, dict) and _first(r, ("N",)) is not None]
    for rec in records:  # no J key: the first eval set's mean@k stands in for it
        means = [k for k in rec if k.startswith("eval/") and "/mean@" in k]
        if "J" not in rec and means:
            rec["eval_mean"] = rec[means[0]]
    if not records:
        raise ValueError(f"{path}: no records with N (retained responses) to plot")
    clock, times = 0.0, []
    for rec in records:
        clock += (_first(rec, T_GEN) or 0.0) + (_first(rec, T_TRAIN) or 0.0)
        times.append(clock)
    return RunSeries(name=_run_name(run_dir), records=records,
                     x={"N": [_first(r, ("N",)) for r in records], "time": times})


def _run_name(run_dir: Path) -> str:
    try:
        name = json.loads((run_dir / "config.json").read_text()).get("run", {}).get("name", "")
    except (OSError, ValueError, AttributeError):
        name = ""
    return name or run_dir.resolve().name


def _unique_names(runs: list[RunSeries], dirs: list[Path]) -> None:
    """Runs with the same name get their parent directory in front (runs/a/x, runs/b/x -> a/x, b/x)."""
    for run, d in zip(runs, dirs):
        if sum(r.name == run.name for r in runs) > 1:
            run.name = f"{d.resolve().parent.name}/{run.name}"


def _panel(ax, runs: list[RunSeries], axis: str, title: str, ylabel: str, series) -> None:
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--"]
    drawn = False
    for i, run in enumerate(runs):
        for j, (label, keys) in enumerate(series):
            xs, ys = run.points(axis, keys)
            if not xs or (len(series) > 1 and not any(ys)):  # an all-zero KL term (no reference) adds nothing
                continue
            many = len(xs) > 40
            ax.plot(xs, ys, styles[j % 2], color=colours[i % len(colours)], lw=1.2, marker=None if many else "o",
                    ms=3, label=f"{run.name}" + (f": {label}" if len(series) > 1 else ""))
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "not in these runs' metrics", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(X_AXES[axis][0], fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="best")


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """metrics_vs_N.png and metrics_vs_time.png in out_dir for the runs in run_dirs (overlaid)."""
    dirs = [Path(d) for d in run_dirs]
    runs = [read_run(d) for d in dirs]
    _unique_names(runs, dirs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for axis, (_, filename) in X_AXES.items():
        fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
        for ax, (title, ylabel, series) in zip(axes.flat, PANELS):
            _panel(ax, runs, axis, title, ylabel, series)
        info = axes.flat[-1]
        info.axis("off")
        info.text(0.0, 0.95, "\n".join(_summary(run) for run in runs), va="top", fontsize=9, family="monospace",
                  transform=info.transAxes)
        against = "N (retained responses)" if axis == "N" else "time (t_gen + t_train)"
        fig.suptitle(f"{', '.join(r.name for r in runs)}: training metrics against {against}", fontsize=13)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths


def _summary(run: RunSeries) -> str:
    """One line per run for the figure's info panel: final N, last J, total time."""
    js = [j for j in (_first(r, PANELS[0][2][0][1]) for r in run.records) if j is not None]
    last_j = f"{js[-1]:.3f}" if js else "-"
    return f"{run.name}: N = {run.x['N'][-1]:.0f}, last J = {last_j}, t = {run.x['time'][-1]:.1f} s"
