"""The arithmetic around the learner's gradient passes: GAE on packed responses, batch whitening, KL in
the reward, rollout IS statistics, pass metrics.

Learner.prepare runs once per rollout batch before any pass: PPO's GAE (in the learner, it needs the
critic), then the pieces here that rewrite the batch's advantages (GRPO scores with the KL penalty
folded in, whitening over the whole batch); Learner.step then runs train.ppo_epochs x
train.mini_batches gradient passes and merges their metrics with combine_passes. Everything here is
no-grad and global over ranks (one all-reduce of a few floats where a statistic needs it).
"""

from __future__ import annotations

import math

import torch

from rlengine.rl.algo.advantages import gae
from rlengine.rl.distributed import Dist
from rlengine.rl.learner.batching import TrainBatch


def whiten(adv_T: torch.Tensor, valid_T: torch.Tensor, dist: Dist) -> torch.Tensor:
    """(adv - mean) / (std + 1e-8) over the valid tokens of ALL ranks (fp64 sums), 0 elsewhere: [T]."""
    a_valid = adv_T[valid_T].double()
    n, s1, s2 = dist.all_sum([float(valid_T.sum()), float(a_valid.sum()), float((a_valid ** 2).sum())])
    mu = s1 / max(n, 1.0)
    sd = math.sqrt(max(s2 / max(n, 1.0) - mu * mu, 0.0))
    return torch.where(valid_T, (adv_T - mu) / (sd + 1e-8), torch.zeros_like(adv_T))


def packed_gae(batch: TrainBatch, values_T: torch.Tensor, kl_T: torch.Tensor | None, *, gamma: float, lam: float,
               kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (advantages [T], returns [T]) of PPO's packed responses, 0 off the trained positions.

    A response's trained positions are the last n of its packed segment; the outcome reward sits on
    its last token, and with kl_T (train.kl_in_reward) every token's reward also gets -kl_coef * kl_t.
    """
    segs = list(zip(batch.cu_seqlens, batch.cu_seqlens[1:]))
    lens = [int(batch.loss_mask[a:e].sum()) for a, e in segs]
    B, L = len(segs), max(lens, default=0)
    v, m, r = (values_T.new_zeros(B, L) for _ in range(3))
    for b, ((a, e), n) in enumerate(zip(segs, lens)):
        v[b, :n], m[b, :n] = values_T[e - n:e], 1.0
        if n and kl_T is not None:
            r[b, :n] = -kl_coef * kl_T[e - n:e]
            r[b, n - 1] += batch.rewards[b]
        elif n:  # a masked (over-long) response has no trained token; with every one masked L = 0
            r[b, n - 1] = batch.rewards[b]
    adv_BL, ret_BL = gae(r, v, m, gamma=gamma, lam=lam)
    adv_T, ret_T = torch.zeros_like(values_T), torch.zeros_like(values_T)
    for b, ((a, e), n) in enumerate(zip(segs, lens)):
        adv_T[e - n:e], ret_T[e - n:e] = adv_BL[b, :n], ret_BL[b, :n]
    return adv_T, ret_T


def rollout_is_stats(raw_T: torch.Tensor, valid_T: torch.Tensor, cap: float, dist: Dist) -> dict:
    """Global statistics of the untruncated rollout IS weights over the trained tokens: their mean, max
    and the fraction the cap truncates (rollout_is_mean / _max / _capped_frac)."""
    w = raw_T[valid_T].double()  # fp64 sums: the same mean however the batch is split over ranks
    n, total, capped = dist.all_sum([float(valid_T.sum()), float(w.sum()), float((w > cap).sum())])
    peak = dist.all_max([float(w.max()) if w.numel() else 0.0])[0]
    return {"rollout_is_mean": total / max(n, 1.0), "rollout_is_max": peak, "rollout_is_capped_frac": capped / max(n, 1.0)}


def grpo_kl_advantages(batch: TrainBatch, kl_T: torch.Tensor, *, coef: float, group_size: int, estimator,
                       opts) -> torch.Tensor:
    """Outcome advantages (the algorithm's estimator, e.g. GRPO's) of scores with the KL folded in
    (train.kl_in_reward): [T] on the trained tokens.

    score_b = reward_b - coef * sum_{valid t of b} kl_t (verl: the token-level rewards summed over the
    response), then estimator.fn over each run of `group_size` consecutive responses (the packing
    order of estimate_batch), broadcast over the response's valid tokens.
    """
    valid = batch.loss_mask > 0
    kl_sum_B = kl_T.new_zeros(batch.num_seqs).index_add_(0, batch.seq_ids, torch.where(valid, kl_T, 0.0))
    scores_PG = (batch.rewards.float() - coef * kl_sum_B).view(-1, group_size)
    adv_B = estimator.fn(scores_PG, opts).reshape(-1)
    return torch.where(valid, adv_B[batch.seq_ids], torch.zeros_like(batch.advantages))


# metrics of a pass that merge other than by the mean over passes
_FIRST = ("logprob_diff",)        # the engine-vs-learner gap before the update moved the weights
_MAX = ("ratio_max",)


def combine_passes(passes: list[dict]) -> dict:
    """One update's metrics from its passes (epochs x mini-batches): the mean over passes, but
    logprob_diff (the first pass's), ratio_max (the max), skipped (True only when every pass
    skipped: the weights did not move) and skipped_passes (how many did). One pass: returned as is."""
    if len(passes) == 1:
        return {**passes[0], "skipped_passes": int(passes[0]["skipped"])}
    out = {}
    for k in passes[0]:
        vals = [p[k] for p in passes]
        if k == "skipped":
            out[k] = all(vals)
        elif k in _FIRST:
            out[k] = vals[0]
        elif any(v is None for v in vals):
            out[k] = None
        elif k in _MAX:
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    out["skipped_passes"] = sum(int(p["skipped"]) for p in passes)
    return out
