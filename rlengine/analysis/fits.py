"""Fits of the docs/METHOD.md cost model and the critical batch sizes.

Generation:  t_gen(B) ~= d0 + d1*B   (ordinary least squares; d0 is the fixed cost of a boundary's
             ragged tail and prefill, d1 the marginal cost of one more response)
Training:    t_train(B) ~= gamma*B   (least squares through the origin)
Critical generation batch: smallest B with q_gen(B) >= (1 - delta) * max q_gen.
Critical training batch (McCandlish): smallest B whose update efficiency 1/K*(B) is at least half
the best in the sweep; `fit_mccandlish` fits K*(B) = K*_min (1 + B_crit/B), linear in 1/B.
Uncertainty: every fit carries ordinary least-squares standard errors (None when the sweep has
no residual degrees of freedom), and `bootstrap_fits` gives percentile intervals for d0, d1 and
gamma by resampling the individual repetitions (case resampling), which needs no normality.
Inputs are sweeps (lists of batch sizes and measurements); bad sweeps raise ValueError naming
the problem rather than returning a fit that means nothing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class LinearFit:
    """t = d0 + d1*B."""

    d0: float                  # intercept, seconds
    d1: float                  # slope, seconds per response
    r2: float                  # coefficient of determination (1.0 for an exact fit)
    d0_se: float | None = None  # standard error of d0 (None with fewer than 3 points: no residual dof)
    d1_se: float | None = None  # standard error of d1


@dataclass(frozen=True, slots=True)
class ProportionalFit:
    """t = gamma*B."""

    gamma: float                   # seconds per response
    r2: float | None               # 1 - SS_res/SS_tot around the mean; None with fewer than 2 distinct B
    gamma_se: float | None = None  # standard error of gamma (None with a single point)


@dataclass(frozen=True, slots=True)
class McCandlishFit:
    """K*(B) = k_min * (1 + b_crit / B)."""

    k_min: float    # updates to target at infinite batch
    b_crit: float   # critical batch (where K* = 2 * k_min)
    r2: float


def _sweep(batches: Sequence[float], values: Sequence[float], what: str, min_distinct: int) -> tuple[list, list]:
    b, v = [float(x) for x in batches], [float(x) for x in values]
    if not b:
        raise ValueError(f"{what}: the sweep is empty")
    if len(b) != len(v):
        raise ValueError(f"{what}: {len(b)} batch sizes but {len(v)} measurements")
    if any(not x > 0 for x in b):
        raise ValueError(f"{what}: batch sizes must be > 0, got {batches}")
    if any(not x > 0 for x in v):
        raise ValueError(f"{what}: measurements must be > 0, got {values}")
    if len(set(b)) < min_distinct:
        raise ValueError(f"{what}: needs at least {min_distinct} distinct batch sizes, got {sorted(set(b))}")
    return b, v


def _r2(y: list[float], pred: list[float]) -> float:
    mean = sum(y) / len(y)
    ss_tot = sum((a - mean) ** 2 for a in y)
    ss_res = sum((a - p) ** 2 for a, p in zip(y, pred))
    if ss_tot == 0:
        return 1.0 if ss_res == 0 else 0.0
    return 1.0 - ss_res / ss_tot


def _line(x: list[float], y: list[float]) -> tuple[float, float, float]:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    icpt = my - slope * mx
    return icpt, slope, _r2(y, [icpt + slope * a for a in x])


def _line_se(x: list[float], y: list[float], icpt: float, slope: float) -> tuple[float | None, float | None]:
    """OLS standard errors of (intercept, slope): s^2 = SS_res / (n - 2)."""
    n = len(x)
    if n < 3:
        return None, None
    mx = sum(x) / n
    sxx = sum((a - mx) ** 2 for a in x)
    s2 = sum((b - icpt - slope * a) ** 2 for a, b in zip(x, y)) / (n - 2)
    return math.sqrt(s2 * (1 / n + mx * mx / sxx)), math.sqrt(s2 / sxx)


def fit_generation_time(batches: Sequence[float], t_gen: Sequence[float]) -> LinearFit:
    """Least-squares t_gen = d0 + d1*B over >= 2 distinct B; times in seconds, > 0.

    Repetitions may be passed as repeated batch sizes; with >= 3 points the fit has standard errors.
    """
    b, t = _sweep(batches, t_gen, "fit_generation_time", 2)
    icpt, slope, r2 = _line(b, t)
    return LinearFit(icpt, slope, r2, *_line_se(b, t, icpt, slope))


def fit_training_time(batches: Sequence[float], t_train: Sequence[float]) -> ProportionalFit:
    """Least-squares t_train = gamma*B through the origin over >= 1 batch size; times > 0."""
    b, t = _sweep(batches, t_train, "fit_training_time", 1)
    sxx = sum(x * x for x in b)
    gamma = sum(x * y for x, y in zip(b, t)) / sxx
    se = None
    if len(b) >= 2:  # one free parameter: s^2 = SS_res / (n - 1)
        se = math.sqrt(sum((y - gamma * x) ** 2 for x, y in zip(b, t)) / (len(b) - 1) / sxx)
    return ProportionalFit(gamma, _r2(t, [gamma * x for x in b]) if len(set(b)) >= 2 else None, se)


@dataclass(frozen=True, slots=True)
class FitIntervals:
    """Bootstrap percentile intervals (lo, hi) at `level`, from `resamples` refits."""

    d0: tuple[float, float]      # seconds
    d1: tuple[float, float]      # seconds per response
    gamma: tuple[float, float]   # seconds per response
    level: float                 # e.g. 0.9 for a 90% interval
    resamples: int               # refits that had >= 2 distinct B (degenerate draws are redrawn)


def bootstrap_fits(batches: Sequence[float], t_gen: Sequence[float], t_train: Sequence[float], *,
                   resamples: int = 1000, level: float = 0.9, seed: int = 0) -> FitIntervals:
    """Percentile intervals of d0, d1 (t_gen fit) and gamma (t_train fit) by case resampling.

    One entry per repetition: batches[i] with its t_gen[i] and t_train[i] (pass every repetition,
    not medians). Needs >= 3 observations over >= 2 distinct B. Deterministic for a given seed.
    """
    b, tg = _sweep(batches, t_gen, "bootstrap_fits", 2)
    _, tt = _sweep(batches, t_train, "bootstrap_fits", 2)
    if len(b) < 3:
        raise ValueError(f"bootstrap_fits: needs >= 3 observations, got {len(b)}")
    if not 0 < level < 1 or resamples < 10:
        raise ValueError(f"bootstrap_fits: level must be in (0, 1) and resamples >= 10, got {level}, {resamples}")
    rng = random.Random(seed)
    d0s, d1s, gammas = [], [], []
    while len(d0s) < resamples:
        idx = [rng.randrange(len(b)) for _ in b]
        xs = [b[i] for i in idx]
        if len(set(xs)) < 2:
            continue
        icpt, slope, _ = _line(xs, [tg[i] for i in idx])
        d0s.append(icpt)
        d1s.append(slope)
        gammas.append(sum(x * tt[i] for x, i in zip(xs, idx)) / sum(x * x for x in xs))

    def interval(v: list[float]) -> tuple[float, float]:
        v = sorted(v)
        lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
        return v[int(lo * (len(v) - 1))], v[int(math.ceil(hi * (len(v) - 1)))]

    return FitIntervals(interval(d0s), interval(d1s), interval(gammas), level, resamples)


def critical_generation_batch(batches: Sequence[float], q_gen: Sequence[float], delta: float) -> float:
    """Smallest B with q_gen(B) >= (1 - delta) * max q_gen; delta in (0, 1), >= 2 distinct B.

    The comparison allows a relative 1e-12 so a throughput exactly on the threshold qualifies
    despite rounding in (1 - delta) * q_max.
    """
    if not 0 < delta < 1:
        raise ValueError(f"critical_generation_batch: delta must be in (0, 1), got {delta}")
    b, q = _sweep(batches, q_gen, "critical_generation_batch", 2)
    threshold = (1 - delta) * max(q) * (1 - 1e-12)
    return min(x for x, y in zip(b, q) if y >= threshold)


def critical_training_batch(batches: Sequence[float], k_star: Sequence[float]) -> float:
    """Smallest B whose update efficiency 1/K*(B) is at least half the best in the sweep."""
    b, k = _sweep(batches, k_star, "critical_training_batch", 2)
    best = max(1.0 / x for x in k)
    return min(x for x, y in zip(b, k) if 1.0 / y >= 0.5 * best * (1 - 1e-12))


def fit_mccandlish(batches: Sequence[float], k_star: Sequence[float]) -> McCandlishFit:
    """Fit K* = k_min + (k_min*b_crit) * (1/B) by least squares in 1/B; >= 2 distinct B."""
    b, k = _sweep(batches, k_star, "fit_mccandlish", 2)
    icpt, slope, r2 = _line([1.0 / x for x in b], k)
    if icpt <= 0:
        raise ValueError(f"fit_mccandlish: fitted K*_min = {icpt:.4g} <= 0; the sweep does not follow "
                         f"K* = K*_min (1 + B_crit/B)")
    return McCandlishFit(icpt, slope / icpt, r2)
