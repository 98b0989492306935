"""Covariance-selected policy losses (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"),
with verl 0.9.1's definitions: clip_cov and kl_cov.

Both are the unclipped-or-clipped PPO surrogate in which a few tokens with a large covariance between
advantage and log-prob, cov_t = (A_t - mean A) (logp_t - mean logp) over the model tokens, are treated
differently: clip_cov cuts their gradient, kl_cov adds a |log r| penalty to them. verl picks the
tokens inside each loss call (one micro-batch), so its update depends on the micro-batch split. Here
the pick is its own function (clip_cov_select, kl_cov_select: PolicyLoss.select in the registry):
the learner runs it ONCE over the whole update batch, from the pre-update log-probs (Learner.prepare),
and hands the result to every micro-batch as `selected` [T] bool, so any split gives the same update.
Called without `selected`, a loss picks over the tokens passed in: verl's own per-call behaviour
(the verl parity tests). Signature and metrics: policy_losses.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlengine.rl.algo.losses import masked_aggregate, token_metrics, wide


def _masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


@torch.no_grad()
def clip_cov_select(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low=0.2, clip_high=0.28,
                    clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
                    generator: torch.Generator | None = None, **_shared) -> Tensor:
    """The tokens clip_cov cuts: [T] bool. Up to max(int(clip_cov_ratio * model tokens), 1) tokens, drawn at
    random (torch.randperm, `generator`) among the model tokens the ratio clip does not already cut whose
    cov_t lies in (clip_cov_lb, clip_cov_ub). Host sync: the token count sizes the draw."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov: clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    a, lp, m = wide(adv), wide(logp.detach()), wide(mask)
    ratio = torch.exp(lp - wide(old_logp))
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    valid = m > 0
    cov = (a - _masked_mean(a, m)) * (lp - _masked_mean(lp, m))
    cov = cov.masked_fill(~valid | (clipped > unclipped), -torch.inf)
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid).nonzero(as_tuple=True)[0]
    take = max(int(clip_cov_ratio * float(m.sum())), 1)
    if candidates.numel() > take:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:take].to(candidates.device)]
    picked = torch.zeros_like(valid)
    picked[candidates] = True
    return picked


@torch.no_grad()
def kl_cov_select(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, kl_cov_ratio=0.0002,
                  **_shared) -> Tensor:
    """The tokens kl_cov penalises: [T] bool, the top max(int(kl_cov_ratio * model tokens), 1) model tokens
    by cov_t (plain means over the model tokens). old_logp is unused (the shared select signature)."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov: kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    picked = torch.zeros_like(mask, dtype=torch.bool)
    valid_idx = (mask > 0).nonzero(as_tuple=True)[0]
    if valid_idx.numel():
        av, lv = wide(adv)[valid_idx], wide(logp.detach())[valid_idx]
        cov = (av - av.mean()) * (lv - lv.mean())
        picked[valid_idx[torch.topk(cov, max(1, int(valid_idx.numel() * kl_cov_ratio))).indices]] = True
    return picked


def clip_cov(logp, old_logp, adv, mask, seq_ids=None, *, clip_low=0.2, clip_high=0.28, clip_cov_ratio=0.0002,
             clip_cov_lb=1.0, clip_cov_ub=5.0, weights=None, agg="token-mean", normalizer=None, norm_len=0,
             selected: Tensor | None = None, generator: torch.Generator | None = None, **_shared):
    """Clip-Cov: the PPO surrogate (no dual-clip) whose gradient is cut (loss multiplied by 0) on the
    tokens clip_cov_select picks (`selected` [T] bool when given, else picked here over these tokens)."""
    if selected is None:
        selected = clip_cov_select(logp, old_logp, adv, mask, clip_low=clip_low, clip_high=clip_high,
                                   clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub,
                                   generator=generator)
    a, lp = wide(adv.detach()), wide(logp)
    log_r = lp - wide(old_logp.detach())
    ratio = torch.exp(log_r)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    corr = (~selected.bool()).to(a.dtype)
    loss_T = torch.maximum(unclipped, clipped) * corr * (1.0 if weights is None else wide(weights.detach()))
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, corr == 0, a)


def kl_cov(logp, old_logp, adv, mask, seq_ids=None, *, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, weights=None,
           agg="token-mean", normalizer=None, norm_len=0, selected: Tensor | None = None, **_shared):
    """KL-Cov: the unclipped surrogate -A r, plus ppo_kl_coef * |log r| on the tokens kl_cov_select picks
    (`selected` [T] bool when given, else picked here over these tokens). No ratio clip."""
    if selected is None:
        selected = kl_cov_select(logp, old_logp, adv, mask, kl_cov_ratio=kl_cov_ratio)
    a, lp = wide(adv.detach()), wide(logp)
    log_r = lp - wide(old_logp.detach())
    loss_T = -a * torch.exp(log_r)
    loss_T = torch.where(selected.bool(), loss_T + ppo_kl_coef * log_r.abs(), loss_T)
    if weights is not None:
        loss_T = loss_T * wide(weights.detach())
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    return loss, token_metrics(log_r, mask, None, a)
