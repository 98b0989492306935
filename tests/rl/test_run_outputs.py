"""Run outputs and update shaping: samples.jsonl, TensorBoard event files, wandb (through a stand-in
module), the LR schedule (and its resume), and over-long responses (DAPO soft punishment values; masked
responses give zero gradient)."""

import json
import math
import sys
import types

import pytest
import torch

from rlengine.model.config import ConfigError, preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch, pack
from rlengine.rl.config import TrainSection, load_job_config
from rlengine.rl.learner.learner import Learner
from rlengine.rl.algo.overlong import shape_overlong, soft_overlong_penalty
from rlengine.rl.rollout_group import RolloutGroup
from rlengine.rl.algo.schedule import lr_factor
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer.run_outputs import scalars, start_wandb

from tests.support.short_runs import short_run_config


def _records(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_samples_jsonl_and_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tr = Trainer(short_run_config(tmp_path, "out", ["--run.samples_every", "2", "--run.tensorboard", "true"]))
    history = tr.run()
    rows = [json.loads(ln) for ln in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [2] * 16 + [4] * 16               # B_train = 16 rows every 2 updates
    assert [r["N"] for r in rows] == [32] * 16 + [64] * 16
    by_update = {r["update"]: r for r in history}
    for u in (2, 4):
        batch = [r for r in rows if r["update"] == u]
        assert sum(r["reward"] for r in batch) / 16 == pytest.approx(by_update[u]["reward_mean"])
        for g in range(4):  # GRPO advantages by hand: (r - mean) / (unbiased std + 1e-6), 0 for equal rewards
            group = batch[4 * g: 4 * g + 4]
            assert len({r["prompt"] for r in group}) == 1 and group[0]["prompt"].endswith(":")
            r = [x["reward"] for x in group]
            mu = sum(r) / 4
            sd = math.sqrt(sum((x - mu) ** 2 for x in r) / 3)
            want = [0.0] * 4 if sd == 0 else [(x - mu) / (sd + 1e-6) for x in r]
            assert [x["advantage"] for x in group] == pytest.approx(want, abs=1e-5)
        for r in batch:
            assert 1 <= r["length"] <= 4 and r["logprob_min"] <= r["logprob_mean"] <= 0.0
            assert r["finish_reason"] in ("stop", "length") and isinstance(r["completion"], str)
    # TensorBoard: the event files next to metrics.jsonl hold the same scalars at step = update
    acc = EventAccumulator(str(tmp_path / "out"))
    acc.Reload()
    for key in ("reward_mean", "lr", "J", "overlong_frac", "actor/pg_loss", "critic/score/mean", "timing_s/step"):
        want = {r["update"]: r[key] for r in _records(tmp_path / "out") if key in r}
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx(want, rel=1e-6), key
    assert sorted({e.step for e in acc.Scalars("J")}) == [0, 2, 4]


def test_tensorboard_missing_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        load_job_config("grpo", ["--run.tensorboard", "true"])
    load_job_config("grpo", [])  # without it a plain job still loads


def _wandb_stand_in(calls: dict) -> types.ModuleType:
    """A module named wandb that records init / log / finish (wandb itself is not a dependency of the tests)."""
    class Run:
        def log(self, values, step):
            calls["log"].append((step, dict(values)))

        def finish(self):
            calls["finish"] += 1

    module = types.ModuleType("wandb")
    module.init = lambda **kw: calls["init"].append(kw) or Run()
    return module


def test_wandb_gets_every_row_under_the_same_names(tmp_path, monkeypatch):
    calls = {"init": [], "log": [], "finish": 0}
    monkeypatch.setitem(sys.modules, "wandb", _wandb_stand_in(calls))
    cfg = short_run_config(tmp_path, "out", ["--run.wandb", "true", "--run.wandb_project", "proj",
                                             "--train.updates", "2"])
    Trainer(cfg).run()
    rows = _records(tmp_path / "out")
    assert [step for step, _ in calls["log"]] == [r["update"] for r in rows] == [0, 1, 2]
    for (_, values), row in zip(calls["log"], rows):
        assert values == scalars(row) and values
    assert {"actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/step"} <= set(calls["log"][1][1])
    assert "critic/vf_loss" not in calls["log"][1][1]  # None (GRPO has no critic) is not logged
    assert calls["init"] == [{"project": "proj", "name": "out", "dir": str(tmp_path / "out"),
                              "config": cfg.to_dict()}]
    assert calls["finish"] == 1


def test_wandb_missing_is_a_config_error_naming_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError, match=r"pip install rlengine\[wandb\]"):
        load_job_config("grpo", ["--run.wandb", "true"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install rlengine\[wandb\]"):
        start_wandb(tmp_path, project="p", config={})


def test_lr_factor_by_hand():
    # U = 6 updates, W = 2 warm-up updates, min ratio 0.1: warm-up (u+1)/W, then p = (u-W)/(U-1-W)
    cos = [lr_factor(u, schedule="cosine", warmup=2, total=6, min_ratio=0.1) for u in range(6)]
    assert cos == pytest.approx([0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + 0.5), 0.1 + 0.45 * (1 - 0.5), 0.1])
    lin = [lr_factor(u, schedule="linear", warmup=2, total=6, min_ratio=0.1) for u in range(6)]
    assert lin == pytest.approx([0.5, 1.0, 1.0, 1 - 0.9 / 3, 1 - 0.9 * 2 / 3, 0.1])
    const = [lr_factor(u, schedule="constant", warmup=3, total=6, min_ratio=0.1) for u in range(6)]
    assert const == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0])
    assert [lr_factor(u, schedule="cosine", warmup=0, total=3, min_ratio=0.0) for u in range(3)] == \
        pytest.approx([1.0, 0.5, 0.0])


