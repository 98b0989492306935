"""Two-stage batch tuning (docs/METHOD.md Algorithm 1) as Python functions and `rlengine tune` / `rlengine report`.

    spec = TuneSpec(job=load_job_config(path).to_dict(), target_j=0.6, b_train=(64, 128, 256, 512))
    result = tune(spec, "runs/tune")                 # stage 1, stage 2, choice, confirmation, report
    s1 = run_stage1(spec, TrainerRunner(spec.job, "runs/tune"), notes=[])   # or one stage alone
    report = report_runs(["runs/tune/runs"], target_j=0.6)                  # accounting of existing runs
Stage 1 (stage1.py) runs sample-matched curves per B_train with the sqrt LR rule; stage 2 (stage2.py)
raises B_gen until q plateaus or B_KV; table.py builds Table 1 and applies the choice rule; the
report (report.py) writes report.md / report.json / chosen.toml / runs.jsonl and the figures.
"""

from rlengine.tune.curves import candidate_stats, read_run, target_hit
from rlengine.tune.gradnorm import SlopeFit, grad_norm_slope
from rlengine.tune.pipeline import confirm, report_runs, tune
from rlengine.tune.runner import TrainerRunner
from rlengine.tune.stage1 import plan_stage1, run_stage1
from rlengine.tune.stage2 import kv_limit, run_stage2
from rlengine.tune.table import build_rows, choose_row
from rlengine.tune.stage_records import (CandidateStats, Confirmation, GenPoint, GenSweep, RunCurve, RunPlan, RunsReport,
                                 Stage1Result, Stage2Result, TableRow, TargetHit, TuneResult, TuneSpec)

__all__ = ["CandidateStats", "Confirmation", "GenPoint", "GenSweep", "RunCurve", "RunPlan", "RunsReport", "SlopeFit",
           "Stage1Result", "Stage2Result", "TableRow", "TargetHit", "TrainerRunner", "TuneResult", "TuneSpec",
           "build_rows", "candidate_stats", "choose_row", "confirm", "grad_norm_slope", "kv_limit", "plan_stage1",
           "read_run", "report_runs", "run_stage1", "run_stage2", "target_hit", "tune"]
