"""RL math against numbers worked out by hand (in the comments), not against the code itself.

Covers rlengine.rl.algo.advantages (GRPO, GAE) and rlengine.rl.algo.losses (clipped policy loss with
asymmetric clipping, token-mean vs seq-mean, the micro-batch normalizer, k3 KL, value clipping), and
that every registered loss, clip_cov / kl_cov included (their tokens picked once over the whole batch),
gives the whole batch's gradient from micro-batches, in the loss functions and in the Learner.
"""

import itertools
import math

import pytest
import torch

from rlengine.rl.algo.advantages import gae, grpo_advantages
from rlengine.rl.algo.losses import kl_k3, masked_aggregate, policy_loss, value_loss
from rlengine.rl.algo.registry import POLICY_LOSSES


def _close(got, want, atol=1e-6):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=torch.float32), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- GRPO


def test_grpo_normalized():
    # Group [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3,
    #   std = 0.577350 -> A = +-0.5 / 0.577350 = +-0.866025.
    # Group [2, 4, 9, 5]: mean 5, deviations (-3, -1, 4, 0), var = (9 + 1 + 16) / 3 = 26/3,
    #   std = 2.943920 -> A = (-1.019049, -0.339683, 1.358732, 0).
    # Group [3, 3, 3, 3]: zero variance -> exactly 0.
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 9.0, 5.0], [3.0, 3.0, 3.0, 3.0]])
    a = grpo_advantages(r)
    _close(a[0], [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)
    _close(a[1], [-1.019049, -0.339683, 1.358732, 0.0], atol=1e-5)
    assert torch.equal(a[2], torch.zeros(4))
    assert a.dtype == torch.float32


def test_grpo_centred_only():
    # normalize_std=False: r - mean. [1, 0, 0, 1] -> +-0.5; [2, 4, 9, 5] -> (-3, -1, 4, 0).
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 9.0, 5.0]])
    _close(grpo_advantages(r, normalize_std=False), [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 4.0, 0.0]])


def test_grpo_zero_variance_is_exact_zero():
    # (0.1 + 0.1 + 0.1) / 3 is not 0.1 in floating point; the advantage must still be exactly 0,
    # with or without std normalisation (which would otherwise blow the residue up by 1/eps).
    r = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]])
    for normalize_std in (True, False):
        assert torch.equal(grpo_advantages(r, normalize_std=normalize_std), torch.zeros(2, 3))
    # G = 1 (PPO-like): no group to compare against -> 0, no NaN from an undefined std.
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


# ----------------------------------------------------------------------------- policy loss

# ratio r, advantage A -> per-token loss max(-A r, -A clip(r, 0.8, 1.28)), d loss / d logp:
#   r=1.10 A=+1: -1.10 (inside)                       grad -A r = -1.10
#   r=1.40 A=+1: max(-1.40, -1.28) = -1.28 (clipped)  grad 0
#   r=0.70 A=+1: max(-0.70, -0.80) = -0.70 (unclipped below 1-eps: A > 0 keeps the gradient)  grad -0.70
#   r=0.70 A=-1: max(+0.70, +0.80) = +0.80 (clipped)  grad 0
#   r=1.40 A=-1: max(+1.40, +1.28) = +1.40 (unclipped above: A < 0 keeps the gradient)  grad +1.40
#   r=1.25 A=+1: -1.25 (inside: above a symmetric 1.2 edge, below clip_high 1.28)  grad -1.25
#   r=0.75 A=-2: max(+1.50, +1.60) = +1.60 (clipped)  grad 0
#   r=5.00 A=+3: masked (prompt token), ignored
# sum over the 7 valid tokens = -1.10 - 1.28 - 0.70 + 0.80 + 1.40 - 1.25 + 1.60 = -0.53
RATIOS = [1.10, 1.40, 0.70, 0.70, 1.40, 1.25, 0.75, 5.00]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -2.0, 3.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
TOKEN_GRADS = [-1.10, 0.0, -0.70, 0.0, 1.40, -1.25, 0.0, 0.0]


