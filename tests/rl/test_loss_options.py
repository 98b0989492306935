"""The policy-update options' arithmetic against hand-written formulas: KL estimators, dual-clip and
the low / high clip fractions, Dr. GRPO's constant normaliser, rollout IS weights, batch whitening,
GRPO scores with the KL folded in, and how the metrics of several passes merge.

Inputs are fresh random fp32 tensors; each formula is written out in float64 in the test, so the
tolerance is fp32 rounding of a few ops on O(1) values summed over T <= 64 terms (1e-5 relative).
"""

import math

import pytest
import torch

from rlengine.rl.algo.advantages import grpo_advantages
from rlengine.rl.algo.losses import kl_penalty, masked_aggregate, policy_loss
from rlengine.rl.algo.registry import algorithm
from rlengine.rl.algo.rollout_is import rollout_is_weights
from rlengine.rl.config import TrainSection
from rlengine.rl.distributed import Dist
from rlengine.rl.learner.batching import pack
from rlengine.rl.learner.update import combine_passes, grpo_kl_advantages, whiten

RTOL = 1e-5


def _tokens(T=48, B=5, seed=0, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(T, generator=g) * 3 - 0.05
    old = logp + (torch.rand(T, generator=g) - 0.5) * 2 * spread
    adv = torch.randn(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.25).float()
    seq_ids = torch.sort(torch.randint(0, B, (T,), generator=g)).values
    return logp, old, adv, mask, seq_ids


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_their_formulas(estimator):
    logp, ref, *_ = _tokens(seed=1, spread=8.0)  # |d| up to 8: low_var_kl's clamp at 10 is reached
    d = logp.double() - ref.double()
    want = {"k1": d, "k2": 0.5 * d ** 2, "k3": torch.exp(-d) + d - 1,
            "low_var_kl": (torch.exp(-d) + d - 1).clamp(-10, 10)}[estimator]
    got = kl_penalty(logp, ref, estimator)
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=1e-6)
    if estimator == "low_var_kl":
        assert (torch.exp(-d) + d - 1).max() > 10 and got.max() == 10.0  # the clamp is exercised
    with pytest.raises(ValueError, match="kl estimator"):
        kl_penalty(logp, ref, "k4")


def _hand_policy_loss(logp, old, adv, mask, lo, hi, c=None, w=None):
    r = torch.exp(logp.double() - old.double())
    a = adv.double()
    per = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
    if c is not None:
        per = torch.where(a < 0, torch.minimum(per, -a * c), per)
    if w is not None:
        per = per * w.double()
    m = mask.double()
    return (per * m).sum() / m.sum(), r


@pytest.mark.parametrize("c", [None, 1.5])
def test_dual_clip_and_the_clip_fractions(c):
    logp, old, adv, mask, seq = _tokens(seed=2, spread=1.5)  # ratios from ~0.2 to ~4.5
    lo, hi = 0.2, 0.28
    loss, m = policy_loss(logp, old, adv, mask, seq, clip_low=lo, clip_high=hi, clip_ratio_c=c)
    want, r = _hand_policy_loss(logp, old, adv, mask, lo, hi, c)
    assert abs(float(loss) - float(want)) <= RTOL * abs(float(want)) + 1e-7
    v = mask > 0
    low = ((adv < 0) & (r < 1 - lo) & v).sum() / v.sum()
    high = ((adv > 0) & (r > 1 + hi) & v).sum() / v.sum()
    dual = ((adv < 0) & (r > (c or math.inf)) & v).sum() / v.sum()
    assert float(low) > 0 and float(high) > 0
    assert float(m["clip_frac_low"]) == pytest.approx(float(low)) and float(m["clip_frac_high"]) == pytest.approx(float(high))
    assert float(m["clip_frac"]) == pytest.approx(float(low + high))
    assert float(m["clip_frac_dual"]) == pytest.approx(float(dual))
    if c is not None:
        assert float(dual) > 0  # the dual bound is active on some token
        plain, _ = policy_loss(logp, old, adv, mask, seq, clip_low=lo, clip_high=hi)
        assert float(loss) < float(plain)  # it only ever lowers a negative-advantage token's loss
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_ratio_c=1.0)


