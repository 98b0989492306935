"""Advantage estimators: GRPO group-relative (outcome rewards) and GAE (PPO, token-level).

Sits between reward scoring and batching: RolloutGroup rewards -> advantages -> TrainBatch.
GRPO works on one scalar reward per response, laid out [P, G] (prompt, sample); the learner
broadcasts each response's advantage over its response tokens. GAE works on right-padded
[B, T] response-token tensors (T here is the padded response length, not a packed batch).
Simplification: both run in fp32 on whatever device the inputs live on, with no host sync;
GAE is a Python loop over T of vector ops (T is a few thousand at most, B is wide).
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_token_advantages(credits_G: list[list[float]], *, normalize_std: bool = True,
                          eps: float = 1e-6) -> list[list[float]]:
    """Group-relative advantages per answer slot (train.credit = "token").

    credits_G: the G responses of one prompt, one credit per token; token t of a response fills
    slot t. A response that has stopped leaves its later slots empty, and an empty slot's credit is
    0. The advantage of slot t of response g compares its credit with slot t of all G responses:
    (c[g][t] - mean_t) / (std_t + eps) (unbiased std, as grpo_advantages), exactly 0 where the G
    credits are all equal. A written token gets its own slot's advantage: each deciding token is
    judged by its own outcome, not by the sum over the whole response. The advantages of the empty
    slots go to the response's last token, the one that stopped it: stopping early is charged with
    the credit the others earned after it, and stopping in time with the cost of the tokens they
    wrote past the answer (Task.token_credit: -1 each), so the length is learned too.
    """
    out = [[0.0] * len(c) for c in credits_G]
    for t, vals in enumerate(_slots(credits_G)):
        if len(vals) < 2 or max(vals) == min(vals):
            continue
        mean = sum(vals) / len(vals)
        sd = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if normalize_std else 1.0
        for g, v in enumerate(vals):
            a = (v - mean) / (sd + (eps if normalize_std else 0.0))
            if len(credits_G[g]) > t:
                out[g][t] = a
            elif credits_G[g]:
                out[g][-1] += a
    return out


def token_credits_uniform(credits_G: list[list[float]]) -> bool:
    """True where grpo_token_advantages gives every token 0: each slot's credit (0 where empty) is the
    same in all G responses. Dynamic sampling's "no signal" test under train.credit = "token": a group
    whose rewards are equal may still teach its tokens (the same score from different wrong slots)."""
    return all(len(set(vals)) == 1 for vals in _slots(credits_G))


def _slots(credits_G: list[list[float]]):
    """Slot t's credits in all G responses (0 where a response has stopped), t = 0 .. the longest."""
    longest = max((len(c) for c in credits_G), default=0)
    for t in range(longest):
        yield [c[t] if len(c) > t else 0.0 for c in credits_G]


def grpo_advantages(rewards_PG: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages: A[p, g] = (r[p, g] - mean_g r[p]) / (std_g r[p] + eps).

    rewards_PG: [P, G] float, one reward per response, G responses per prompt.
    normalize_std: divide by the group std (GRPO); False gives the plain centred reward
        (Dr. GRPO style).
    The std is the UNBIASED sample std (divide by G - 1), as torch.std in TRL and verl. A group
    whose rewards are all equal (including G == 1) gets exactly 0 advantages, not a
    rounding residue: (0.1 + 0.1 + 0.1) / 3 != 0.1 in floating point, so the zero is
    written explicitly. Such groups carry no learning signal; dynamic sampling drops them.
    Returns [P, G] fp32 on the input device.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"grpo_advantages: rewards_PG must be [P, G], got shape {tuple(rewards_PG.shape)}")
    if eps < 0:
        raise ValueError(f"grpo_advantages: eps must be >= 0, got {eps}")
    r = rewards_PG.float()
    G = r.shape[1]
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        var = centred.square().sum(dim=1, keepdim=True) / max(G - 1, 1)
        centred = centred / (var.sqrt() + eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred)


def gae(rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded response tokens.

    rewards_BT, values_BT: [B, T] float; mask_BT: [B, T] 0/1 (bool or float), 1 on valid
    response tokens. Padding convention: each row's valid tokens form a PREFIX (right padding);
    a 0 in the mask ends the episode there. The reward normally sits on the last valid token
    (outcome reward, optionally with per-token KL penalties elsewhere); rewards and values on
    padded positions are ignored. The value after the last valid token is 0 (terminal state):
        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1}
        R_t     = A_t + V_t   (the critic's regression target)
    Returns (advantages_BT, returns_BT), fp32, exactly 0 on padded positions. No whitening:
    the caller normalises advantages if it wants to. Values are treated as constants (detached).
    """
    if not (rewards_BT.shape == values_BT.shape == mask_BT.shape) or rewards_BT.dim() != 2:
        raise ValueError(f"gae: rewards_BT {tuple(rewards_BT.shape)}, values_BT {tuple(values_BT.shape)} and "
                         f"mask_BT {tuple(mask_BT.shape)} must all be the same [B, T] shape")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    m = mask_BT.float()
    r = rewards_BT.detach().float() * m
    v = values_BT.detach().float() * m
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_adv = r.new_zeros(B)
    next_value = r.new_zeros(B)
    next_mask = r.new_zeros(B)
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_value * next_mask - v[:, t]
        next_adv = (delta + gamma * lam * next_mask * next_adv) * m[:, t]
        adv[:, t] = next_adv
        next_value, next_mask = v[:, t], m[:, t]
    return adv, (adv + v) * m