def test_policy_loss_asymmetric_clip():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2, -2.5, -1.0])
    logp = (old + torch.log(torch.tensor(RATIOS))).requires_grad_()
    loss, metrics = policy_loss(logp, old, torch.tensor(ADVS), torch.tensor(MASK), clip_low=0.2, clip_high=0.28)
    _close(loss, -0.53 / 7, atol=1e-6)
    loss.backward()
    _close(logp.grad, [g / 7 for g in TOKEN_GRADS], atol=1e-6)
    _close(metrics["clip_frac"], 3 / 7)
    _close(metrics["ratio_mean"], (1.10 + 1.40 + 0.70 + 0.70 + 1.40 + 1.25 + 0.75) / 7, atol=1e-6)
    valid_r = RATIOS[:7]
    _close(metrics["approx_kl"], sum(r - 1 - math.log(r) for r in valid_r) / 7, atol=1e-6)


def test_policy_loss_log_ratio_clamp():
    # log r = 50 is clamped to 20 before exp: loss = -A * e^20 with A = -1, finite; the clamp cuts the gradient.
    logp = torch.tensor([50.0], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1), torch.tensor([-1.0]), torch.ones(1))
    assert torch.isfinite(loss)
    _close(loss / math.exp(20.0), 1.0, atol=1e-5)
    loss.backward()
    assert logp.grad.item() == 0.0


def test_token_mean_vs_seq_mean():
    # Ratio 1 everywhere, so each valid token's loss is -A.
    # seq 0: tokens A = (9 masked, 1, 2, 3); seq 1: (9 masked, 6); seq 2: (5 masked) only prompt.
    #   token-mean = -(1 + 2 + 3 + 6) / 4 = -3
    #   seq-mean   = mean(-(1+2+3)/3, -6/1) = -(2 + 6) / 2 = -4  (seq 2 has no valid token: not counted)
    adv = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0, 6.0, 5.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    logp = torch.zeros(7)
    tok, _ = policy_loss(logp, logp, adv, mask, seq_ids, agg="token-mean")
    seq, _ = policy_loss(logp, logp, adv, mask, seq_ids, agg="seq-mean")
    _close(tok, -3.0)
    _close(seq, -4.0)
    # An explicit normalizer replaces the count: seq-mean over 4 sequences = -(2 + 6) / 4.
    _close(masked_aggregate(-adv, mask, seq_ids, agg="seq-mean", normalizer=4), -2.0)
    with pytest.raises(ValueError, match="seq_ids"):
        policy_loss(logp, logp, adv, mask, agg="seq-mean")


