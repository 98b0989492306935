"""Gradient-norm proxy (docs/METHOD.md): actor grad norm ~ B^-1/2 while gradient noise dominates.

Each stage-1 run contributes its mean actor grad norm (before clipping) over a common N window,
so every batch size is averaged over the same stretch of training. The log-log slope against
B_train is fitted by least squares once per seed (the spread over seeds is the uncertainty) and
once on the seed means. Only sqrt-rule candidates enter (a fixed-LR control changes the policy
trajectory, not just the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rlengine.tune.curves import mean_sd
from rlengine.tune.stage_records import CandidateStats


@dataclass(frozen=True, slots=True, kw_only=True)
class SlopeFit:
    """log(grad norm) = a + slope * log(B_train) over a set of batch sizes."""

    batches: tuple[int, ...]             # B_train values fitted
    slope_of_means: float | None         # fit to the seed-mean grad norms
    slopes: tuple[float, ...]            # [K] one fit per seed
    slope_mean: float | None
    slope_sd: float | None
    ratios: tuple[float, ...]            # seed-mean grad-norm ratio per doubling between neighbouring B_train
                                         # (B^-1/2 gives 0.707; the paper's flattening past B_crit 0.823)


def log_log_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (>= 2 distinct x, all values > 0)."""
    if len(x) != len(y) or len(set(x)) < 2 or any(v <= 0 for v in list(x) + list(y)):
        raise ValueError(f"log_log_slope needs >= 2 distinct positive x and positive y, got {x}, {y}")
    lx, ly = [math.log(v) for v in x], [math.log(v) for v in y]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def grad_norm_slope(candidates: Sequence[CandidateStats]) -> SlopeFit:
    """Slope fits over `candidates` (one per B_train, sqrt rule, the same seeds in each)."""
    cands = sorted((c for c in candidates if c.lr_rule != "none" and c.b_gen == c.b_train
                    and c.stage not in ("retune", "control")), key=lambda c: c.b_train)
    batches = tuple(c.b_train for c in cands)
    if len(set(batches)) < 2:
        return SlopeFit(batches=batches, slope_of_means=None, slopes=(), slope_mean=None, slope_sd=None, ratios=())
    seeds = sorted(set.intersection(*(set(c.seeds) for c in cands)))
    slopes = []
    for s in seeds:
        g = [c.grad_norm[c.seeds.index(s)] for c in cands]
        slopes.append(log_log_slope(batches, g))
    means = [sum(c.grad_norm) / len(c.grad_norm) for c in cands]
    slope = log_log_slope(batches, means)
    m, sd = mean_sd(slopes)
    ratios = tuple((g2 / g1) ** (1 / math.log2(b2 / b1))
                   for (b1, g1), (b2, g2) in zip(zip(batches, means), zip(batches[1:], means[1:])))
    return SlopeFit(batches=batches, slope_of_means=slope, slopes=tuple(slopes), slope_mean=m, slope_sd=sd,
                    ratios=ratios)
