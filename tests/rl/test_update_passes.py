"""Learner.step with the policy-update options: the default one-pass update, PPO epochs and
mini-batches, rollout importance sampling and the KL folded into the reward, each checked against
the loss, gradient or advantage written out by hand from the learner's own log-probs.

Tolerances: fp32 log-probs through the tiny model (a few hundred ops deep), losses summed over
~60 tokens: 1e-5 relative on losses and statistics, 1e-5 relative on gradient norms.
"""

import copy

import pytest
import torch

from rlengine import LLM
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.algo.losses import kl_k3
from rlengine.rl.algo.registry import algorithm
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.batching import grpo_batch, ppo_batch
from rlengine.rl.learner.learner import Learner, token_logprobs
from rlengine.rl.learner.update import grpo_kl_advantages
from tests.rl.test_learner import _rollouts

RTOL = 1e-5


def _setup(seed=3, P=3, G=3):
    """A tiny model and P groups of G sampled responses with fresh random rewards (never all equal)."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=seed)
    llm = LLM(model, max_num_seqs=16, attention_backend="torch")
    groups = _rollouts(llm, P, G, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    for g in groups:
        g.rewards = torch.rand(G, generator=gen).tolist()
    return model, groups


def _logp(model, batch, grad=False):
    with torch.set_grad_enabled(grad):
        return token_logprobs(model, batch, temperature=1.0, fused=False)[0]


def _hand_surrogate(logp, old, batch, lo=0.2, hi=0.28, w=None):
    """Token-mean clipped surrogate over the batch's valid tokens, written out."""
    r = torch.exp(logp - old)
    a = batch.advantages
    per = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi)) * (1.0 if w is None else w)
    m = batch.loss_mask
    return (per * m).sum() / m.sum()


def _assert_grads_close(model, want_loss, got_params):
    grads = torch.autograd.grad(want_loss, list(model.parameters()), allow_unused=True)
    for g, p in zip(grads, got_params):
        g = torch.zeros_like(p) if g is None else g
        assert (g - p.grad).norm() <= RTOL * g.norm() + 1e-9, f"{(g - p.grad).norm()} vs {g.norm()}"


def test_default_update_is_the_one_pass_update_and_equals_explicit_one_by_one():
    model, groups = _setup()
    batch = grpo_batch(groups, normalize_std=True)
    kw = dict(prompts_per_step=3, group_size=3, lr=1e-2, kl_coef=0.05)
    runs = []
    for extra in ({}, dict(ppo_epochs=1, mini_batches=1, kl_estimator="k3", rollout_is="none", agg="token-mean")):
        m = copy.deepcopy(model)
        learner = Learner(m, TrainSection(**kw, **extra))
        steps = []
        step = learner.optim.step
        learner.optim.step = lambda: steps.append(1) or step()
        metrics = learner.step(copy.deepcopy(batch))
        assert len(steps) == 1 and len(learner.last_passes) == 1  # one optimizer update per rollout batch
        runs.append(([p.detach().clone() for p in m.parameters()], metrics))
    (w0, m0), (w1, m1) = runs
    assert all(torch.equal(a, b) for a, b in zip(w0, w1)) and m0 == m1
    # the update is the existing loss: surrogate against the ENGINE's log-probs + kl_coef * k3 token-mean
    ref = copy.deepcopy(model)
    learner = Learner(copy.deepcopy(model), TrainSection(**kw))
    got = learner.compute_grads(copy.deepcopy(batch))
    logp = _logp(learner.model, batch, grad=True)
    ref_logp = _logp(ref, batch)
    m = batch.loss_mask
    want = _hand_surrogate(logp, batch.old_logprobs, batch) + 0.05 * (kl_k3(logp, ref_logp) * m).sum() / m.sum()
    assert got["loss"] == pytest.approx(float(want.detach()), rel=RTOL)
    _assert_grads_close(learner.model, want, list(learner.model.parameters()))


def test_second_epoch_has_ratio_off_one_and_clips():
    model, groups = _setup(seed=5)
    batch = grpo_batch(groups, normalize_std=True)
    learner = Learner(model, TrainSection(prompts_per_step=3, group_size=3, lr=3e-2, ppo_epochs=2, clip_low=0.02,
                                          clip_high=0.02, max_grad_norm=1e9))
    snaps = []
    apply = learner._apply
    learner._apply = lambda m, c: snaps.append(copy.deepcopy(model)) or apply(m, c)  # weights before each step
    out = learner.step(copy.deepcopy(batch))
    first, second = learner.last_passes
    assert abs(first["ratio_mean"] - 1.0) < 1e-4  # pass 1: the learner re-scores the engine's samples
    assert abs(second["ratio_mean"] - 1.0) > 1e-3 and second["clip_frac"] > 0 and second["approx_kl"] > 0
    # pass 2 by hand: ratios of the weights after the first step against the engine's log-probs
    r = torch.exp(_logp(snaps[1], batch) - batch.old_logprobs)
    v = batch.loss_mask > 0
    a = batch.advantages
    cut = ((a > 0) & (r > 1.02)) | ((a < 0) & (r < 0.98))
    assert second["clip_frac"] == pytest.approx(float(cut[v].float().mean()), rel=RTOL)
    assert second["clip_frac_low"] + second["clip_frac_high"] == pytest.approx(second["clip_frac"], rel=RTOL)
    assert second["ratio_max"] == pytest.approx(float(r[v].max()), rel=RTOL)
    assert out["clip_frac"] == pytest.approx((first["clip_frac"] + second["clip_frac"]) / 2)
    assert out["logprob_diff"] == first["logprob_diff"] and out["skipped_passes"] == 0