def _packed_batch(lengths, prompt_lens, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    mask = torch.cat([torch.cat([torch.zeros(p), torch.ones(n - p)]) for n, p in zip(lengths, prompt_lens)])
    return {"x": torch.randn(T, 4, generator=g), "targets": torch.randint(0, 5, (T,), generator=g),
            "old": -torch.rand(T, generator=g) * 2, "adv": torch.randn(T, generator=g),
            "returns": torch.randn(T, generator=g), "old_v": torch.randn(T, generator=g), "mask": mask,
            "seq_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])}


def _logp(theta, b, sl):
    return torch.log_softmax(b["x"][sl] @ theta, dim=-1).gather(1, b["targets"][sl, None]).squeeze(1)


# options under which clip_cov and kl_cov pick several tokens of this batch
LOSS_OPTIONS = {"dro": {"dro_beta": 0.3}, "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0},
                "kl_cov": {"kl_cov_ratio": 0.2}}


def _losses(theta, v_head, b, sl, agg, tok_norm, seq_norm, loss="vanilla", selected=None):
    """Policy (registry loss `loss`) + value loss of the sequences in slice `sl`, with seq_ids re-based to
    the micro-batch. A loss with its own aggregation (PolicyLoss.agg) gets that aggregation's count; a
    loss that picks tokens (PolicyLoss.select) gets `selected` [T] (the whole batch's pick) sliced."""
    x, mask, seq_ids = b["x"][sl], b["mask"][sl], b["seq_ids"][sl] - b["seq_ids"][sl][0]
    logp = _logp(theta, b, sl)
    norm = tok_norm if agg == "token-mean" else seq_norm
    entry = POLICY_LOSSES[loss]
    pg_agg = entry.agg or agg
    pg_norm = None if tok_norm is None else (tok_norm if pg_agg == "token-mean" else seq_norm)
    opts = dict(LOSS_OPTIONS.get(loss, {}))
    if selected is not None:
        opts["selected"] = selected[sl]
    pl, _ = entry.fn(logp, b["old"][sl], b["adv"][sl], mask, seq_ids, agg=pg_agg, normalizer=pg_norm, **opts)
    vl, _ = value_loss(x @ v_head, b["old_v"][sl], b["returns"][sl], mask, seq_ids, agg=agg, normalizer=norm)
    return pl + vl


@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_micro_batches_sum_to_full_batch_gradient(agg, loss):
    # Six sequences of different lengths (and prompt lengths) split 2 / 3 / 1 into micro-batches.
    lengths, prompts = [3, 7, 1, 12, 5, 9], [1, 2, 0, 4, 1, 3]
    b = _packed_batch(lengths, prompts, seed=0)
    theta = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    v_head = torch.randn(4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    tok_norm, seq_norm = b["mask"].sum(), len(lengths)
    everything = slice(0, sum(lengths))
    bounds = [0, 3 + 7, 3 + 7 + 1 + 12 + 5, sum(lengths)]
    select, selected = POLICY_LOSSES[loss].select, None
    if select is not None:  # clip_cov, kl_cov: the learner's pick, once over the whole batch (Learner.prepare)
        opts = LOSS_OPTIONS[loss]
        with torch.no_grad():
            selected = select(_logp(theta, b, everything), b["old"], b["adv"], b["mask"], **opts)
            per_call = torch.cat([select(_logp(theta, b, slice(lo, hi)), b["old"][lo:hi], b["adv"][lo:hi],
                                         b["mask"][lo:hi], **opts) for lo, hi in itertools.pairwise(bounds)])
        # several tokens, and not those verl's per-micro-batch pick would take: the split would matter
        assert int(selected.sum()) >= 2 and not torch.equal(per_call, selected)

    full = _losses(theta, v_head, b, everything, agg, None, None, loss, selected)
    full_grads = torch.autograd.grad(full, (theta, v_head))

    micro_total = 0.0
    for lo, hi in itertools.pairwise(bounds):
        micro = _losses(theta, v_head, b, slice(lo, hi), agg, tok_norm, seq_norm, loss, selected)
        micro.backward()
        micro_total = micro_total + micro.detach()
    _close(micro_total, full.detach(), atol=1e-6)
    for got, want in zip((theta.grad, v_head.grad), full_grads):
        assert (got - want).norm() / want.norm() < 1e-5

    # Sensitivity check: averaging the micro-batch means (local normalizers) is NOT the full gradient.
    theta.grad = None
    naive = sum(_losses(theta, v_head, b, slice(lo, hi), agg, None, None, loss)
                for lo, hi in itertools.pairwise(bounds))
    (naive / 3).backward()
    assert (theta.grad - full_grads[0]).norm() / full_grads[0].norm() > 1e-3


# ----------------------------------------------------------------------------- KL, GAE, value loss


def test_kl_k3():
    # d = ref - logp; k3 = e^d - d - 1.
    #   p = 0.5, ref = 0.25: d = ln 0.5 = -0.693147 -> 0.5 + 0.693147 - 1 = 0.193147
    #   p = 0.2, ref = 0.6:  d = ln 3  =  1.098612 -> 3 - 1.098612 - 1 = 0.901388
    #   equal: 0
    logp = torch.log(torch.tensor([0.5, 0.2, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.6, 0.3]))
    _close(kl_k3(logp, ref), [0.193147, 0.901388, 0.0], atol=1e-5)


def test_gae_hand_example():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72. Row 0 has a masked tail (reward 5 and value 9 there ignored).
    # Row 0, valid t = 0..2, V = (0.5, 0.6, 0.7), reward 1 on t = 2:
    #   t2: delta = 1 + 0.9*0 - 0.7 = 0.3                   A = 0.3
    #   t1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                A = 0.03 + 0.72*0.3   = 0.246
    #   t0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                A = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = (0.71712, 0.846, 1.0), tail 0
    # Row 1, all valid, V = 1, reward 2 on t = 3:
    #   t3: delta = 2 - 1 = 1                               A = 1
    #   t2: delta = 0.9 - 1 = -0.1                          A = -0.1 + 0.72*1      = 0.62
    #   t1:                                                 A = -0.1 + 0.72*0.62   = 0.3464
    #   t0:                                                 A = -0.1 + 0.72*0.3464 = 0.149408
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    _close(adv, [[0.21712, 0.246, 0.3, 0.0], [0.149408, 0.3464, 0.62, 1.0]], atol=1e-6)
    _close(ret, [[0.71712, 0.846, 1.0, 0.0], [1.149408, 1.3464, 1.62, 2.0]], atol=1e-6)


def test_value_loss_clipping():
    # clip 0.2, loss = 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clamp(v - old, -0.2, 0.2):
    #   old 1, v 1.5, R 2: v_clip 1.2; (0.25, 0.64) -> 0.32, clipped branch, grad 0
    #   old 1, v 1.1, R 0: v_clip 1.1; (1.21, 1.21) -> 0.605, grad (v - R) = 1.1
    #   old 1, v 0.5, R 0: v_clip 0.8; (0.25, 0.64) -> 0.32, clipped branch, grad 0
    #   old 1, v 0.5, R 2: v_clip 0.8; (2.25, 1.44) -> 1.125, grad (v - R) = -1.5
    #   masked token
    # token-mean = (0.32 + 0.605 + 0.32 + 1.125) / 4 = 0.5925; grads / 4.
    v = torch.tensor([1.5, 1.1, 0.5, 0.5, 7.0], requires_grad=True)
    old = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    ret = torch.tensor([2.0, 0.0, 0.0, 2.0, -7.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    loss, metrics = value_loss(v, old, ret, mask, clip=0.2)
    _close(loss, 0.5925)
    loss.backward()
    _close(v.grad, [0.0, 1.1 / 4, 0.0, -1.5 / 4, 0.0])
    _close(metrics["vf_clip_frac"], 0.5)


@pytest.mark.parametrize("loss,opts", [("clip_cov", {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.0}),
                                       ("kl_cov", {"kl_cov_ratio": 0.2})])
def test_learner_picks_cov_tokens_once_so_micro_batches_give_the_whole_batch_update(loss, opts):
    """Learner.prepare picks clip_cov's / kl_cov's tokens over the whole batch: micro_batch = 2 gives the
    whole batch's gradient (fp32 through the tiny model: 1e-5), and the pick is several tokens."""
    import copy

    from rlengine.rl.config import TrainSection
    from rlengine.rl.learner.batching import grpo_batch
    from rlengine.rl.learner.learner import Learner
    from tests.rl.test_update_passes import _setup

    model, groups = _setup(seed=5)
    batch = grpo_batch(groups, normalize_std=True)
    grads = []
    for micro in (0, 2):
        learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=3, group_size=3, policy_loss=loss,
                                                             micro_batch=micro, **opts))
        learner.compute_grads(b := copy.deepcopy(batch))
        assert 2 <= int(b.token_select.sum()) < int((b.loss_mask > 0).sum())
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters()]))
    assert (grads[0] - grads[1]).norm() <= 1e-5 * grads[0].norm()
