"""The device clock's check on this CPU, part 1: grpo_long runs at three B_gen, each with its step trace.

    python docs/results/costs/clock_check_runs.py OUT [UPDATES]

Runs `rlengine train --config grpo_long --train.updates UPDATES` (default 30) at gen.b_gen 32, 64, 128
(gen.max_lag = B_gen / B_train + 1, the lag B_gen implies) through the tuner's runner: one torch thread,
one run at a time, t_gen / t_train on the process-CPU clock (as `rlengine tune` times a CPU job).
Evaluation only at N = 0 and at the end (it is not part of T). Each run leaves RUN_DIR/trace.jsonl.
Part 2 (clock_check_table.py) measures this CPU's cost table (steps and host terms); part 3
(clock_check_errors.py TABLE OUT.json SET=OUT/runs ...) re-costs each run's T on it and gives the errors
(`rlengine report --clock TABLE OUT/runs --target-j J` does the same through the report).
"""

import sys

from rlengine.plan.specs import PlanChange
from rlengine.rl.config import load_job_config
from rlengine.tune.runner import TrainerRunner
from rlengine.tune.stage_records import RunPlan

out = sys.argv[1]
updates = int(sys.argv[2]) if len(sys.argv) > 2 else 30
job = load_job_config("grpo_long", []).to_dict()
b = job["train"]["b_train"]
plans = [RunPlan(name=f"gen{g}", stage="run", label=f"{b} gen {g}" if g != b else f"{b}", seed=0,
                 change=PlanChange(b_gen=g, max_lag=g // b + 1 if g > b else None, updates=updates,
                                   eval_every_responses=updates * b), target_j=None)
         for g in (b, 2 * b, 4 * b)]
runner = TrainerRunner(job, out, clock="cpu", threads=1, workers=1)
for plan, curve in zip(plans, runner.map(plans)):
    print(f"{plan.name}: T = {curve.update_t[-1]:.3f} CPU s over {len(curve.update_t)} updates")
