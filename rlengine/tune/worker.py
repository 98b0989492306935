"""One tune run in its own process: `python -m rlengine.tune.worker TASK.json` (TrainerRunner.map).

TASK.json holds the job dict, the RunPlan, the tune's output directory, the clock and the thread
count; the run is executed exactly as TrainerRunner does in-process and leaves the same run
directory (tune_run.json last), which the parent reads back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from rlengine.tune.runner import TrainerRunner, plan_config
    from rlengine.plan.specs import PlanChange
    from rlengine.tune.stage_records import RunPlan

    if len(argv) != 1:
        print("usage: python -m rlengine.tune.worker TASK.json", file=sys.stderr)
        return 2
    task = json.loads(Path(argv[0]).read_text())
    from rlengine.rl.child_lifetime import end_with_parent

    end_with_parent(task.get("parent_pid"))  # a tune that is killed takes its workers with it
    p = task["plan"]
    plan = RunPlan(name=p["name"], stage=p["stage"], label=p["label"], seed=p["seed"],
                   change=PlanChange(**p["change"]), target_j=p["target_j"])
    runner = TrainerRunner(task["job"], task["out_dir"], clock=task["clock"], threads=task["threads"])
    run_dir = runner.root / plan.name
    cfg = plan_config(task["job"], plan, run_dir, warmstart_cache=task.get("warmstart_cache", ""))
    runner.execute(plan, cfg, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
