"""bf16 training with fp32 master weights under the shared bf16 parameters (rlengine/rl/algo/optim.py).

References: Adam's update recomputed in float64 from the recorded gradients (the hand-derived
formula), an fp32 run from the same bf16-rounded start, and a fresh model built from the rounded
masters for the engine. Tolerances come from fp32 / bf16 rounding of the quantities compared.
"""

import math

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import TrainBatch, pack
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.learner import Learner, token_logprobs
from rlengine.rl.algo.optim import use_master_weights


def _bf16_start(dtype=torch.bfloat16, seed=0):
    """The tiny model with bf16-rounded weights, held in `dtype` (so fp32 and bf16 runs start equal)."""
    return Qwen3ForCausalLM(preset("tiny"), seed=seed).to(torch.bfloat16).to(dtype)


def _recorded_batch(model, B=8, seed=1) -> TrainBatch:
    """A fixed batch: random prompts/completions/advantages, behaviour log-probs = the current policy's."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (B,), generator=g)]
    comps = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 8, (B,), generator=g)]
    batch = pack(prompts, comps, [[0.0] * len(c) for c in comps], torch.randn(B, generator=g).tolist(), [0.0] * B)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, 1.0, False)
    batch.old_logprobs = torch.where(batch.loss_mask > 0, logp, torch.zeros_like(logp))
    return batch


def _learner(model, lr, masters):
    # clip epsilon wide enough that no ratio clips: the gradient is the plain surrogate's
    return Learner(model, TrainSection(lr=lr, prompts_per_step=4, group_size=2, max_grad_norm=math.inf,
                                       master_weights=masters, clip_low=0.5, clip_high=0.5))


def test_master_weights_mode():
    assert use_master_weights("auto", torch.bfloat16) and use_master_weights("auto", torch.float16)
    assert not use_master_weights("auto", torch.float32) and not use_master_weights("none", torch.bfloat16)
    assert use_master_weights("fp32", torch.float32)
    with pytest.raises(ValueError, match="master_weights"):
        use_master_weights("fp16", torch.bfloat16)


def test_masters_follow_adam_at_lr_1e6_and_round_into_the_shared_params():
    """(a) lr 1e-6, 10 updates, no clipping: each master moves by Adam's update from its recorded
    gradients (constant-sign ones by 10 x lr), and each bf16 parameter is its rounded master bit for bit."""
    lr, steps, (b1, b2), eps = 1e-6, 10, (0.9, 0.99), 1e-8
    model = _bf16_start()
    batch = _recorded_batch(model)
    learner = _learner(model, lr, "auto")
    assert learner.master_params is not None and all(m.dtype == torch.float32 for m in learner.master_params)
    storage = [p.data_ptr() for p in model.parameters()]
    theta0 = [m.detach().double().clone() for m in learner.master_params]
    grads = []
    for _ in range(steps):
        learner.step(batch)
        grads.append([m.grad.double().clone() for m in learner.master_params])
        assert all(p.grad is None for p in model.parameters())  # accumulated into fp32, bf16 grads freed
    assert [p.data_ptr() for p in model.parameters()] == storage  # written in place, same storage
    constant_sign_checked = 0
    for i, (t0, m) in enumerate(zip(theta0, learner.master_params)):
        mom, vel, expected = torch.zeros_like(t0), torch.zeros_like(t0), torch.zeros_like(t0)
        for t in range(1, steps + 1):
            g = grads[t - 1][i]
            mom, vel = b1 * mom + (1 - b1) * g, b2 * vel + (1 - b2) * g * g
            expected -= lr * (mom / (1 - b1 ** t)) / ((vel / (1 - b2 ** t)).sqrt() + eps)
        moved = m.double() - t0
        # fp32 rounding of each of the 10 master updates: at most half an fp32 ulp of the weight each
        ulp = torch.finfo(torch.float32).eps * t0.abs().clamp(min=torch.finfo(torch.float32).tiny)
        bound = 1e-3 * expected.abs() + steps * ulp
        assert ((moved - expected).abs() <= bound).all(), f"param {i}: master moved off Adam's update"
        g_all = torch.stack([gs[i] for gs in grads])
        same_sign = ((g_all > 0).all(0) | (g_all < 0).all(0)) & (g_all.abs().amin(0) > 1e3 * eps)
        steady = same_sign & (g_all.amax(0) - g_all.amin(0) <= 1e-2 * g_all.abs().amin(0))
        target = -steps * lr * g_all[0].sign()
        assert ((moved - target).abs() <= 1e-3 * steps * lr + steps * ulp)[steady].all()
        constant_sign_checked += int(steady.sum())
    assert constant_sign_checked > 1000
    for p, m in zip(model.parameters(), learner.master_params):
        assert torch.equal(p, m.to(torch.bfloat16))


def _movement(dtype, masters, lr=1e-5, steps=20):
    model = _bf16_start(dtype)
    batch = _recorded_batch(model)
    learner = _learner(model, lr, masters)
    params = list(model.parameters())
    theta0 = [p.detach().double().clone() for p in params]
    for _ in range(steps):
        learner.step(batch)
    src = learner.master_params if learner.master_params is not None else params
    deltas = [s.detach().double() - t0 for s, t0 in zip(src, theta0)]
    return deltas, theta0


def _norm(ts):
    return math.sqrt(sum(float((t * t).sum()) for t in ts))


def test_parameter_movement_with_and_without_masters():
    """(b) lr 1e-5, 20 updates on a fixed batch: with masters the movement matches an fp32 run within
    2%; without them every weight whose half bf16 ulp exceeds the step (|w| >= 2^-6, norms at 1.0)
    never moves, and the total is far short of the fp32 run's."""
    fp32, theta0 = _movement(torch.float32, "none")
    mw, _ = _movement(torch.bfloat16, "auto")
    none, _ = _movement(torch.bfloat16, "none")
    ref = _norm(fp32)
    assert abs(_norm(mw) / ref - 1) < 0.02
    # bf16 has 8 significant bits: a weight w with 2^-6 <= |w| has half-ulp >= 2^-15 = 3.1e-5 > the
    # per-step Adam move (<= lr = 1e-5), so a bf16 AdamW step rounds back to w every time.
    big = [t0.abs() >= 2 ** -6 for t0 in theta0]
    frac_big = sum(int(b.sum()) for b in big) / sum(b.numel() for b in big)
    assert frac_big > 0.3
    assert all(not d[b].any() for d, b in zip(none, big))
    assert _norm([d[b] for d, b in zip(mw, big)]) > 0.98 * _norm([d[b] for d, b in zip(fp32, big)])
    # Overall the bf16-only run moves about half as far here: the ~10% of weights of the std-0.02 init
    # below 2.5e-3 do move (their ulp is small), often by a whole ulp, so the total is not 0.
    assert _norm(none) / ref < 0.6