def test_lr_schedule_in_the_run_and_after_resume(tmp_path):
    extra = ["--train.updates", "6", "--train.lr_schedule", "cosine", "--train.warmup_updates", "2",
             "--train.min_lr_ratio", "0.1", "--eval.every", "6"]
    full = Trainer(short_run_config(tmp_path, "full", extra))
    base = full.cfg.train.lr_effective
    lrs = [r["lr"] for r in full.run() if r["update"] > 0]
    assert lrs == pytest.approx([base * f for f in (0.5, 1.0, 1.0, 0.775, 0.325, 0.1)], rel=1e-12)
    part = Trainer(short_run_config(tmp_path, "part", extra))
    part.run(stop_after=3)
    resumed = Trainer(short_run_config(tmp_path, "part", extra), resume=True)
    history = [r for r in resumed.run() if r["update"] > 0]
    assert [r["lr"] for r in history] == pytest.approx(lrs, rel=1e-12)  # the schedule continues at update 4


def test_soft_overlong_penalty_by_hand():
    # L_max = 8, L_cache = 4: 0 up to 4 tokens, then -(len - 4) / 4, -1 from 8 on
    assert [soft_overlong_penalty(n, 8, 4) for n in (1, 4, 5, 6, 7, 8, 9)] == [0, 0, -0.25, -0.5, -0.75, -1, -1]
    assert soft_overlong_penalty(10, 10, 1) == -1.0 and soft_overlong_penalty(9, 10, 1) == 0.0


def _group(lengths, reasons, rewards):
    comps = [list(range(5, 5 + n)) for n in lengths]
    return RolloutGroup(0, [1, 2, 3], comps, [[-0.5 - 0.1 * i for i in range(n)] for n in lengths], list(rewards),
                        [[0] * n for n in lengths], list(reasons))


