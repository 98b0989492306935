"""GPU tier of the learner and the RL job: GRPO and PPO updates on CUDA against a float64 CPU reference,
bf16 with fp32 masters, every update option once, and save / resume on CUDA. Deselected without a CUDA
device (tests/conftest.py); `tools/gpu_check.sh rl` runs them. Nothing asserts on timings.

Tolerances: fp32 with TF32 off computes the same sums as the float64 reference up to fp32 rounding of
each accumulation (a few ulps per reduction, K <= a few thousand terms): 1e-5 relative L2 per gradient
tensor. bf16 uses tests/support/engine_learner_logprobs.low_precision_bounds(L), linear in depth.
"""

import copy
import json

import pytest
import torch

from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config import TrainSection, load_job_config
from rlengine.rl.learner.learner import Learner
from rlengine.rl.trainer import Trainer
from tests.support.engine_learner_logprobs import low_precision_bounds, rollout_batch
from tests.support.short_runs import SHORT_RUN, without_timings

pytestmark = pytest.mark.gpu

GRAD_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _grads(learner: Learner) -> list[torch.Tensor]:
    out = [p.grad.detach().double().cpu() for p in learner.model.parameters() if p.grad is not None]
    if learner.critic is not None:
        out += [p.grad.detach().double().cpu() for p in learner.critic.parameters() if p.grad is not None]
    return out


def _learner(model, algo: str, **over) -> Learner:
    t = TrainSection(algo=algo, group_size=3 if algo == "grpo" else 1, prompts_per_step=4 if algo == "grpo" else 12,
                     micro_batch=5, max_grad_norm=1e9, kl_coef=0.02 if algo == "grpo" else 0.0, **over)
    torch.manual_seed(0)  # the critic's head
    return Learner(model, t)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "qwen3-30m"])
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_update_gradients_on_cuda_match_a_float64_cpu_reference(name, algo):
    """The same batch (sampled on CUDA) through the learner on CUDA in fp32 and on the CPU in float64:
    every gradient (policy, and the critic's for PPO) within GRAD_RTOL relative L2."""
    base = Qwen3ForCausalLM(preset(name), seed=0)  # fp32 weights; the reference is these in float64
    cuda = copy.deepcopy(base).to("cuda")
    batch = rollout_batch(cuda, G=3 if algo == "grpo" else 1, prompts=4 if algo == "grpo" else 12)
    if algo == "ppo":
        batch.advantages.zero_()  # the critic's GAE replaces them
    got, want = _learner(cuda, algo), _learner(copy.deepcopy(base).double(), algo)
    if algo == "ppo":
        for c in (got, want):
            with torch.no_grad():
                torch.manual_seed(1)
                c.critic.head.weight.copy_(torch.randn(c.critic.head.weight.shape).to(c.critic.head.weight))
    got.compute_grads(copy.deepcopy(batch).to("cuda"))
    want.compute_grads(copy.deepcopy(batch).to("cpu"))
    errs = [float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(_grads(got), _grads(want))]
    assert len(errs) == len(_grads(want)) > 0 and max(errs) <= GRAD_RTOL, max(errs)


@pytest.mark.parametrize("name", ["tiny", "qwen3-30m"])
def test_bf16_updates_with_fp32_masters_stay_within_the_depth_bounds(name):
    """bf16 weights with fp32 masters: the learner's recomputed log-probs against the engine's (the
    logprob_diff metric) within low_precision_bounds(L), and a step writes the rounded masters back."""
    model = Qwen3ForCausalLM(preset(name), seed=0, dtype=torch.bfloat16, device="cuda")
    batch = rollout_batch(model)
    learner = Learner(model, TrainSection(group_size=3, prompts_per_step=4, lr=1e-3))
    assert learner.master_params is not None
    m = learner.step(copy.deepcopy(batch))
    _, mean_bound = low_precision_bounds(model.config.num_hidden_layers)
    assert 0.0 <= m["logprob_diff"] <= mean_bound, m["logprob_diff"]
    for p, master in zip(model.parameters(), learner.master_params):
        assert torch.equal(p.data, master.to(p.dtype))  # the shared bf16 weights are the rounded masters


def test_batch_invariant_mode_makes_logprob_diff_exactly_zero(tmp_path):
    cfg = load_job_config("rlengine/configs/grpo.toml", SHORT_RUN + [
        "--model.device", "cuda", "--model.dtype", "bfloat16", "--gen.batch_invariant", "true",
        "--train.updates", "2", "--run.out_dir", str(tmp_path / "inv")])
    steps = [r for r in Trainer(cfg).run() if r["update"] > 0]
    assert [r["logprob_diff"] for r in steps] == [0.0, 0.0]


OPTIONS = {
    "kl-k1": ["--train.kl_coef", "0.05", "--train.kl_estimator", "k1"],
    "kl-k2": ["--train.kl_coef", "0.05", "--train.kl_estimator", "k2"],
    "kl-low-var": ["--train.kl_coef", "0.05", "--train.kl_estimator", "low_var_kl"],
    "kl-in-reward": ["--train.kl_in_reward", "true"],
    "epochs-minibatches": ["--train.ppo_epochs", "2", "--train.mini_batches", "2"],
    "dual-clip": ["--train.clip_ratio_c", "3.0"],
    "rollout-is": ["--train.rollout_is", "token"],
    "checkpointing": ["--train.activation_checkpointing", "true"],
    "ref-offload": ["--train.kl_coef", "0.05", "--train.ref_offload", "true"],
    "bf16-masters": ["--model.dtype", "bfloat16"],
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_update_option_runs_an_update_on_cuda(tmp_path, option):
    cfg = load_job_config("rlengine/configs/grpo.toml", SHORT_RUN + [
        "--model.device", "cuda", "--warmstart.steps", "0", "--train.updates", "1",
        "--run.out_dir", str(tmp_path / option), *OPTIONS[option]])
    rec = [r for r in Trainer(cfg).run() if r["update"] == 1][0]
    assert not rec["skipped"] and rec["loss"] == rec["loss"] and rec["actor_grad_norm"] >= 0  # finite, stepped


def test_ppo_with_a_critic_warm_up_runs_on_cuda(tmp_path):
    cfg = load_job_config("rlengine/configs/ppo.toml", SHORT_RUN[:-4] + [
        "--run.progress", "false", "--model.device", "cuda", "--train.group_size", "1", "--train.critic_warmup", "1",
        "--train.updates", "2", "--run.out_dir", str(tmp_path / "ppo")])
    steps = [r for r in Trainer(cfg).run() if r["update"] > 0]
    assert [r["critic_only"] for r in steps] == [True, False] and steps[1]["critic/vf_loss"] is not None


@pytest.mark.parametrize("asynchronous", [False, True])
def test_save_and_resume_on_cuda_reproduce_the_uninterrupted_run(tmp_path, asynchronous):
    over = ["--model.device", "cuda", "--train.updates", "4", "--run.checkpoint_every", "2",
            "--run.async_checkpoint", str(asynchronous).lower()]

    def cfg(name):
        return load_job_config("rlengine/configs/grpo.toml", SHORT_RUN + over + ["--run.out_dir", str(tmp_path / name)])

    full = Trainer(cfg("full")).run()
    Trainer(cfg("part")).run(stop_after=2)
    resumed = Trainer(cfg("part"), resume=True)
    assert resumed.update == 2
    history = resumed.run()
    assert [without_timings(r) for r in history] == [without_timings(r) for r in full]
    plan = json.loads((tmp_path / "part" / "plan.json").read_text())
    assert plan["engine"]["max_num_seqs"] == 16 and plan["memory"]["num_kv_blocks"] > 0

