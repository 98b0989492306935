"""Outcome advantage estimators researchers compare, each with verl 0.9.1's definition (core_algos.py).

Sits beside advantages.py (GRPO, GAE) between reward scoring and batching; registry.py registers them
by verl's names. Two shapes:
  group fns  fn(rewards_PG, opts) -> [P, G]: one scalar score per response, P prompts x G samples
             (rloo, grpo_passk, gpg); the learner broadcasts each advantage over the response's tokens.
  token fns  fn(rewards_BT, mask_BT, index_B, opts) -> [B, T]: right-aligned response rows, rewards per
             token (the outcome on the last model token), mask 0 on padding and on observation tokens
             of multi-turn trajectories, index_B the prompt (group) of each row (opo, reinforce_plus_plus,
             reinforce_plus_plus_baseline, optimal_token_baseline, remax).
Every function computes in its input's dtype (fp32 in training, fp64 in the verl parity tests), is
no-grad arithmetic, and gives exactly 0 on masked tokens. Differences from verl, kept on purpose:
an all-equal group gets exact zeros where verl leaves a rounding residue (~1e-16), and a whitening
over fewer than two tokens gives zeros where verl raises.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _float(x: Tensor) -> Tensor:
    """x as a float tensor of at least fp32 precision (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _constant_rows(r_PG: Tensor) -> Tensor:
    return r_PG.amax(dim=1, keepdim=True) == r_PG.amin(dim=1, keepdim=True)


# ---- group fns: [P, G] scores -> [P, G] advantages ------------------------------------------------

def rloo(rewards_PG: Tensor, opts=None) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A = r - mean of the OTHER G - 1 responses = (r - mean) * G / (G - 1).
    G = 1 leaves the score as it is (verl's choice: no baseline to take). [P, G] -> [P, G]."""
    r = _float(rewards_PG)
    G = r.shape[1]
    if G < 2:
        return r.clone()
    adv = (r - r.mean(dim=1, keepdim=True)) * (G / (G - 1))
    return torch.where(_constant_rows(r), torch.zeros_like(adv), adv)


def grpo_passk(rewards_PG: Tensor, opts, *, eps: float = 1e-6) -> Tensor:
    """Pass@k training (Chen et al. 2025): only each group's best response gets an advantage,
    r_max - r_second, divided by (group std + eps) with train.normalize_std (unbiased std); every other
    response gets 0. Needs G >= 2. [P, G] -> [P, G]."""
    r = _float(rewards_PG)
    if r.shape[1] < 2:
        raise ValueError(f"grpo_passk needs at least 2 responses per prompt, got G = {r.shape[1]}")
    top, idx = torch.topk(r, 2, dim=1)
    best = top[:, 0] - top[:, 1]
    if getattr(opts, "normalize_std", True):
        best = best / (r.std(dim=1) + eps)
    return torch.zeros_like(r).scatter_(1, idx[:, :1], best[:, None])


def gpg(rewards_PG: Tensor, opts=None) -> Tensor:
    """GPG (Chu et al. 2025): A = alpha * (r - group mean), alpha = B / (number of non-zero scores in the
    batch), the correction for groups that carry no signal (verl's f_norm = 1). G = 1: the mean is 0.
    [P, G] -> [P, G]; alpha is taken over the rows passed (one rank's share of the update)."""
    r = _float(rewards_PG)
    # verl divides two integers as tensors, so its alpha is rounded to the default dtype (fp32): kept
    alpha = (torch.tensor(r.numel()) / torch.count_nonzero(r).clamp(min=1).cpu()).to(r.device)
    mean = r.mean(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
    adv = alpha * (r - mean)
    return torch.where(_constant_rows(r) & (r.shape[1] > 1), torch.zeros_like(adv), adv)


# ---- token fns: [B, T] token rewards + mask -> [B, T] advantages ---------------------------------

def _groups(index_B) -> list[Tensor]:
    """Row indices of each group, in first-appearance order."""
    index = torch.as_tensor(index_B).reshape(-1).tolist()
    rows: dict = {}
    for b, g in enumerate(index):
        rows.setdefault(g, []).append(b)
    return [torch.tensor(v, dtype=torch.long) for v in rows.values()]


def masked_whiten(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the masked mean (sum / (count + 1e-8)) and the unbiased masked
    variance, as verl_F.masked_whiten. Fewer than two tokens: zeros (verl raises)."""
    m = mask_BT.to(x_BT.dtype)
    n = m.sum()
    if n < 2:
        return torch.zeros_like(x_BT)
    mean = (x_BT * m).sum() / (n + 1e-8)
    var = ((x_BT - mean).square() * m).sum() / (n + 1e-8) * (n / (n - 1))
    return (x_BT - mean) * torch.rsqrt(var + 1e-8)


def opo(rewards_BT: Tensor, mask_BT: Tensor, index_B, opts=None) -> Tensor:
    """OPO (Hao et al. 2025): the baseline is the length-weighted group mean sum_g |y_g| r_g / sum_g |y_g|
    (|y| = model tokens), the variance-optimal baseline for on-policy REINFORCE. A group of one: no
    baseline. Advantage = score - baseline on every model token."""
    r, m = _float(rewards_BT), _float(mask_BT)
    score, length = r.sum(dim=1), m.sum(dim=1)
    adv = torch.zeros_like(score)
    for rows in _groups(index_B):
        s, n = score[rows], length[rows]
        base = (n * s).sum() / n.sum() if len(rows) > 1 else s.new_zeros(())
        equal = len(rows) > 1 and bool((s == s[0]).all())  # exact zeros, not the weighted mean's residue
        adv[rows] = torch.zeros_like(s) if equal else s - base
    return adv[:, None] * m


def reinforce_plus_plus_baseline(rewards_BT: Tensor, mask_BT: Tensor, index_B, opts=None) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): score - group mean on every model token, then whitened over all
    model tokens of the batch (so longer responses weigh more in the statistics)."""
    r, m = _float(rewards_BT), _float(mask_BT)
    score = r.sum(dim=1)
    centred = torch.zeros_like(score)
    for rows in _groups(index_B):
        s = score[rows]
        if len(rows) > 1 and not bool((s == s[0]).all()):
            centred[rows] = s - s.mean()
        elif len(rows) == 1:
            centred[rows] = s
    return masked_whiten(centred[:, None] * m, m) * m


def reinforce_plus_plus(rewards_BT: Tensor, mask_BT: Tensor, index_B=None, opts=None) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted token returns G_t = r_t + gamma * G_{t+1} (train.gamma), whitened
    over the batch's model tokens. Observation tokens (mask 0) neither earn nor discount: the running
    return passes through them unchanged. No groups: works with G = 1."""
    r, m = _float(rewards_BT), _float(mask_BT)
    gamma = float(getattr(opts, "gamma", 1.0))
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        new = r[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])
    return masked_whiten(returns, m) * m


def optimal_token_baseline(rewards_BT: Tensor, mask_BT: Tensor, index_B, opts=None, *, old_logp_BT: Tensor,
                           sum_pi_squared_BT: Tensor, is_weights_BT: Tensor | None = None,
                           handle_zero_tail: bool = True, eps: float = 1e-8) -> Tensor:
    """Optimal token baseline: A_t = G_t - B_t with reward-to-go G_t and a per-position group baseline
    B_t = sum_g G_t W_t / (sum_g W_t + eps), W_t = cumulative sum of w_j = 1 - 2 pi_j + sum_v pi_v^2 over
    model tokens (pi_j = exp(old_logp_j); is_weights_BT scale w by rho^2). A group of one: no baseline.
    handle_zero_tail: where one response is strictly the longest of its group, its baseline is 0 past
    the second-longest length. Needs the rollout's per-token sum_v pi_v^2 ([B, T])."""
    r, m = _float(rewards_BT), _float(mask_BT)
    returns = (r * m).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(_float(old_logp_BT)) + _float(sum_pi_squared_BT)
    if is_weights_BT is not None:
        w = w * _float(is_weights_BT).square()
    w_cum = (w * m).cumsum(-1)
    base = torch.zeros_like(returns)
    for rows in _groups(index_B):
        if len(rows) < 2:
            continue
        ret, wc, mk = returns[rows], w_cum[rows], m[rows]
        base[rows] = ((ret * wc * mk).sum(0) / ((wc * mk).sum(0) + eps)).expand(len(rows), -1)
        if handle_zero_tail:
            lengths = mk.sum(-1)
            ordered = torch.sort(lengths).values
            longest, second = int(ordered[-1]), int(ordered[-2])
            at_max = (lengths == longest).nonzero(as_tuple=True)[0]
            if at_max.numel() == 1 and longest > second:
                base[rows[at_max[0]], second:] = 0.0
    return (returns - base) * m


def gdpo(rewards_BT: Tensor, mask_BT: Tensor, index_B, opts, *, components_B: dict[str, Tensor] | None = None,
         eps: float = 1e-6) -> Tensor:
    """GDPO (group reward-decoupled normalisation, arXiv 2601.05242): each named reward component
    (train.gdpo_reward_keys, from a reward plugin returning a dict) normalised within its group on its
    own, (c - mean) / (std + eps) (unbiased std; centred only without train.normalize_std; a group of
    one: mean 0, std 1), summed with train.gdpo_reward_weights (default 1 each), then whitened over the
    batch's model tokens. components_B: key -> [B] per-response values. No keys: the reward itself is
    the one component (verl's fallback: GRPO, then the whitening)."""
    keys = tuple(getattr(opts, "gdpo_reward_keys", ()))
    m = _float(mask_BT)
    if keys:
        components_B = components_B or {}
        missing = [k for k in keys if k not in components_B]
        if missing:
            raise ValueError(f"gdpo: reward component(s) {missing} not returned by the reward function (a dict "
                             f"holding them); it returned {sorted(components_B)}")
        # verl reads each component as float32 and takes its group statistics in float32: kept
        scores = [torch.as_tensor(components_B[k]).to(device=m.device, dtype=torch.float32) for k in keys]
    else:
        scores = [_float(rewards_BT).sum(dim=1)]
    weights = tuple(getattr(opts, "gdpo_reward_weights", ())) or (1.0,) * len(scores)
    normalize = getattr(opts, "normalize_std", True)
    total = torch.zeros(m.shape[0], dtype=m.dtype, device=m.device)
    for c, w in zip(scores, weights):
        norm = torch.zeros_like(c)
        for rows in _groups(index_B):
            s = c[rows.to(c.device)]
            if len(rows) == 1:  # verl's mean 0, std 1 (so the eps still divides)
                norm[rows] = s / (torch.ones((), dtype=c.dtype, device=c.device) + eps) if normalize else s
            elif not bool((s == s[0]).all()):  # an all-equal group: exact zeros (verl: a residue)
                norm[rows] = (s - s.mean()) / (s.std() + eps) if normalize else s - s.mean()
        total = total + torch.tensor(w, dtype=torch.float32).item() * norm.to(m.dtype)
    return masked_whiten(total[:, None] * m, m) * m


def remax(rewards_BT: Tensor, mask_BT: Tensor, index_B=None, opts=None, *, baseline_B: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): the reward-to-go sum_{t' >= t} r_t' minus the reward of the prompt's greedy
    (argmax) response, baseline_B [B] (each response carries its prompt's; rollout/baseline.py decodes
    and scores it). No groups, no whitening: works with G = 1. verl leaves the return on masked tokens
    inside a response (observation tokens, which no loss reads); here they are 0 like every masked token."""
    r, m = _float(rewards_BT), _float(mask_BT)
    returns = (r * m).flip(-1).cumsum(-1).flip(-1)
    return (returns - _float(torch.as_tensor(baseline_B)).to(r.device)[:, None]) * m