def test_engine_decodes_from_the_rounded_masters():
    """(c) After updates, the engine (built BEFORE them) decodes like a fresh model built from the masters."""
    model = _bf16_start()
    llm = LLM(model, max_num_seqs=4, attention_backend="auto")
    prompts = [[5, 17, 33, 9], [40, 2, 71], [8, 8, 100, 12, 3]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    learner = _learner(model, 2e-2, "auto")  # a large step so the greedy output changes
    batch = _recorded_batch(model)
    for _ in range(3):
        learner.step(batch)
    fresh = Qwen3ForCausalLM(preset("tiny"), seed=None, dtype=torch.bfloat16)
    with torch.no_grad():
        for q, m in zip(fresh.parameters(), learner.master_params):
            q.copy_(m)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    expect = [o.outputs[0].token_ids for o in LLM(fresh, max_num_seqs=4).generate(prompts, sp)]
    assert after == expect
    assert after != before


def test_micro_batches_accumulate_in_fp32():
    """Gradients of micro-batches sum in the fp32 masters' .grad, equal to the full batch's to bf16 rounding."""
    model = _bf16_start()
    batch = _recorded_batch(model, B=6)
    grads = {}
    for micro in (0, 2):
        learner = Learner(model, TrainSection(prompts_per_step=3, group_size=2, micro_batch=micro))
        learner.compute_grads(batch)
        grads[micro] = [m.grad.clone() for m in learner.master_params]
        assert all(g.dtype == torch.float32 for g in grads[micro])
    for full, acc in zip(grads[0], grads[2]):
        # each side rounds its bf16 backward differently: relative error of a few bf16 ulps (2^-8)
        assert (full - acc).norm() <= 4 * 2 ** -8 * full.norm() + 1e-12


def test_master_gradients_are_the_fp32_sum_of_every_micro_batch_gradient():
    """micro_batch = 1 over 16 sequences: each master's .grad equals the float64 sum of the 16 bf16
    gradients autograd produced for its parameter (recorded by a hook as they are made), to fp32 rounding
    of 16 additions. Summing them in bf16 anywhere (in the master's .grad or in the parameter's .grad
    across micro-batches) is off by up to half a bf16 ulp of the running sum per addition (2^-9 relative)."""
    model = _bf16_start()
    batch = _recorded_batch(model, B=16, seed=3)
    learner = Learner(model, TrainSection(prompts_per_step=8, group_size=2, micro_batch=1))
    params = list(model.parameters())
    seen = [[] for _ in params]
    hooks = [p.register_hook(lambda g, i=i: seen[i].append(g.detach().double().clone())) for i, p in enumerate(params)]
    learner.compute_grads(batch)
    for h in hooks:
        h.remove()
    assert min(len(s) for s in seen) == 16  # one bf16 gradient per micro-batch per parameter
    worst = 0.0
    for s, m in zip(seen, learner.master_params):
        assert all(g.dtype == torch.float64 for g in s) and m.grad.dtype == torch.float32
        exact = torch.stack(s).sum(0)
        bound = 16 * torch.finfo(torch.float32).eps * torch.stack(s).abs().sum(0) + 1e-30
        assert ((m.grad.double() - exact).abs() <= bound).all()
        worst = max(worst, float(((m.grad.double() - exact).abs() / bound).max()))
    assert worst <= 1.0
