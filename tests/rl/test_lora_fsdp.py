"""LoRA under FSDP2: a one-process run's update 1 checkpoint resumed on 2 gloo CPU ranks with train.parallel = fsdp
(`rlengine train --nproc 2`, the real launcher) trains update 2 as the one process did, token for token in float64.
The frozen base and the adapters are sharded per decoder layer, the KL reference is the same sharded policy with
its adapters off, the resume puts each rank's shard of the one-process adapters and moments in place, and the
sharded save writes the adapter in PEFT's format from rank 0 with optimizer state for the trainable tensors only."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from rlengine.rl.config import load_job_config
from rlengine.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# KL on: its reference is the sharded policy with the adapters off; grpo.toml trains a full head copy (lm_head)
SMALL = ["--warmstart.steps", "5", "--train.prompts_per_step", "4", "--train.group_size", "4", "--train.updates", "2",
         "--task.num_eval", "8", "--task.num_train", "50", "--eval.every", "2", "--eval.k", "1",
         "--run.progress", "false",
         "--model.dtype", "float64", "--model.lora_r", "4", "--train.lr", "1e-2", "--train.kl_coef", "0.05",
         "--run.checkpoint_every", "1", "--train.parallel", "fsdp"]  # fsdp: no sharding in one process


def _records(run: Path) -> list[tuple]:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [(x["update"], x["N"], x.get("J"), x.get("reward_mean"), x.get("kl_ref"), x.get("actor_grad_norm"))
            for x in lines]


@pytest.mark.slow
def test_fsdp_ranks_resume_and_train_the_adapters_as_one_process(tmp_path):
    one = Trainer(load_job_config("rlengine/configs/grpo.toml", SMALL + ["--run.out_dir", str(tmp_path / "one")]))
    one.run()
    trainable = [n for n, p in one.model.named_parameters() if p.requires_grad]
    # the 2-rank run starts from the one-process run as it stood after update 1
    two = tmp_path / "two"
    shutil.copytree(tmp_path / "one", two)
    shutil.rmtree(two / "checkpoints" / "update-000002")
    (two / "checkpoints" / "latest").write_text("update-000001")
    lines = (two / "metrics.jsonl").read_text().splitlines()
    (two / "metrics.jsonl").write_text("\n".join(ln for ln in lines if json.loads(ln)["update"] <= 1) + "\n")
    cmd = [sys.executable, "-m", "rlengine", "train", "--nproc", "2", "--resume", str(two)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _records(two), _records(tmp_path / "one")
    assert [x[:4] for x in a] == [x[:4] for x in b] and a[-1][0] == 2
    # float64 gradients summed in another order; the reported KL, like the loss, goes through fp32 batch fields
    # and agrees to fp32 rounding only (as in tests/rl/test_distributed.py)
    assert abs(a[-1][5] - b[-1][5]) <= 1e-10 * b[-1][5] and abs(a[-1][4] - b[-1][4]) <= 1e-5 * b[-1][4] > 0
    ckpt, ref = two / "checkpoints" / "update-000002", tmp_path / "one" / "checkpoints" / "update-000002"
    assert len(list((ckpt / "shards").iterdir())) == 2 and not (ckpt / "model").exists()  # sharded; no base copy
    ours, theirs = load_file(str(ckpt / "adapter" / "adapter_model.safetensors")), \
        load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and any("lm_head" in k for k in ours)
    assert all((ours[k] - theirs[k]).abs().max() < 1e-10 for k in ours)
    config, record = (json.loads((ckpt / f).read_text()) for f in ("adapter/adapter_config.json", "base.json"))
    assert config["base_model_name_or_path"] == record["base_model"] == str(two / "base")  # this run's base copy
    ref_config = json.loads((ref / "adapter" / "adapter_config.json").read_text())
    assert {**config, "base_model_name_or_path": ""} == {**ref_config, "base_model_name_or_path": ""}
    assert record["base_hash"] == json.loads((ref / "base.json").read_text())["base_hash"]
    # AdamW moments for the adapters and the head copy alone, each split over the two ranks' shard files
    keys = json.loads((ckpt / "optim.json").read_text())["actor"]["state_keys"]
    assert len(keys) == len(trainable) == len(json.loads((ref / "optim.json").read_text())["actor"]["state_keys"])
    held = []
    for f in sorted((ckpt / "shards").iterdir()):
        with safe_open(str(f), "pt") as s:
            held.append({k for k in s.keys() if k.endswith(".exp_avg")})
    assert held[0] and held[0] == held[1] and len(held[0]) == len(trainable)
