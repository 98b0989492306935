"""LoRA under DDP: 2 gloo CPU ranks (torchrun through `rlengine train --nproc 2`) against one process, token for
token in float64 (no sampled token can flip from rounding), as tests/rl/test_distributed.py checks full
fine-tuning: the adapters are the only trainable parameters DDP reduces, and every rank's engine decodes
with its own replica of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlengine.model.lora_peft import peft_tensors
from rlengine.rl.config import load_job_config
from rlengine.rl.trainer import Trainer
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--warmstart.steps", "5", "--train.prompts_per_step", "4", "--train.group_size", "4", "--train.updates", "2",
         "--task.num_eval", "8", "--task.num_train", "50", "--eval.every", "2", "--eval.k", "1", "--run.progress", "false",
         "--model.dtype", "float64", "--model.lora_r", "4", "--train.lr", "1e-2"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_the_adapters_as_one_process(tmp_path):
    cmd = [sys.executable, "-m", "rlengine", "train", "--nproc", "2", *SMALL, "--run.out_dir", str(tmp_path / "two")]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    one = Trainer(load_job_config("rlengine/configs/grpo.toml", SMALL + ["--run.out_dir", str(tmp_path / "one")]))
    one.run()
    a, b = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [(x["update"], x["N"], x.get("J"), x.get("reward_mean")) for x in a] == \
        [(x["update"], x["N"], x.get("J"), x.get("reward_mean")) for x in b]
    assert any(x.get("actor_grad_norm") for x in b)  # the adapters trained
    ckpt = tmp_path / "two" / "checkpoints" / (tmp_path / "two" / "checkpoints" / "latest").read_text()
    two = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    ours = peft_tensors(one.model)
    assert two.keys() == ours.keys()
    assert all((two[k] - ours[k]).abs().max() < 1e-10 for k in ours)  # float64 reductions in another order
