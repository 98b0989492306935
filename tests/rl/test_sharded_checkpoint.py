"""Sharded and asynchronous checkpoints (trainer/sharded.py) against the learner state they were taken from.

References: the learner's own tensors at the moment of the save (cloned, or gathered by the 2-rank
script after its counted save), compared exactly; and an uninterrupted run for the resumed one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlengine.model.config import preset
from rlengine.model.loader import load_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config import TrainSection, load_job_config
from rlengine.rl.distributed import Dist
from rlengine.rl.learner.learner import Learner
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from rlengine.rl.trainer.run_dir import resume_config
from rlengine.rl.trainer.sharded import learner_state, save_sharded

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from grad_equivalence import batch_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--warmstart.steps", "20", "--train.prompts_per_step", "4", "--train.group_size", "4",
         "--task.num_eval", "8", "--task.num_train", "50", "--eval.every", "1", "--run.progress", "false",
         "--model.dtype", "float64"]


def _learner(seed: int, dtype=torch.float32, **cfg) -> Learner:
    model = Qwen3ForCausalLM(preset("tiny"), seed=seed).to(dtype)
    return Learner(model, TrainSection(prompts_per_step=4, group_size=2, micro_batch=2, kl_coef=0.1, **cfg))


def _plain(tensors: dict) -> dict:
    return {k: v.detach().clone() for k, v in tensors.items()}


def test_fsdp_save_writes_each_rank_shard_gathers_only_the_weights_and_loads_in_one_process(tmp_path):
    """2 FSDP ranks (bf16 weights, fp32 masters, Adam moments, KL reference): the save all-gathers
    nothing but the model's weights for the HF export (never a full master or moment), each rank
    reloads its own shards exactly, and one process loads the same checkpoint to the full tensors."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "tests/support/sharded_save.py", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["same_after_load"]
    assert res["gathered"] == res["params"] and res["state"] > 2 * res["params"]
    ckpt = Path(res["ckpt"])
    assert sorted(p.name for p in (ckpt / "shards").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    want = load_file(str(tmp_path / "REF.safetensors"))
    one = _learner(seed=7, dtype=torch.bfloat16, master_weights="fp32")  # other weights, no optimizer state
    load_checkpoint(ckpt, model=one.model, learner=one)
    got = learner_state(one)[0]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    export = load_pretrained(ckpt / "model", dtype=torch.bfloat16)
    for p, q, m in zip(one.model.parameters(), export.parameters(), one.master_params):
        assert torch.equal(p, m.to(torch.bfloat16)) and torch.equal(q, p)


def test_async_save_holds_the_state_at_the_call_while_training_goes_on(tmp_path):
    learner = _learner(seed=0)
    learner.step(batch_of(range(8)))
    at_call = _plain(learner_state(learner)[0])
    weights = _plain(dict(learner.model.named_parameters()))
    pending = save_sharded(tmp_path, 1, model=learner.model, learner=learner, state={"update": 1}, dist=Dist(),
                           asynchronous=True)
    learner.step(batch_of(range(8)))  # training goes on: every weight and moment changes under the save
    with torch.no_grad():
        for t in learner_state(learner)[0].values():
            t.add_(1)
    path = pending.wait()
    assert pending.done() and path == latest_checkpoint(tmp_path)
    fresh = _learner(seed=7)
    state = load_checkpoint(path, model=fresh.model, learner=fresh)
    assert state == {"update": 1}
    got = learner_state(fresh)[0]
    assert got.keys() == at_call.keys() and len(at_call) > 40
    for k in at_call:
        assert torch.equal(got[k], at_call[k]), k
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_async_checkpoint_run_resumes_as_if_never_stopped(tmp_path):
    """run.async_checkpoint: each update's save is written while the next update runs; a resume from
    update 2 continues exactly as the run that never stopped (every logged float equal)."""
    job = SMALL + ["--run.checkpoint_every", "1", "--run.async_checkpoint", "true"]
    Trainer(load_job_config("rlengine/configs/grpo.toml", job + ["--train.updates", "2", "--run.out_dir",
                                                            str(tmp_path / "part")])).run()
    names = sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir())
    assert names == ["latest", "update-000001", "update-000002"]
    resumed = Trainer(resume_config(tmp_path / "part", ["--train.updates", "3"]), resume_from=tmp_path / "part")
    resumed.run()
    full = Trainer(load_job_config("rlengine/configs/grpo.toml", job + ["--train.updates", "3", "--run.out_dir",
                                                                   str(tmp_path / "full")])).run()
    rows = [json.loads(ln) for ln in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [0, 1, 2, 3]
    for got, want in zip(rows[3:], full[3:]):
        for k in ("N", "J", "reward_mean", "actor_grad_norm", "actor_loss", "kl"):
            if k in want:
                assert got[k] == want[k], (k, got[k], want[k])


def test_fsdp_save_failing_part_way_on_any_rank_leaves_the_previous_checkpoint_and_raises_on_every_rank(tmp_path):
    """2 FSDP ranks, update 1 saved, then update 2's save fails with a full disk at each point in turn
    (rank 0 making the directory, rank 1 half-way through its shard, rank 0 after the model export,
    rank 0 after the rename with latest.tmp written, rank 1's shard in an async save): both ranks end
    with the same one-line CheckpointError, no partial directory is left, `latest` still names update 1,
    which loads back to exactly the state it was saved from; the next save works."""
    out = tmp_path / "fault.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "tests/support/sharded_save_fault.py", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    failing_rank = {"begin": 0, "shard": 1, "model": 0, "pointer": 0, "async-shard": 1}
    for case, rank in failing_rank.items():
        got = res[case]
        assert got["left"] == ["latest", "update-000001"] and got["latest"] == "update-000001", (case, got)
        assert got["same"], case
        want = (f"CheckpointError: cannot save the checkpoint of update 2 in {tmp_path / 'run' / 'checkpoints'}: "
                f"No space left on device (rank {rank}); `latest` still names the previous one")
        assert got["errors"] == [want, want], (case, got["errors"])
    assert res["after"] == ["latest", "update-000001", "update-000002"]