def test_mini_batches_step_once_per_part_on_that_part_alone():
    model, groups = _setup(seed=7, P=4, G=2)
    batch = grpo_batch(groups, normalize_std=True)
    parts = batch.split(3)
    assert [p.num_seqs for p in parts] == [3, 3, 2]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=4, group_size=2, mini_batches=3,
                                                         ppo_epochs=2, lr=1e-2))
    grads = []
    apply = learner._apply
    learner._apply = lambda m, c: grads.append([p.grad.clone() for p in learner.model.parameters()]) or apply(m, c)
    learner.step(copy.deepcopy(batch))
    assert len(grads) == 6 and len(learner.last_passes) == 6
    # the first step's gradient is the surrogate of part 0 alone, normalised by part 0's tokens
    fresh = copy.deepcopy(model)
    logp = _logp(fresh, parts[0], grad=True)
    want = _hand_surrogate(logp, parts[0].old_logprobs, parts[0])
    for g, w in zip(grads[0], torch.autograd.grad(want, list(fresh.parameters()), allow_unused=True)):
        w = torch.zeros_like(g) if w is None else w
        assert (g - w).norm() <= RTOL * w.norm() + 1e-9


def test_rollout_is_weights_the_loss_and_reports_their_statistics():
    model, groups = _setup(seed=9)
    batch = grpo_batch(groups, normalize_std=True)
    gen = torch.Generator().manual_seed(10)
    # an engine whose log-probs are off from the learner's (as with other kernels or older weights)
    batch.old_logprobs = batch.old_logprobs + (torch.rand(batch.old_logprobs.shape, generator=gen) - 0.5) * 0.6
    cap = 1.15
    learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=3, group_size=3, rollout_is="token",
                                                         rollout_is_cap=cap))
    got = learner.compute_grads(b := copy.deepcopy(batch))
    learner_old = _logp(model, batch)
    v = batch.loss_mask > 0
    raw = torch.exp(learner_old - batch.old_logprobs)[v]
    assert got["rollout_is_mean"] == pytest.approx(float(raw.mean()), rel=RTOL)
    assert got["rollout_is_max"] == pytest.approx(float(raw.max()), rel=RTOL)
    assert got["rollout_is_capped_frac"] == pytest.approx(float((raw > cap).float().mean()))
    assert 0 < got["rollout_is_capped_frac"] < 1
    torch.testing.assert_close(b.learner_old_logprobs, learner_old, rtol=0, atol=0)
    # the loss: surrogate against the learner's own old log-probs, times min(exp(old - engine), cap)
    logp = _logp(learner.model, batch, grad=True)
    w = torch.exp(learner_old - batch.old_logprobs).clamp(max=cap)
    want = _hand_surrogate(logp, learner_old, batch, w=w)
    assert got["loss"] == pytest.approx(float(want.detach()), rel=RTOL)
    _assert_grads_close(learner.model, want, list(learner.model.parameters()))


def _perturbed_ref(learner, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_kl_in_reward_folds_into_grpo_scores():
    model, groups = _setup(seed=11)
    batch = grpo_batch(groups, normalize_std=True)
    learner = Learner(model, TrainSection(prompts_per_step=3, group_size=3, kl_in_reward=True, kl_reward_coef=0.5,
                                          kl_estimator="k1"))
    assert learner.ref is not None and learner.cfg.kl_coef == 0
    _perturbed_ref(learner, 12)
    stats = learner.prepare(b := copy.deepcopy(batch))
    kl = batch.old_logprobs - _logp(learner.ref, batch)  # k1 at the behaviour log-probs
    v = batch.loss_mask > 0
    want = grpo_kl_advantages(batch, torch.where(v, kl, 0.0), coef=0.5, group_size=3,
                              estimator=algorithm("grpo").estimator, opts=learner.cfg)
    torch.testing.assert_close(b.advantages, want, rtol=RTOL, atol=1e-6)
    assert not torch.allclose(b.advantages, batch.advantages)  # the KL changed the advantages
    assert stats["kl_reward"] == pytest.approx(float(kl[v].mean()), rel=1e-4)


def test_kl_in_reward_is_a_token_reward_in_ppo_returns():
    model, groups = _setup(seed=13, P=4, G=1)
    batch = ppo_batch(groups)
    coef = 0.3
    learner = Learner(model, TrainSection(algo="ppo", prompts_per_step=4, group_size=1, kl_in_reward=True,
                                          kl_reward_coef=coef, gamma=1.0, lam=1.0))
    _perturbed_ref(learner, 14)
    learner.prepare(b := copy.deepcopy(batch))
    k3 = kl_k3(batch.old_logprobs, _logp(learner.ref, batch))
    # gamma = lam = 1: the return at t is the sum of the rewards from t on: R - coef * sum_{t' >= t} kl_t'
    for s, (a, e) in enumerate(zip(batch.cu_seqlens, batch.cu_seqlens[1:])):
        n = int(batch.loss_mask[a:e].sum())
        tail = torch.flip(torch.cumsum(torch.flip(k3[e - n:e], [0]), 0), [0])
        torch.testing.assert_close(b.returns[e - n:e], batch.rewards[s] - coef * tail, rtol=RTOL, atol=1e-6)
