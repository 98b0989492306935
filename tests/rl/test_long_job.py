"""The long-response job (rlengine/configs/grpo_long.toml) learns by RL, and the check can tell.

A seeded run of its first updates, evaluated only at the ends: the mean training reward (per-slot
partial credit) over the last 10 updates must beat the first 10 by MARGIN. MARGIN comes from the
development seeds (docs/RESULTS.md, long-response job): with the shipped settings the runs gained
0.78 / 0.79 by update 120 (seeds 0, 3, one thread; seed 1 0.80 by update 102); with train.lr = 0 the policy
never moves, and runs of the earlier job gained -0.005 to +0.002 (seeds 0-2). 0.2 sits far from
both: a rounding-level change to a kernel moves a gain by hundredths, not by 0.2.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlengine.cli import main

UPDATES = 120
MARGIN = 0.2


def _reward_gain(tmp_path, *extra: str) -> float:
    out = tmp_path / "long"
    argv = ["train", "--config", "grpo_long", "--train.updates", str(UPDATES), "--eval.every", str(10 * UPDATES),
            "--eval.k", "1", "--task.num_eval", "32", "--run.checkpoint_every", "0", "--run.progress", "false",
            "--run.out_dir", str(out), *extra]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == UPDATES
    return sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10


@pytest.mark.slow
def test_the_long_job_learns_and_a_frozen_policy_does_not(tmp_path):
    torch.set_num_threads(2)
    learned = _reward_gain(tmp_path / "learn", "--run.seed", "0")
    frozen = _reward_gain(tmp_path / "frozen", "--run.seed", "0", "--train.lr", "0")
    assert learned > MARGIN > frozen, (learned, frozen)
