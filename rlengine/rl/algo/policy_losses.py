"""Policy losses researchers compare, each with verl 0.9.1's definition (core_algos.py), on packed tokens.

Sits inside Learner.step beside losses.policy_loss ("vanilla"); registry.py registers them by verl's
names. Same signature and conventions as losses.policy_loss: [T] packed logp (carries the gradient),
old_logp / adv / weights constants, mask_T (0 on prompts, padding and observation tokens), seq_ids_T,
then keywords: the shared clip_low / clip_high / clip_ratio_c (verl's clip_ratio_low / _high / _c;
each loss says how it reads them), weights, agg / normalizer / norm_len (losses.masked_aggregate), and
the loss's own options (train.* under verl's names). Returns (loss, metrics) with the learner's metric
keys. Sequence-level quantities (GSPO's ratio, GMPO's geometric mean, SAPO's aggregation) are taken
over each sequence's model tokens only. Token-covariance losses (clip_cov, kl_cov) are in cov_losses.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlengine.rl.algo.losses import masked_aggregate, token_metrics, wide


def _seq_sum(x_T: Tensor, seq_ids_T: Tensor) -> Tensor:
    """Per-sequence sums into a [T] buffer (no host sync; ids < T)."""
    return x_T.new_zeros(x_T.shape[0]).index_add_(0, seq_ids_T, x_T)


def _need_seq_ids(name: str, x_T: Tensor, seq_ids_T: Tensor | None) -> Tensor:
    if seq_ids_T is None or seq_ids_T.shape != x_T.shape:
        raise ValueError(f"{name}: needs seq_ids_T with the same [T] shape as logp")
    return seq_ids_T


def gspo(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, weights=None,
         agg="token-mean", normalizer=None, norm_len=0, **_shared):
    """GSPO (Zheng et al. 2025): a sequence-level ratio s_i = exp(mean of log r over the sequence's model
    tokens), clipped to [1 - clip_low, 1 + clip_high] (GSPO's ranges are ~3e-4 / 4e-4). Token form:
    log s_it = sg(log s_i) + logp_t - sg(logp_t), clamped above at 10; loss_t = max(-A s_it, -A clip(s_it))."""
    sid = _need_seq_ids("gspo", logp, seq_ids)
    lp, m, a = wide(logp), wide(mask.detach()), wide(adv.detach())
    log_r = lp - wide(old_logp.detach())
    seq_log = _seq_sum(log_r.detach() * m, sid) / _seq_sum(m, sid).clamp(min=1.0)
    s = torch.exp((lp - lp.detach() + seq_log[sid]).clamp(max=10.0))
    unclipped, clipped = -a * s, -a * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(unclipped, clipped) * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, sid, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, clipped > unclipped, a)


def _seq_token_mean(loss_T: Tensor, mask_T: Tensor, seq_ids_T: Tensor, normalizer) -> Tensor:
    """verl's seq-mean-token-mean: sum over sequences with a model token of (token sum / (count + 1e-8)),
    over `normalizer` (default: those sequences' count)."""
    m = wide(mask_T.detach())
    cnt = _seq_sum(m, seq_ids_T)
    total = (_seq_sum(loss_T * m, seq_ids_T) / (cnt + 1e-8)).sum()
    return total / (normalizer if normalizer is not None else (cnt > 0).sum().clamp(min=1))


def sapo(logp, old_logp, adv, mask, seq_ids=None, *, tau_pos=1.0, tau_neg=1.05, weights=None, normalizer=None,
         **_shared):
    """SAPO (Gao et al. 2025): a smooth gate instead of a hard clip, f(r) = sigmoid(tau (r - 1)) * 4 / tau
    with tau = tau_pos where A > 0 and tau_neg otherwise; loss_t = -f(r_t) A_t. Always aggregated as
    seq-mean-token-mean (verl ignores loss_agg_mode here), so the learner normalises by sequences."""
    sid = _need_seq_ids("sapo", logp, seq_ids)
    a = wide(adv.detach())
    log_r = (wide(logp) - wide(old_logp.detach())).clamp(-20.0, 20.0)
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    loss_T = -torch.sigmoid(tau * (torch.exp(log_r) - 1.0)) * (4.0 / tau) * a
    if weights is not None:
        loss_T = loss_T * wide(weights.detach())
    return _seq_token_mean(loss_T, mask, sid, normalizer), token_metrics(log_r, mask, None, a)


def cispo(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, weights=None,
          agg="token-mean", normalizer=None, norm_len=0, **_shared):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient IS weight, so no token's gradient
    is ever cut: loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t."""
    a = wide(adv.detach())
    lp = wide(logp)
    log_r = (lp - wide(old_logp.detach())).clamp(-20.0, 20.0)
    ratio = torch.exp(log_r)
    truncated = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = -truncated.detach() * a * lp * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, (ratio != truncated).detach(), a)


def geo_mean(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, weights=None,
             normalizer=None, **_shared):
    """GMPO (Zhao et al. 2025): the geometric mean of the token ratios per sequence, each log-ratio clipped
    to [-clip_low, clip_high] on the side its advantage's sign makes pessimistic:
      rho_i = exp(sum_t sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t)) / (n_i + 1e-8)),  A_i = mean_t A_t,
      loss = sum_i -A_i rho_i / normalizer (default: every sequence, as verl's torch.mean over rows).
    Rollout IS weights enter as their per-sequence geometric mean."""
    sid = _need_seq_ids("geo_mean", logp, seq_ids)
    a, m = wide(adv.detach()), wide(mask.detach())
    log_r = wide(logp) - wide(old_logp.detach())
    sgn = torch.sign(a)
    clipped = log_r.clamp(-clip_low, clip_high)
    pess = sgn * torch.minimum(sgn * log_r, sgn * clipped)
    n = _seq_sum(m, sid) + 1e-8
    loss_B = -(_seq_sum(a * m, sid) / n) * torch.exp(_seq_sum(pess * m, sid) / n)
    if weights is not None:
        loss_B = loss_B * torch.exp(_seq_sum(torch.log(wide(weights.detach()) + 1e-10) * m, sid) / n)
    present = _seq_sum(torch.ones_like(m), sid) > 0
    loss = loss_B.sum() / (normalizer if normalizer is not None else present.sum())
    cut = (log_r != clipped).detach()
    return loss, token_metrics(log_r, mask, cut, a)


def gpg(logp, old_logp, adv, mask, seq_ids=None, *, weights=None, agg="token-mean", normalizer=None, norm_len=0,
        **_shared):
    """GPG (Chu et al. 2025): plain policy gradient, loss_t = -A_t logp_t (no ratio, no clip)."""
    a = wide(adv.detach())
    loss_T = -wide(logp) * a * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(wide(logp) - wide(old_logp.detach()), mask, None, a)


def dro(logp, old_logp, adv, mask, seq_ids=None, *, dro_beta=None, weights=None, agg="token-mean",
        normalizer=None, norm_len=0, **_shared):
    """DRO (Richemond et al. 2024): policy gradient with a quadratic log-ratio penalty,
    loss_t = -(A_t logp_t - dro_beta / 2 (logp_t - old_t)^2); dro_beta > 0 is required."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro: dro_beta must be > 0, got {dro_beta}")
    a, lp = wide(adv.detach()), wide(logp)
    log_r = lp - wide(old_logp.detach())
    loss_T = -(lp * a - 0.5 * dro_beta * log_r.square()) * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, None, a)


