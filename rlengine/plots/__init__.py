"""PNG figures (matplotlib, the `plot` extra; Agg backend, no display needed), inside the package so an
install reaches them through `rlengine plot`:

  runs.py          a run's metrics.jsonl: J, reward, response length, KL, grad norm against N and time,
                   several runs overlaid (`rlengine plot RUN_DIR...`)
  measurements.py  benchmark JSON: decode, asymmetry, time to target, sweeps, serving
                   (`rlengine plot --kind decode FILE.json`; tools/plots.py is the same script)
  tune.py          an `rlengine tune` / `rlengine report` result (report.json); tools/tune_plots.py

Importing a submodule imports matplotlib; require_matplotlib() says plainly when it is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MISSING = "plotting needs matplotlib, which is not installed: pip install 'rlengine[plot]' (or matplotlib)"


def require_matplotlib() -> None:
    """ImportError with the install line when matplotlib is missing (call before importing a submodule)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(MISSING)


KINDS = ("runs", "decode", "asymmetry", "ttt", "sweep", "serve", "tune")


def draw(kind: str, paths: list[str], out: str | None = None, *, x: str | None = None, y: str | None = None,
         group: str | None = None) -> list[Path]:
    """What `rlengine plot` draws: kind "runs" from run directories, any other from one JSON file. Raises
    ImportError without matplotlib and ValueError naming the path, record or field that is wrong."""
    require_matplotlib()
    if kind == "runs":
        from rlengine.plots.runs import plot_runs

        return plot_runs(paths, out or (paths[0] if len(paths) == 1 else "plots"))
    if len(paths) != 1:
        raise ValueError(f"--kind {kind} plots one JSON file, got {len(paths)} paths")
    from rlengine.plots import measurements as m

    src = Path(paths[0])
    data = m.read_rows_json(src)
    if kind == "tune":
        from rlengine.plots.tune import draw_all

        return draw_all(data, out or src.parent / "figures")
    target = Path(out) if out else src.with_suffix(".png")
    if kind != "sweep":
        return [m.PLOTS[kind](data, target)]
    if not x or not y:
        raise ValueError("--kind sweep needs --x and --y")
    return [m.plot_sweep(data, target, x=x, y=y.split(","), group=[g for g in (group or "").split(",") if g])]
