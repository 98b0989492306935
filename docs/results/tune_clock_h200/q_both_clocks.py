"""q over B_gen of a clocked `rlengine tune` on both clocks: the device clock it chose on, and the runs' own.

    python docs/results/tune_clock_h200/q_both_clocks.py TUNE_OUT TABLE.json OUT.json

Reads TUNE_OUT/report.json (stage 2's sweeps: each point's probe runs, on the device clock; while the
tune runs, the finished probe directories) and re-reads each point's runs (TUNE_OUT/runs/NAME) twice, with the same probe window as stage 2: on the
table (the figure the tune chose on) and on the runs' own clock (process CPU seconds on this CPU).
Prints one table per candidate B_train and writes OUT.json.
"""

import json
import sys
from pathlib import Path

from rlengine.tune.clock import DeviceClock
from rlengine.tune.curves import read_run
from rlengine.tune.ladder import merge_points, probe_window, window_point

def sweeps(out_dir: Path) -> tuple[int, int, list[tuple[int, list[tuple[int, list[str]]]]]]:
    """(probe_skip, probe_updates, [(B_train, [(B_gen, probe run names)])]): from report.json, or, while the
    tune still runs, from the finished probe directories (p-bB-gG-sS-rR) with the tuner's default window."""
    if (out_dir / "report.json").is_file():
        report = json.loads((out_dir / "report.json").read_text())
        return report["spec"]["probe_skip"], report["spec"]["probe_updates"], [
            (sw["b_train"], [(pt["b_gen"], [n.strip() for n in pt["source"].split(",")]) for pt in sw["points"]])
            for sw in report["stage2"]["sweeps"]]
    found: dict = {}
    for d in sorted((out_dir / "runs").glob("p-b*-g*-s*-r*")):
        if (d / "tune_run.json").is_file():
            b, g = (int(x[1:]) for x in d.name.split("-")[1:3])
            found.setdefault(b, {}).setdefault(g, []).append(d.name)
    return 2, 12, [(b, sorted(gs.items())) for b, gs in sorted(found.items())]


out_dir, table, out_json = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
skip, updates, ladder = sweeps(out_dir)
clock = DeviceClock.load(table)
rows = []
for b_train, points in ladder:
    print(f"B_train {b_train}: q = responses / s")
    print(f"| B_gen | q on {clock.label} | q on the runs' own clock (process CPU s) | runs |")
    for g, names in points:
        lo, hi = probe_window(g, b_train, skip, updates)
        q = {k: merge_points([window_point(read_run(out_dir / "runs" / n, c), g, lo, hi) for n in names]).q
             for k, c in (("device", clock), ("own", None))}
        rows.append({"b_train": b_train, "b_gen": g, "q_device_clock": q["device"], "q_own_clock": q["own"],
                     "runs": names})
        print(f"| {g} | {q['device']:.0f} | {q['own']:.0f} | {', '.join(names)} |")
Path(out_json).write_text(json.dumps({"clock": clock.label, "own_clock": "process CPU seconds, one thread",
                                      "window": [skip, updates], "points": rows}, indent=1))
