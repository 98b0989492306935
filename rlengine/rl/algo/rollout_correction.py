"""Rollout correction in one call: importance weights, rejection masks and the mismatch metrics between
the learner's and the engine's log-probs (verl 0.9.1's compute_rollout_correction_and_rejection_mask
and compute_offpolicy_metrics, under verl's metric names with its "rollout_corr/" prefix).

Sits in Learner.prepare (learner/update.py lays the packed batch out as [B, L] rows, global over
ranks): weights (rollout_is.py) multiply the loss, the rejection mask (rollout_rs.py) multiplies the
loss mask, and the metrics go into the update's row. The mismatch metrics:
    kl = E[engine - learner], k3_kl = E[r - 1 - log r]          per trained token (r = learner / engine)
    training_ppl / rollout_ppl = mean over sequences of exp(-mean token log-prob), and their logs
    log_ppl_diff (mean, |.| mean, max, min) and ppl_ratio over sequences
    chi2_token = E[r^2] - 1, chi2_seq = mean over sequences of exp(2 sum log r) - 1 (clamped at +-20)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlengine.rl.algo.rollout_is import SAFETY_BOUND, _mmean, is_weights_BT, parse_threshold
from rlengine.rl.algo.rollout_rs import parse_criteria, rejection_mask_BT


@dataclass(frozen=True, slots=True)
class CorrectionSpec:
    """What train.rollout_is* / rollout_rs* resolve to (from_options checks and parses them once)."""

    level: str | None                 # "token" | "sequence" | None (no IS weights)
    upper: float                      # the IS threshold's upper bound (TIS truncation, or IcePop's band)
    lower: float | None               # IcePop's lower bound; None = truncate at upper (TIS)
    batch_normalize: bool
    criteria: tuple = ()              # parse_criteria's list; () = no rejection

    @property
    def enabled(self) -> bool:
        return self.level is not None or bool(self.criteria)

    @staticmethod
    def from_options(opts) -> "CorrectionSpec":
        """From train.* (UpdateOptions); ValueError naming the problem for a bad specification."""
        level = None if opts.rollout_is == "none" else opts.rollout_is
        upper, lower = parse_threshold(opts.rollout_is_threshold or opts.rollout_is_cap)
        criteria = tuple(parse_criteria(opts.rollout_rs, opts.rollout_rs_threshold)) if opts.rollout_rs else ()
        return CorrectionSpec(level, upper, lower, opts.rollout_is_batch_normalize, criteria)


def offpolicy_metrics(learner_BL: Tensor, engine_BL: Tensor, mask_BL: Tensor) -> dict[str, float]:
    """verl's compute_offpolicy_metrics (the module docstring) over [B, L] rows; host syncs."""
    out: dict[str, float] = {}
    mean_train, mean_roll = _mmean(learner_BL, mask_BL, -1), _mmean(engine_BL, mask_BL, -1)
    out["training_ppl"] = torch.exp(-mean_train).mean().item()
    out["training_log_ppl"] = (-mean_train).mean().item()
    out["kl"] = _mmean(engine_BL - learner_BL, mask_BL).item()
    log_r = learner_BL - engine_BL
    out["k3_kl"] = _mmean(torch.exp(log_r) - log_r - 1, mask_BL).item()
    out["rollout_ppl"] = torch.exp(-mean_roll).mean().item()
    out["rollout_log_ppl"] = (-mean_roll).mean().item()
    diff = mean_roll - mean_train
    out["log_ppl_diff"] = diff.mean().item()
    out["log_ppl_abs_diff"] = diff.abs().mean().item()
    out["log_ppl_diff_max"] = diff.max().item()
    out["log_ppl_diff_min"] = diff.min().item()
    out["ppl_ratio"] = torch.exp(diff).mean().item()
    out["chi2_token"] = (_mmean(torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask_BL) - 1.0).item()
    seq_sum = (torch.where(mask_BL.bool(), log_r, 0.0) * mask_BL).sum(-1)
    out["chi2_seq"] = (torch.exp(2.0 * seq_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0).item()
    return out


def rollout_correction(learner_BL: Tensor, engine_BL: Tensor, mask_BL: Tensor, spec: CorrectionSpec
                       ) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(IS weights [B, L] or None, loss mask [B, L] after rejection, metrics "rollout_corr/<verl name>").

    learner_BL: the learner's pre-update log-probs, engine_BL: the engine's, mask_BL: 1 on trained
    tokens, [B, L] right-padded rows with at least one trained token. Computes in the inputs' dtype."""
    if not bool(mask_BL.any()):
        raise ValueError("rollout correction needs at least one trained token")
    log_ratio = learner_BL - engine_BL
    metrics: dict[str, float] = {}
    weights = None
    if spec.level is not None:
        weights, m = is_weights_BT(log_ratio, mask_BL, level=spec.level, upper=spec.upper, lower=spec.lower,
                                   batch_normalize=spec.batch_normalize)
        metrics.update(m)
    mask = mask_BL.clone()
    if spec.criteria:
        mask, m = rejection_mask_BT(log_ratio, mask_BL, list(spec.criteria))
        metrics.update(m)
    metrics.update(offpolicy_metrics(learner_BL, engine_BL, mask_BL))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
