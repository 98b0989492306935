"""The learner's metrics of one gradient pass, as a typed record.

A pass adds each micro-batch's terms into PassSums; reduce() makes them global (one all-reduce of
the sums, one all-max of the ratio's max) and normalised (log-prob gap and entropy per trained
token), and as_dict() hands the record to Learner.step's callers under rlengine's names; the trainer
adds verl's names in one place (rl/trainer/verl_metrics.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlengine.rl.distributed import Dist

POLICY_STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean")


@dataclass(slots=True)
class PassSums:
    """Sums over one pass's micro-batches (this rank's until reduce())."""

    clip_frac: float = 0.0              # policy-loss statistics, each weighted by the micro-batch's token share
    clip_frac_low: float = 0.0
    clip_frac_high: float = 0.0
    clip_frac_dual: float = 0.0
    approx_kl: float = 0.0
    ratio_mean: float = 0.0
    entropy: float = 0.0                # sum over trained tokens (a mean after reduce)
    kl_ref: float = 0.0                 # the KL term (train.kl_coef)
    logprob_diff: float = 0.0           # sum over trained tokens of |learner - engine| (a mean after reduce)
    loss: float = 0.0
    pg_loss: float = 0.0
    value_loss: float = 0.0
    routing_disagreement: float = 0.0   # MoE replay: the share of routing choices the learner made differently
    ratio_max: float = 0.0              # a max, not a sum

    def add_policy_stats(self, stats: dict, weight: float) -> None:
        """The policy loss's statistics of one micro-batch (clip fractions, approx KL, ratio mean)."""
        for k in POLICY_STATS:
            setattr(self, k, getattr(self, k) + float(stats[k]) * weight)

    def reduce(self, dist: Dist, trained_tokens: float) -> dict:
        """Global values over all ranks, the per-token means divided by `trained_tokens`."""
        keys = [f.name for f in dataclasses.fields(self) if f.name != "ratio_max"]
        out = dict(zip(keys, dist.all_sum([getattr(self, k) for k in keys])))
        out["ratio_max"] = dist.all_max([self.ratio_max])[0]
        out["logprob_diff"] /= trained_tokens
        out["entropy"] /= trained_tokens
        return out
