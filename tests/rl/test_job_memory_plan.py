"""The job's memory plan as the trainer and the launcher use it (plan/memory.py), on the CPU.

- train.micro_batch = 0 takes the largest micro-batch the plan fits: hand-checked on a stand-in plan
  family, then end to end on a host budget set between two micro-batches' needs (the trainer picks
  the smaller, prints it and records it in the run's config.json).
- A CPU job whose plan overruns its share of the host is refused at start, naming the numbers, and
  `--nproc K` is refused in the launcher before any rank starts (ranks get the launcher's share).
- The measured learner peak (the CUDA trainer's path, learner_peak) runs here with the CPU heap
  meter standing in for CUDA's allocator statistics: it lies between the estimate's saved part and
  its total, and leaves the parameters' gradients as they were.
"""

import json
from dataclasses import dataclass

import pytest
import torch

from rlengine.analysis.activations import activation_parts
from rlengine.cli import main
from rlengine.model.config import ConfigError, preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config import load_job_config
from rlengine.rl.trainer import Trainer
from rlengine.plan import memory
from rlengine.plan.memory import (RANK_MEMORY_ENV, choose_micro_batch, job_shape, learner_peak,
                                        plan_for_config, sequences_per_rank)
from tests.support.cpu_peak import PeakHeap

SMALL = ["--warmstart.steps", "0", "--train.updates", "1", "--train.prompts_per_step", "8", "--train.group_size", "4",
         "--eval.every", "1", "--task.num_eval", "4", "--task.num_train", "16", "--run.progress", "false"]


@dataclass
class _Plan:
    m: int
    fits: bool
    b_kv: int
    b_gen: int = 16
    kv_fixed: bool = False


def test_choose_micro_batch_takes_the_largest_that_fits():
    # fits up to 6 sequences; keeps B_KV >= B_gen up to 3: the learner must not squeeze the rollout
    plans = {m: _Plan(m, fits=m <= 6, b_kv=40 - 8 * m) for m in range(1, 11)}
    assert choose_micro_batch(plans.__getitem__, 10)[0] == 3
    # when no micro-batch keeps B_gen at full length, the largest that fits at all
    plans = {m: _Plan(m, fits=m <= 6, b_kv=4) for m in range(1, 11)}
    assert choose_micro_batch(plans.__getitem__, 10)[0] == 6
    # a pool the job sizes itself (CPU): fitting is all
    plans = {m: _Plan(m, fits=m <= 7, b_kv=0, kv_fixed=True) for m in range(1, 11)}
    assert choose_micro_batch(plans.__getitem__, 10)[0] == 7
    assert choose_micro_batch(plans.__getitem__, 5)[0] == 5
    # nothing fits: 1, unchecked (the caller's check names the numbers)
    plans = {m: _Plan(m, fits=False, b_kv=0) for m in range(1, 11)}
    assert choose_micro_batch(plans.__getitem__, 10)[0] == 1


def _need(tc, micro: int) -> int:
    """Bytes one rank's plan takes at `micro` sequences per micro-batch, before alpha."""
    shape = job_shape(tc)
    plan = plan_for_config(tc, device_bytes=2**40, max_model_len=shape.max_model_len, eval_seqs=shape.eval_seqs,
                           device_type="cpu", micro_batch=micro, check=False)
    return plan.training_state + plan.runtime + plan.kv_bytes


def test_cpu_trainer_picks_the_micro_batch_the_host_share_fits(tmp_path, monkeypatch, capsys):
    tc = load_job_config("rlengine/configs/grpo.toml", SMALL + ["--run.out_dir", str(tmp_path / "run")])
    most = sequences_per_rank(tc)
    assert most == 32 and tc.train.micro_batch == 0
    lo, hi = _need(tc, 8), _need(tc, 9)
    assert lo < hi  # the activations dominate the runtime here
    monkeypatch.setenv(RANK_MEMORY_ENV, str(int((lo + hi) / 2 / 0.9)))
    tr = Trainer(tc)
    assert tr.memory_plan.micro_batch == 8 and tr.memory_plan.kv_fixed
    assert tr.plan.learner.micro_batch == tr.learner.spec.micro_batch == 8 and tr.cfg.train.micro_batch == 0
    assert "train.micro_batch = 0: micro-batches of 8 sequences (of 32 per rank)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert saved["learner"]["micro_batch"] == 8  # a resumed run trains with the same micro-batches (pinned_micro_batch)
    metrics = tr.train_step()
    assert metrics["loss"] == metrics["loss"]  # finite: the micro-batches ran
    tr.parts.close()


def test_cpu_job_over_its_share_is_refused_at_start(tmp_path, monkeypatch):
    tc = load_job_config("rlengine/configs/grpo.toml", SMALL + ["--run.out_dir", str(tmp_path / "run")])
    monkeypatch.setenv(RANK_MEMORY_ENV, str(int(_need(tc, 1) / 0.9) - 2**20))
    with pytest.raises(ConfigError, match=r"memory plan: the job needs .* per rank but has .* training state .* "
                                          r"KV pool .* run fewer ranks on this host"):
        Trainer(tc)
    assert not (tmp_path / "run" / "config.json").exists()


def test_nproc_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    import torch.distributed.run as tdr

    tc = load_job_config("rlengine/configs/grpo.toml", SMALL)
    one = _need(tc, 1)
    started = []
    monkeypatch.setattr(tdr, "run", lambda launcher_args: started.append(launcher_args))
    monkeypatch.delenv(RANK_MEMORY_ENV, raising=False)
    args = ["train", "--nproc", "2", *SMALL, "--run.out_dir", str(tmp_path / "run")]
    # 1.5 ranks' worth of available RAM: one rank fits, two do not
    monkeypatch.setattr(memory, "_meminfo", lambda key: int(1.5 * one / 0.9))
    assert main(args) == 2
    assert "--nproc 2 on this host: memory plan: the job needs" in capsys.readouterr().err
    assert not started
    monkeypatch.setattr(memory, "_meminfo", lambda key: int(2.5 * one / 0.9))
    assert main(args) == 0 and len(started) == 1
    import os

    assert int(os.environ[RANK_MEMORY_ENV]) == int(2.5 * one / 0.9) // 2  # the share each rank plans with
    monkeypatch.delenv(RANK_MEMORY_ENV)


def test_measured_learner_peak_with_the_cpu_meter():
    tc = load_job_config("rlengine/configs/grpo.toml", SMALL)
    cfg = preset(tc.model.name)
    model = Qwen3ForCausalLM(cfg, seed=0)
    est = activation_parts(cfg, 4 * 48, tc.model.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        learner_peak(model, tc, 4, 48, PeakHeap())  # warm-up of the meter and the ops
        peak = learner_peak(model, tc, 4, 48, PeakHeap())
    finally:
        torch.set_num_threads(threads)
    assert est.saved < peak <= est.total, (est.saved, peak, est.total)
    assert all(p.grad is None for p in model.parameters())
    shape = job_shape(tc)
    plan = plan_for_config(tc, device_bytes=2**34, max_model_len=shape.max_model_len, eval_seqs=shape.eval_seqs,
                           device_type="cpu", activations=peak)
    assert plan.activations == peak and any("activations (measured" in line for line in plan.lines())