def test_shape_overlong_modes():
    g = _group([8, 3, 8, 6], ["length", "stop", "length", "stop"], [1.0, 0.0, 1.0, 1.0])
    assert shape_overlong([g], "soft", max_tokens=8, buffer=4) == (2, -1 - 1 - 0.5)
    assert g.rewards == [0.0, 0.0, 0.0, 0.5] and g.scores == [1.0, 0.0, 1.0, 1.0] and g.loss_weights == []
    m = _group([8, 3, 8, 6], ["length", "stop", "length", "stop"], [1.0, 0.0, 1.0, 1.0])
    assert shape_overlong([m], "mask", max_tokens=8, buffer=4)[0] == 2
    assert m.loss_weights == [0.0, 1.0, 0.0, 1.0] and m.rewards == [1.0, 0.0, 1.0, 1.0]
    batch = grpo_batch([m], normalize_std=True)
    per_seq = [float(batch.loss_mask[a:e].sum()) for a, e in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
    assert per_seq == [0.0, 3.0, 0.0, 6.0]


def test_masked_responses_contribute_zero_gradient():
    """A masked response changes nothing: the gradient equals that of the batch without it (same
    advantages), whatever its tokens are; without the mask it does change the gradient (control)."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset("tiny"), seed=3)
    learner = Learner(model, TrainSection(algo="grpo", group_size=4, prompts_per_step=1, max_grad_norm=1e9))
    prompts, adv, rew = [[1, 2, 3]] * 4, [0.9, -0.3, 0.5, -1.1], [1.0, 0.0, 1.0, 0.0]
    comps = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    lps = [[-1.0 - 0.1 * j for j in range(len(c))] for c in comps]

    def grads(batch):
        learner.compute_grads(batch)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()

    masked = grads(pack(prompts, comps, lps, adv, rew, loss_weights=[1.0, 1.0, 0.0, 1.0]))
    keep = [0, 1, 3]
    without = grads(pack([prompts[i] for i in keep], [comps[i] for i in keep], [lps[i] for i in keep],
                         [adv[i] for i in keep], [rew[i] for i in keep]))
    assert torch.allclose(masked, without, rtol=1e-5, atol=1e-7)
    other = [c if i != 2 else [20, 21, 22, 23] for i, c in enumerate(comps)]
    assert torch.allclose(grads(pack(prompts, other, lps, adv, rew, loss_weights=[1.0, 1.0, 0.0, 1.0])), masked,
                          rtol=1e-5, atol=1e-7)
    unmasked = grads(pack(prompts, comps, lps, adv, rew))
    assert not torch.allclose(unmasked, without, rtol=1e-3, atol=1e-6)


def test_ppo_with_every_response_masked_has_nothing_to_learn():
    """PPO's GAE puts each reward on the response's last trained token; with every response masked as
    over-long there is none (the padded width is 0): loss 0 and no gradient, not an IndexError."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset("tiny"), seed=3)
    learner = Learner(model, TrainSection(algo="ppo", group_size=2, prompts_per_step=1, max_grad_norm=1e9))
    prompts, comps = [[1, 2, 3]] * 2, [[5, 6], [8]]
    lps = [[-1.0] * len(c) for c in comps]
    m = learner.compute_grads(pack(prompts, comps, lps, [0.0, 0.0], [1.0, 0.0], loss_weights=[0.0, 0.0]))
    assert m["loss"] == 0.0 and m["value_loss"] == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert learner.compute_grads(pack(prompts, comps, lps, [0.0, 0.0], [1.0, 0.0]))["loss"] != 0.0  # control


def test_overlong_fraction_logged_and_mask_leaves_nothing_to_learn(tmp_path):
    # max_tokens 1: an answer digit is always cut before its <eos>, so every response is over-long
    cfg = short_run_config(tmp_path, "ol", ["--gen.max_tokens", "1", "--train.overlong", "mask", "--train.updates",
                                            "2", "--train.dynamic_sampling", "false"])
    steps = [r for r in Trainer(cfg).run() if r["update"] > 0]
    assert [r["overlong_frac"] for r in steps] == [1.0, 1.0]
    assert all(r["actor_grad_norm"] == 0.0 for r in steps)
    soft = short_run_config(tmp_path, "soft",
                            ["--gen.max_tokens", "1", "--train.overlong", "soft", "--train.updates", "1"])
    assert soft.train.overlong_buffer == 0 and soft.overlong_buffer == 1  # as written; max(1, max_tokens // 4)
    rec = [r for r in Trainer(soft).run() if r["update"] > 0][0]
    assert rec["overlong_penalty_mean"] == -1.0
    with pytest.raises(ConfigError, match="overlong_buffer"):
        short_run_config(tmp_path, "bad", ["--train.overlong", "soft", "--train.overlong_buffer", "99"])
