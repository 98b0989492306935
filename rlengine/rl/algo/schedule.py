"""The learning rate: the batch-size rule (eta from eta0 at B0) and the schedule's factor per update.

lr_by_rule is the one definition of the paper's LR rule, eta = eta0 * (B_train / B0)^p with
p = 1/2 (sqrt), 1 (linear) or 0 (none); the job's config and the tuner both call it.
lr_factor is the schedule, a factor on that eta for each update:

factor(u) for the update with 0-based index u of U = train.updates, W = train.warmup_updates,
m = train.min_lr_ratio:
    warm-up   u < W:   (u + 1) / W                     (the first update already moves; reaches 1 at W-1)
    after     p = (u - W) / max(1, U - 1 - W)          (0 at the first update after warm-up, 1 at the last)
              constant: 1;  linear: 1 - (1 - m) p;  cosine: m + (1 - m) (1 + cos(pi p)) / 2
The factor is a pure function of the update index, so a resumed run (which restores the update
counter from its checkpoint) continues the schedule exactly where it stopped; nothing else is saved.
"""

from __future__ import annotations

import math

LR_RULE_POWERS = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def lr_by_rule(lr: float, b_train: int, b0: int, rule: str) -> float:
    """eta = lr * (b_train / b0)^p, p by `rule` (LR_RULE_POWERS); b0 = 0 means b_train (eta = lr)."""
    return lr * (b_train / (b0 or b_train)) ** LR_RULE_POWERS[rule]


def lr_factor(update: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """The multiplier of the base LR for 0-based update `update` of `total` (see the module docstring)."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, (update - warmup) / max(1, total - 1 - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {schedule!r}; constant | linear | cosine")
