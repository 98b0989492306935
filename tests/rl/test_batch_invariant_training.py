"""Batch-invariant mode in training (gen.batch_invariant = true): on-policy updates see the learner's
recomputed log-probs equal to the behaviour log-probs, logprob_diff exactly 0.0 on every update,
in one process (fp32 and bf16, the default and the long-response job, a MoE model) and on 2 ranks (DDP, FSDP)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlengine.rl.config import load_job_config
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


@pytest.mark.parametrize("replay", ["false", "true"])
def test_a_moe_job_logs_logprob_diff_zero_on_every_update(tmp_path, replay):
    """tiny-moe in bf16, with and without routing replay (the learner routes by the engine's ids)."""
    extra = ON + ["--model.name", "tiny-moe", "--model.dtype", "bfloat16", "--gen.record_routing", replay]
    history = Trainer(short_run_config(tmp_path, f"moe-{replay}", extra)).run()
    assert _diffs(history) == [0.0] * 4


def test_the_default_mode_does_not_log_zero(tmp_path):
    """The same job without the mode: the two forwards round differently (bf16), so the metric can fail."""
    history = Trainer(short_run_config(tmp_path, "default", ["--model.dtype", "bfloat16"])).run()
    assert all(d > 0 for d in _diffs(history))


def test_long_response_job_logs_logprob_diff_zero(tmp_path):
    cfg = load_job_config("rlengine/configs/grpo_long.toml", SHORT_RUN + ON + [
        "--train.updates", "2", "--train.warmup_updates", "0", "--run.out_dir", str(tmp_path / "long")])
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


def test_the_warm_start_runs_the_default_kernels_and_keeps_the_mode():
    """Supervised warm start: the same weights with the mode on or off (nothing sampled to match)."""
    import torch

    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM
    from rlengine.model.factory import tokenizer_for
    from rlengine.rl.data.tasks import build_task
    from rlengine.rl.data.warmstart import format_warmstart

    tok = tokenizer_for("tiny")
    task = build_task(load_job_config("rlengine/configs/grpo.toml", []).task.name, num_train=50, num_eval=8)
    models = [Qwen3ForCausalLM(preset("tiny"), seed=2) for _ in range(2)]
    models[1].batch_invariant = True
    for m in models:
        format_warmstart(m, tok, task, steps=3, lr=1e-3, batch=4, seed=0)
    assert models[1].batch_invariant and not models[0].batch_invariant
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
