"""The device clock's check on this CPU, part 3: each run's measured T against its trace re-costed on the table.

    python docs/results/costs/clock_check_errors.py TABLE.json OUT.json SET=RUNS_DIR [SET=RUNS_DIR ...]

RUNS_DIR: the runs/ folder clock_check_runs.py wrote (gen32, gen64, gen128). For every run: t_gen, t_train
and T = their sum over all updates on the run's own clock (process CPU seconds) and on the device clock,
with and without the table's host terms (work outside the recorded steps: collector, rewards, batching,
the learner's bookkeeping), and the relative error of the clocked T. Prints a table, writes OUT.json.
"""

import dataclasses
import json
import sys
from pathlib import Path

from rlengine.rl.trainer.trace_file import read_trace
from rlengine.tune.clock import DeviceClock


def totals(records: list[dict]) -> tuple[float, float]:
    updates = [r for r in records if r.get("update", 0) > 0 and not r.get("critic_only")]
    return sum(r["t_gen"] for r in updates), sum(r["t_train"] for r in updates)


table_path, out_path, sets = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
clock = DeviceClock.load(table_path)
bare = DeviceClock(table=dataclasses.replace(clock.table, host_update_s=(0.0, 0.0), host_response_s=(0.0, 0.0)),
                   path=table_path + " (steps only)")
rows = []
print("| runs | B_gen | t_gen / t_train own (s) | T own | steps only: T, error | with host terms: t_gen / t_train, T | error |")
for name, runs_dir in sets:
    for run_dir in sorted(Path(runs_dir).iterdir(), key=lambda p: int(p.name.removeprefix("gen"))):
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        trace = read_trace(run_dir)
        (g, t), (gb, tb), (gc, tc) = (totals(records), totals(bare.recost(records, trace, run=str(run_dir))),
                                      totals(clock.recost(records, trace, run=str(run_dir))))
        rows.append({"set": name, "b_gen": int(run_dir.name.removeprefix("gen")), "t_gen": g, "t_train": t, "T": g + t,
                     "T_steps_only": gb + tb, "error_steps_only": (gb + tb) / (g + t) - 1,
                     "t_gen_clock": gc, "t_train_clock": tc, "T_clock": gc + tc, "error": (gc + tc) / (g + t) - 1})
        r = rows[-1]
        print(f"| {name} | {r['b_gen']} | {g:.3f} / {t:.3f} | {g + t:.3f} | {gb + tb:.3f}, {r['error_steps_only']:+.1%} "
              f"| {gc:.3f} / {tc:.3f}, {gc + tc:.3f} | {r['error']:+.1%} |")
notes = clock.notes() + bare.notes()
Path(out_path).write_text(json.dumps({"table": table_path, "clock": "process CPU seconds, one thread",
                                      "host_update_s": list(clock.table.host_update_s),
                                      "host_response_s": list(clock.table.host_response_s),
                                      "runs": rows, "notes": notes}, indent=1))
print("\n".join(notes))
