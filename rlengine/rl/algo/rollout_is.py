"""Rollout importance sampling: truncated weights between the learner's and the engine's log-probs.

Sits in Learner.prepare, before the policy passes: the learner recomputes the log-probs of the
sampled tokens under the weights it is about to update (learner_old) and compares them with the
log-probs the engine sampled with (engine). Any gap (kernels, precision, top-k / top-p handling,
partial rollouts from older weights) makes the samples off-policy for the learner; the weights
    token:    w_t = min(exp(learner_old_t - engine_t), cap)
    sequence: w_t = min(exp(sum_{t' in seq} (learner_old_t' - engine_t')), cap), on each of its tokens
multiply the per-token policy loss (TIS, as verl's rollout_is / "truncated importance sampling").
They are constants (no gradient). Simplification: the log weight is clamped to +-20 before exp,
as the policy ratio is, so a far-off sequence gives a large finite weight that the cap then cuts.
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVELS = ("token", "sequence")


def rollout_is_weights(learner_old_T: Tensor, engine_T: Tensor, mask_T: Tensor, seq_ids_T: Tensor, *,
                       level: str, cap: float, log_clamp: float = 20.0) -> tuple[Tensor, Tensor]:
    """(truncated weights [T], untruncated weights [T]), fp32, detached; 1.0 on masked positions.

    learner_old_T, engine_T: [T] log-probs of the packed targets; mask_T [T] (> 0 on trained tokens);
    seq_ids_T [T] int64 sequence of each token (for level = "sequence"). No host sync.
    """
    if level not in LEVELS:
        raise ValueError(f"rollout_is level must be one of {LEVELS}, got {level!r}")
    if cap < 1.0:
        raise ValueError(f"rollout_is cap must be >= 1, got {cap}")
    valid = mask_T > 0
    log_w = torch.where(valid, learner_old_T.detach().float() - engine_T.detach().float(),
                        torch.zeros_like(engine_T, dtype=torch.float32))
    if level == "sequence":
        seq_log_w = log_w.new_zeros(log_w.shape[0]).index_add_(0, seq_ids_T, log_w)
        log_w = torch.where(valid, seq_log_w[seq_ids_T], log_w)
    raw = torch.exp(log_w.clamp(-log_clamp, log_clamp))
    return raw.clamp(max=cap), raw
