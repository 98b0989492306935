"""The arithmetic around the learner's gradient passes: GAE on packed responses, batch whitening, KL in
the reward, rollout correction of a packed batch and its statistics, pass metrics.

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
from rlengine.rl.algo.rollout_correction import CorrectionSpec, rollout_correction
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

    A response's trained positions are those its loss mask keeps (the last n of its packed segment; in a
    multi-turn trajectory its model tokens, observation tokens skipped as verl's multi-turn GAE skips them:
    the recursion runs over the model tokens alone); the outcome reward sits on its last trained token,
    and with kl_T (train.kl_in_reward) every token's reward also gets -kl_coef * kl_t.
    """
    segs = list(zip(batch.cu_seqlens, batch.cu_seqlens[1:]))
    pos = [a + (batch.loss_mask[a:e] > 0).nonzero().flatten() for a, e in segs]  # [n_b] trained positions
    B, L = len(segs), max((len(p) for p in pos), default=0)
    v, m, r = (values_T.new_zeros(B, L) for _ in range(3))
    for b, p in enumerate(pos):
        n = len(p)
        v[b, :n], m[b, :n] = values_T[p], 1.0
        if n and kl_T is not None:
            r[b, :n] = -kl_coef * kl_T[p]
            r[b, n - 1] += batch.rewards[b]
        elif n:  # a masked (over-long) response has no trained token; with every one masked L = 0
            r[b, n - 1] = batch.rewards[b]
    adv_BL, ret_BL = gae(r, v, m, gamma=gamma, lam=lam)
    adv_T, ret_T = torch.zeros_like(values_T), torch.zeros_like(values_T)
    for b, p in enumerate(pos):
        adv_T[p], ret_T[p] = adv_BL[b, :len(p)], ret_BL[b, :len(p)]
    return adv_T, ret_T


def rollout_is_stats(raw_T: torch.Tensor, valid_T: torch.Tensor, cap: float, dist: Dist) -> dict:
    """Global statistics of the untruncated rollout IS weights over the trained tokens: their mean, max
    and the fraction the cap truncates (rollout_is_mean / _max / _capped_frac)."""
    w = raw_T[valid_T].double()  # fp64 sums: the same mean however the batch is split over ranks
    n, total, capped = dist.all_sum([float(valid_T.sum()), float(w.sum()), float((w > cap).sum())])
    peak = dist.all_max([float(w.max()) if w.numel() else 0.0])[0]
    return {"rollout_is_mean": total / max(n, 1.0), "rollout_is_max": peak, "rollout_is_capped_frac": capped / max(n, 1.0)}


def packed_correction(batch: TrainBatch, learner_old_T: torch.Tensor, spec: CorrectionSpec, dist: Dist
                      ) -> tuple[torch.Tensor | None, torch.Tensor, dict]:
    """Rollout correction (rl/algo/rollout_correction.py) of a packed batch, global over ranks: (IS weights
    [T] fp32 or None, loss mask [T] after rejection, verl's rollout_corr/* metrics).

    Each sequence's packed segment becomes a right-padded [B, L] row (prompt positions carry mask 0, so
    the rows mean what verl's response rows mean); every rank's rows are gathered (a few floats per
    token, host objects), the correction runs on the whole batch in fp64, and this rank takes its rows
    back. No trained token anywhere: no weights, the mask as it was, no metrics."""
    cu = torch.tensor(batch.cu_seqlens, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    L = int(lens.max()) if len(lens) else 0
    L = int(dist.all_max([float(L)])[0]) if dist.enabled else L
    pos_L = torch.arange(L)
    inside_BL = pos_L[None, :] < lens[:, None]
    idx_BL = (cu[:-1, None] + pos_L[None, :]).clamp(max=max(int(cu[-1]) - 1, 0)).to(batch.loss_mask.device)
    inside = inside_BL.to(batch.loss_mask.device)
    rows = [torch.where(inside, x[idx_BL].double(), 0.0) if x.numel() else x.new_zeros(len(lens), L).double()
            for x in (learner_old_T, batch.old_logprobs, batch.loss_mask)]
    parts = dist.all_gather_objects([r.cpu() for r in rows]) if dist.enabled else [rows]
    mine = int(sum(p[0].shape[0] for p in parts[:dist.rank])) if dist.enabled else 0
    learner_BL, engine_BL, mask_BL = (torch.cat([p[i] for p in parts]).to(rows[0].device) for i in range(3))
    if not bool(mask_BL.any()):
        return None, batch.loss_mask, {}
    w_BL, keep_BL, metrics = rollout_correction(learner_BL, engine_BL, mask_BL, spec)
    own = slice(mine, mine + len(lens))
    weights = None if w_BL is None else w_BL[own][inside].float()
    return weights, keep_BL[own][inside].to(batch.loss_mask.dtype), metrics


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