def _dppo(name, valid_fn, logp, old_logp, adv, mask, seq_ids, clip_low, clip_high, clip_ratio_c, weights, agg,
          normalizer, norm_len):
    a, lp, old = wide(adv.detach()), wide(logp), wide(old_logp.detach())
    log_r = (lp - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_r)
    cap = 20.0 if clip_ratio_c is None else clip_ratio_c  # verl's fallback when clip_ratio_c is unset
    prob, old_prob = torch.exp(lp).detach(), torch.exp(old)
    pos_ok, neg_ok = valid_fn(prob, old_prob, lp.detach(), old, clip_low, clip_high)
    valid = torch.where(a > 0, pos_ok, neg_ok).to(a.dtype)
    loss_T = -a * ratio.clamp(max=cap).detach() * lp * valid * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, valid == 0, a)


def _tv_valid(prob, old_prob, lp, old, low, high):
    return (prob - old_prob) <= high, (prob - old_prob) >= -low


def _binary_kl_valid(prob, old_prob, lp, old, low, high):
    kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)


def dppo_tv(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, clip_ratio_c=None,
            weights=None, agg="token-mean", normalizer=None, norm_len=0, **_shared):
    """DPPO-Binary-TV (2026): REINFORCE with a truncated IS weight sg(min(r, clip_ratio_c)) (20 when unset),
    keeping a token only while its probability moved by at most clip_high up (A > 0) / clip_low down
    (A <= 0): clip_low / clip_high are total-variation thresholds here, not ratio ranges."""
    return _dppo("dppo_tv", _tv_valid, logp, old_logp, adv, mask, seq_ids, clip_low, clip_high, clip_ratio_c,
                 weights, agg, normalizer, norm_len)


def dppo_kl(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, clip_ratio_c=None,
            weights=None, agg="token-mean", normalizer=None, norm_len=0, **_shared):
    """DPPO-Binary-KL (2026): as dppo_tv, but a token is kept while the binary KL between its old and new
    probability is at most clip_high (A > 0, probability rising) / clip_low (A <= 0, falling)."""
    return _dppo("dppo_kl", _binary_kl_valid, logp, old_logp, adv, mask, seq_ids, clip_low, clip_high,
                 clip_ratio_c, weights, agg, normalizer, norm_len)
