"""Learner: shared weights with the engine, micro-batch equivalence, log-prob parity, bad updates."""

import copy

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import TrainBatch, grpo_batch, pack
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.learner import Learner, token_logprobs
from rlengine.rl.rollout_group import RolloutGroup


def _model(name="tiny", seed=0):
    return Qwen3ForCausalLM(preset(name), seed=seed)


def _rollouts(llm, num_prompts, G, seed=0, max_tokens=7):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 12, (num_prompts,), generator=gen)]
    outs = llm.generate(prompts, SamplingParams(n=G, temperature=1.0, max_tokens=max_tokens, seed=seed,
                                                ignore_eos=False))
    groups = []
    for i, out in enumerate(outs):
        rewards = [float(len(c.token_ids) % 3) for c in out.outputs]  # varied, includes equal-reward groups
        groups.append(RolloutGroup(i, out.prompt_token_ids, [c.token_ids for c in out.outputs],
                                   [c.token_logprobs for c in out.outputs], rewards,
                                   [c.policy_versions for c in out.outputs], [c.finish_reason for c in out.outputs]))
    return groups


def test_engine_and_learner_share_storage_and_see_updates():
    model = _model()
    llm = LLM(model, max_num_seqs=4, attention_backend="torch")
    learner = Learner(model, TrainSection(lr=5e-2, prompts_per_step=2, group_size=2))
    # same Python objects and the same storage: no copy anywhere
    assert llm.model is model
    for p_engine, p_learner in zip(llm.model.parameters(), learner.opt.param_groups[0]["params"]):
        assert p_engine.data_ptr() == p_learner.data_ptr()
    prompt = [[5, 9, 14, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    groups = _rollouts(llm, 2, 2, max_tokens=5)
    for g in groups:
        g.rewards = [1.0, 0.0]
    ptrs = [p.data_ptr() for p in model.parameters()]
    for _ in range(3):
        learner.step(grpo_batch(groups, normalize_std=True))
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # updated in place
    after = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    assert after != before


def _grads(model, learner_kwargs, batch, micro):
    m = copy.deepcopy(model)
    cfg = TrainSection(micro_batch=micro, **learner_kwargs)
    learner = Learner(m, cfg)
    if learner.critic is not None:
        torch.manual_seed(0)
        with torch.no_grad():  # a non-trivial critic head so value gradients are not all zero
            learner.critic.head.weight.normal_(0, 0.1)
    learner.compute_grads(copy.deepcopy(batch))
    grads = [p.grad.clone() for p in m.parameters()]
    if learner.critic is not None:
        grads += [p.grad.clone() for p in learner.critic.parameters() if p.grad is not None]
    return grads


@pytest.mark.parametrize("algo,agg", [("grpo", "token-mean"), ("grpo", "seq-mean"), ("ppo", "token-mean")])
def test_micro_batch_gradients_equal_full_batch(algo, agg):
    model = _model(seed=3)
    llm = LLM(model, max_num_seqs=16, attention_backend="torch")
    G = 3 if algo == "grpo" else 1
    groups = _rollouts(llm, 3 if algo == "grpo" else 7, G, seed=4)
    if algo == "grpo":
        batch = grpo_batch(groups, normalize_std=True)
    else:
        batch = pack([g.prompt_ids for g in groups], [g.completions[0] for g in groups],
                     [g.logprobs[0] for g in groups], [0.0] * len(groups), [g.rewards[0] for g in groups])
    lens = [b - a for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
    assert len(set(lens)) > 2, "sequences of different lengths"
    kw = dict(algo=algo, agg=agg, prompts_per_step=len(groups), group_size=G, kl_coef=0.0)
    full = _grads(model, kw, batch, 0)
    for micro in (1, 3):
        got = _grads(model, kw, batch, micro)
        for g_full, g_micro in zip(full, got):
            rel = (g_full - g_micro).norm() / g_full.norm().clamp(min=1e-12)
            assert rel < 1e-5, f"micro={micro}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_learner_logprobs_match_engine(name):
    model = _model(name, seed=5)
    llm = LLM(model, max_num_seqs=8, attention_backend="auto")
    groups = _rollouts(llm, 4, 3, seed=6, max_tokens=9)
    batch = grpo_batch(groups, normalize_std=True)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0, fused=False)
    valid = batch.loss_mask > 0
    err = (logp[valid] - batch.old_logprobs[valid]).abs().max().item()
    assert err < 1e-5, f"max |learner - engine| log-prob {err:.2e}"


def test_non_finite_loss_skips_update_and_keeps_state():
    model = _model(seed=7)
    llm = LLM(model, max_num_seqs=8, attention_backend="torch")
    groups = _rollouts(llm, 2, 2, seed=8)
    batch = grpo_batch(groups, normalize_std=False)
    learner = Learner(model, TrainSection(prompts_per_step=2, group_size=2))
    learner.step(batch)  # creates optimizer state
    before = [p.detach().clone() for p in model.parameters()]
    opt_state = copy.deepcopy(learner.opt.state_dict())
    bad = TrainBatch(**{f: getattr(batch, f) for f in batch.__slots__})
    bad.advantages = batch.advantages.clone()
    bad.advantages[bad.loss_mask > 0] = float("nan")
    metrics = learner.step(bad)
    assert metrics["skipped"] is True
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    after_state = learner.opt.state_dict()
    for k, st in opt_state["state"].items():
        for name, v in st.items():
            assert torch.equal(v, after_state["state"][k][name])
