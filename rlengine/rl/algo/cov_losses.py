"""Covariance-selected policy losses (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"),
with verl 0.9.1's definitions: clip_cov and kl_cov.

Both are the unclipped-or-clipped PPO surrogate in which a few tokens with a large covariance between
advantage and log-prob, cov_t = (A_t - mean A) (logp_t - mean logp) over the model tokens passed in,
are treated differently: clip_cov cuts their gradient, kl_cov adds a |log r| penalty to them. The
selection is over the tokens of ONE call, as in verl (one micro-batch), so unlike every other loss
the update depends on the micro-batch split; with micro_batch = the whole batch it is exactly verl's.
Signature and metrics: policy_losses.py.
"""

from __future__ import annotations

import torch

from rlengine.rl.algo.losses import masked_aggregate, token_metrics, wide


def _masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def clip_cov(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, clip_cov_ratio=0.0002,
             clip_cov_lb=1.0, clip_cov_ub=5.0, weights=None, agg="token-mean", normalizer=None, norm_len=0,
             generator: torch.Generator | None = None, **_shared):
    """Clip-Cov: the PPO surrogate (no dual-clip) whose gradient is cut (loss multiplied by 0) on up to
    max(int(clip_cov_ratio * model tokens), 1) tokens, drawn at random (torch.randperm, `generator`) among
    the tokens the ratio clip did not already cut whose cov_t lies in (clip_cov_lb, clip_cov_ub)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov: clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    a, lp, m = wide(adv.detach()), wide(logp), wide(mask.detach())
    log_r = lp - wide(old_logp.detach())
    ratio = torch.exp(log_r)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    valid = m > 0
    with torch.no_grad():
        cov = (a - _masked_mean(a, m)) * (lp.detach() - _masked_mean(lp.detach(), m))
        cov = cov.masked_fill(~valid | (clipped > unclipped), -torch.inf)
        candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid).nonzero(as_tuple=True)[0]
        take = max(int(clip_cov_ratio * float(m.sum())), 1)  # host sync: the count sizes the selection
        if candidates.numel() > take:
            candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:take].to(candidates.device)]
        corr = torch.ones_like(a)
        corr[candidates] = 0.0
    loss_T = torch.maximum(unclipped, clipped) * corr * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, corr == 0, a)


def kl_cov(logp, old_logp, adv, mask, seq_ids=None, *, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, weights=None,
           agg="token-mean", normalizer=None, norm_len=0, **_shared):
    """KL-Cov: the unclipped surrogate -A r, plus ppo_kl_coef * |log r| on the top max(int(kl_cov_ratio *
    model tokens), 1) tokens by cov_t (plain means over the model tokens). No ratio clip."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov: kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    a, lp = wide(adv.detach()), wide(logp)
    log_r = lp - wide(old_logp.detach())
    loss_T = -a * torch.exp(log_r)
    valid_idx = (mask > 0).nonzero(as_tuple=True)[0]
    if valid_idx.numel():
        with torch.no_grad():
            av, lv = a[valid_idx], lp.detach()[valid_idx]
            cov = (av - av.mean()) * (lv - lv.mean())
            top = valid_idx[torch.topk(cov, max(1, int(valid_idx.numel() * kl_cov_ratio))).indices]
        picked = torch.zeros_like(a, dtype=torch.bool)
        picked[top] = True
        loss_T = torch.where(picked, loss_T + ppo_kl_coef * log_r.abs(), loss_T)
    if weights is not None:
        loss_T = loss_T * wide(weights.detach())
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, None, a)