def test_importance_weights_multiply_the_token_loss():
    logp, old, adv, mask, seq = _tokens(seed=3)
    w = torch.rand(logp.shape[0], generator=torch.Generator().manual_seed(9)) * 2
    loss, _ = policy_loss(logp, old, adv, mask, seq, weights=w)
    want, _ = _hand_policy_loss(logp, old, adv, mask, 0.2, 0.28, w=w)
    assert abs(float(loss) - float(want)) <= RTOL * abs(float(want)) + 1e-7


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    logp, old, adv, mask, seq = _tokens(seed=4)
    x = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(5))
    L = 37
    got = masked_aggregate(x, mask, seq, agg="seq-mean-token-sum-norm", norm_len=L)
    B = len(set(seq.tolist()))  # every sequence counts, masked tokens or not
    want = (x.double() * mask.double()).sum() / L / B
    assert abs(float(got) - float(want)) <= RTOL * abs(float(want))
    # with the learner's normaliser (the global sequence count) the mean over sequences is B' = 8
    got8 = masked_aggregate(x, mask, seq, agg="seq-mean-token-sum-norm", norm_len=L, normalizer=8.0)
    assert abs(float(got8) - float(want) * B / 8) <= RTOL * abs(float(want))
    with pytest.raises(ValueError, match="norm_len"):
        masked_aggregate(x, mask, seq, agg="seq-mean-token-sum-norm")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_are_truncated_ratios(level):
    learner_old, engine, _, mask, seq = _tokens(seed=6, spread=0.5)
    cap = 1.3
    w, raw = rollout_is_weights(learner_old, engine, mask, seq, level=level, cap=cap)
    d = torch.where(mask > 0, learner_old.double() - engine.double(), torch.zeros(()).double())
    if level == "sequence":
        per_seq = {s: float(d[seq == s].sum()) for s in set(seq.tolist())}
        d = torch.where(mask > 0, torch.tensor([per_seq[int(s)] for s in seq]).double(), d)
    want = torch.exp(d)
    torch.testing.assert_close(raw.double(), want, rtol=RTOL, atol=0)
    torch.testing.assert_close(w.double(), want.clamp(max=cap), rtol=RTOL, atol=0)
    assert bool((raw > cap).any()) and bool((raw < 1).any())
    assert torch.all(w[mask == 0] == 1.0)


def test_whiten_over_the_valid_tokens():
    _, _, adv, mask, _ = _tokens(seed=7)
    adv = adv * 3 + 2
    v = mask > 0
    got = whiten(adv, v, Dist())
    a = adv.double()[v]
    want = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(got[v].double(), want, rtol=RTOL, atol=1e-6)
    assert torch.all(got[~v] == 0)


def test_grpo_scores_with_the_kl_folded_in():
    g = torch.Generator().manual_seed(8)
    prompts = [[3, 4], [5, 6, 7]]
    comps = [torch.randint(3, 50, (int(n),), generator=g).tolist() for n in (3, 5, 2, 4, 6, 3)]
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    batch = pack([prompts[i // 3] for i in range(6)], comps, [[-1.0] * len(c) for c in comps], [0.0] * 6,
                 rewards)
    kl = torch.rand(batch.input_ids.shape[0], generator=g)
    coef = 0.3
    adv = grpo_kl_advantages(batch, kl, coef=coef, group_size=3, estimator=algorithm("grpo").estimator,
                             opts=TrainSection(normalize_std=True))
    v = batch.loss_mask > 0
    scores = torch.tensor([rewards[b] - coef * float(kl[(batch.seq_ids == b) & v].sum()) for b in range(6)])
    want_B = grpo_advantages(scores.view(2, 3)).reshape(-1)
    for b in range(6):
        sel = (batch.seq_ids == b) & v
        assert torch.allclose(adv[sel], want_B[b].expand(int(sel.sum())))
    assert torch.all(adv[~v] == 0)


def test_combine_passes_means_firsts_maxes_and_skips():
    a = {"loss": 1.0, "logprob_diff": 0.5, "ratio_max": 1.5, "actor_grad_norm": 2.0, "critic_grad_norm": None,
         "skipped": False}
    b = {"loss": 3.0, "logprob_diff": 0.1, "ratio_max": 2.5, "actor_grad_norm": 4.0, "critic_grad_norm": None,
         "skipped": True}
    out = combine_passes([a, b])
    assert out == {"loss": 2.0, "logprob_diff": 0.5, "ratio_max": 2.5, "actor_grad_norm": 3.0,
                   "critic_grad_norm": None, "skipped": False, "skipped_passes": 1}
    assert combine_passes([a]) == {**a, "skipped_passes": 0}
    assert combine_passes([b, b])["skipped"] is True
