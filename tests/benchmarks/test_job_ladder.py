"""`rlengine bench job_ladder`: the frozen-policy q ladder of a job, on a cut-down long-response job."""

from __future__ import annotations

import json

import torch

from rlengine.benchmarks import job_ladder
from rlengine.rl.config import load_job_config
from rlengine.rl.trainer import Trainer

from tests.support.short_runs import SHORT_RUN

CUT = ["--override", "warmstart.steps=5", "--override", "train.prompts_per_step=2", "--override",
       "train.group_size=4", "--override", "task.num_train=40"]


def test_a_frozen_policy_run_leaves_every_weight_as_it_was(tmp_path):
    """train.lr = 0 (the ladder's probes): generation, scoring and the learner step all run, and not a
    bit of the policy moves."""
    cfg = load_job_config("rlengine/configs/grpo.toml", SHORT_RUN + ["--warmstart.steps", "0", "--train.lr", "0",
                                                                 "--run.out_dir", str(tmp_path / "frozen")])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    records = trainer.run()
    assert all(r["t_train"] > 0 for r in records if "t_train" in r)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_the_ladder_reports_each_rung_against_the_coupled_one(tmp_path):
    assert job_ladder.main(["--config", "grpo_long", "--b-gen", "8,16", "--updates", "5", "--skip", "1",
                            "--repeats", "2", "--out", str(tmp_path), *CUT]) == 0
    data = json.loads((tmp_path / "job_ladder.json").read_text())
    rows = {r["b_gen"]: r for r in data["rows"]}
    assert data["b_train"] == 8 and data["policy"].startswith("frozen") and set(rows) == {8, 16}
    assert rows[8]["q_ratio"] == 1.0 and rows[16]["q_ratio"] == rows[16]["q"] / rows[8]["q"]
    for r in rows.values():
        assert r["probes"] == 2 and len(r["q_reps"]) == 2 and 0 < r["gen_share"] < 1
        assert r["q"] == sum(r["q_reps"]) / 2 and r["q_spread"] == max(r["q_reps"]) - min(r["q_reps"])
        assert r["q_gen"] > r["q"] > 0 and r["resp_len"] > 0
    # the fill skip grows with B_gen / B_train: 2 updates at B_gen 16, the window's length kept
    assert rows[8]["windows"] == [[2, 5], [2, 5]] and rows[16]["windows"] == [[3, 6], [3, 6]]
    assert "conditions" in data or "provenance" in data or "machine" in json.dumps(data)
