"""Batch-invariant mode in training (gen.batch_invariant = true): on-policy updates see the learner's
recomputed log-probs equal to the behaviour log-probs, logprob_diff exactly 0.0 on every update,
in one process (fp32 and bf16, the default and the long-response job) and on 2 ranks (DDP, FSDP)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlengine.rl.config import load_config
from rlengine.rl.trainer import Trainer

from tests.support.short_runs import SHORT_RUN, short_run_config

ROOT = Path(__file__).resolve().parents[2]
ON = ["--gen.batch_invariant", "true"]


def _diffs(history):
    return [r["logprob_diff"] for r in history if r["update"] > 0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_job_logs_logprob_diff_zero_on_every_update(tmp_path, dtype):
    history = Trainer(short_run_config(tmp_path, dtype, ON + ["--model.dtype", dtype])).run()
    assert _diffs(history) == [0.0] * 4


def test_the_default_mode_does_not_log_zero(tmp_path):
    """The same job without the mode: the two forwards round differently (bf16), so the metric can fail."""
    history = Trainer(short_run_config(tmp_path, "default", ["--model.dtype", "bfloat16"])).run()
    assert all(d > 0 for d in _diffs(history))


def test_long_response_job_logs_logprob_diff_zero(tmp_path):
    cfg = load_config("rlengine/configs/grpo_long.toml", SHORT_RUN + ON + ["--train.updates", "2", "--run.out_dir",
                                                                           str(tmp_path / "long")])
    assert _diffs(Trainer(cfg).run()) == [0.0, 0.0]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_log_logprob_diff_zero(tmp_path, parallel):
    """2 gloo ranks: each rank's engine samples, the learner (DDP, or FSDP with decoding inside the
    unshard) recomputes; the reduced metric is exactly 0."""
    out = tmp_path / parallel
    cmd = [sys.executable, "-m", "rlengine", "train", "--nproc", "2", *SHORT_RUN, *ON, "--train.updates", "2",
           "--model.dtype", "bfloat16", "--train.parallel", parallel, "--run.out_dir", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    history = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert _diffs(history) == [0.0, 0.0]
