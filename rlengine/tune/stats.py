"""The statistics `rlengine tune` reports with: paired log-ratio intervals, the smallest resolvable effect,
the monotone (isotonic) fit of J against N and its J* crossing, and censoring of seeds that miss J*.

    paired_log_ratio([12, 9, 10], [10, 10, 10])   # -> Interval: geometric mean ratio, 95% t-interval
    isotonic([0.1, 0.3, 0.2, 0.5])                # -> [0.1, 0.25, 0.25, 0.5] (pool adjacent violators)
    monotone_crossing(n, j, 0.6)                  # N* on the isotonic fit, linear between evaluations
Intervals are over seeds: for paired runs a, b on the same seeds, d_s = log(a_s / b_s); the interval
is exp(mean(d) +- t_{0.975, K-1} * sd(d) / sqrt(K)). Ratios are scale-free, so logs make them
symmetric (0.8 and 1.25 are the same size of effect). The tune modules call these; no runs start here.

A t-interval holds for a number of seeds fixed in advance. Recomputed after every pair and stopped when
it looks decisive, it covers the true ratio far less often than 95% (tests/tune/test_sequential.py: below
0.90 at a per-seed sd of 0.84). The confirmation therefore adds pairs under a confidence sequence
(log_confidence_sequence): an interval that holds at every number of pairs at once, so stopping on it
whenever it is decisive keeps its 95%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rlengine.analysis.isotonic import isotonic, monotone_crossing

__all__ = ["CS_METHOD", "Interval", "censored_n", "isotonic", "log_confidence_sequence", "log_interval",
           "monotone_crossing", "paired_log_ratio", "repeat_spread", "sequential_verdict", "t975"]

# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30 (standard table values)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """t_{0.975, df}; beyond the table the normal quantile with the first Cornish-Fisher term."""
    if df < 1:
        raise ValueError(f"t975 needs df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df)


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A ratio with its 95% interval over K paired seeds (lo = hi = None with one seed)."""

    ratio: float                 # exp(mean of per-seed log ratios): the geometric mean ratio
    lo: float | None
    hi: float | None
    k: int                       # seeds in the pairing
    sd_log: float | None         # sample sd of the per-seed log ratios
    resolvable: float | None     # smallest effect the interval can tell from none: exp(half-width) - 1
    method: str = "t-interval"   # how lo / hi were made: t-interval | confidence sequence (see CS_METHOD)

    def text(self, fmt: str = "{:.2f}") -> str:
        if self.lo is None:
            return f"{fmt.format(self.ratio)} (1 seed, no interval)"
        return f"{fmt.format(self.ratio)} [{fmt.format(self.lo)}, {fmt.format(self.hi)}]"


def paired_log_ratio(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    """a_s / b_s over paired seeds (same order): geometric mean and 95% t-interval; None when empty."""
    if len(a) != len(b):
        raise ValueError(f"paired_log_ratio: {len(a)} values against {len(b)}; pair them seed by seed")
    if any(x <= 0 for x in list(a) + list(b)):
        raise ValueError(f"paired_log_ratio needs positive values, got {list(a)}, {list(b)}")
    d = [math.log(x / y) for x, y in zip(a, b)]
    return log_interval(d)


def log_interval(d: Sequence[float]) -> Interval | None:
    """The Interval of per-seed log ratios d."""
    k = len(d)
    if k == 0:
        return None
    m = sum(d) / k
    if k == 1:
        return Interval(ratio=math.exp(m), lo=None, hi=None, k=1, sd_log=None, resolvable=None)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (k - 1))
    half = t975(k - 1) * sd / math.sqrt(k)
    return Interval(ratio=math.exp(m), lo=math.exp(m - half), hi=math.exp(m + half), k=k, sd_log=sd,
                    resolvable=math.exp(half) - 1)


def censored_n(hits: Sequence[float | None], budgets: Sequence[float]) -> list[tuple[float, bool]]:
    """(N*, reached) per seed with a miss censored at its budget: N* > N_max is recorded as N_max
    with reached False, so every ratio that uses it is a bound in one direction (never dropped)."""
    return [(h, True) if h is not None else (float(b), False) for h, b in zip(hits, budgets)]


def repeat_spread(values: Sequence[float]) -> float:
    """Relative spread of repeated probes of one point: (max - min) / mean (0 with one value)."""
    if not values:
        raise ValueError("repeat_spread: no values")
    m = sum(values) / len(values)
    return (max(values) - min(values)) / m if len(values) > 1 and m > 0 else 0.0



def faster_per_seed(t_c: Sequence[float | None], t_d: Sequence[float | None], end_c: Sequence[float],
                    end_d: Sequence[float]) -> list[bool | None]:
    """Per confirmation seed: True when the chosen run reached J* sooner, False when later, None when
    the order is unknown. A run that missed J* has T* > its T at its last update (end_*), so it is
    later than the other run when that one reached J* before the missed run stopped; when both
    missed, the order is unknown."""
    out: list[bool | None] = []
    for c, d, ec, ed in zip(t_c, t_d, end_c, end_d):
        if c is not None and d is not None:
            out.append(c < d if c != d else None)
        elif c is not None:
            out.append(True if c < ed else None)
        elif d is not None:
            out.append(False if d < ec else None)
        else:
            out.append(None)
    return out


def sign_test_p(k: int, n: int) -> float:
    """Two-sided exact sign test: P(a split at least as uneven as k of n | each side 1/2)."""
    import math

    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(max(k, n - k), n + 1)) / 2 ** n
    return min(1.0, 2 * tail)


CS_MIX = 1.0  # c^2: the standardised effect delta = mu / sigma is mixed over N(0, 1 / c^2); near-narrowest at 10-30 pairs
CS_METHOD = ("95% confidence sequence for the mean log ratio (scale-invariant t-mixture, Lai 1976; normal log "
             "ratios, unknown sd, c^2 = 1): valid at every number of pairs at once, so pairs may be added until it "
             "is decisive")


def log_confidence_sequence(d: Sequence[float], alpha: float = 0.05, c2: float = CS_MIX) -> Interval | None:
    """The confidence sequence on the mean of normal log ratios d (unknown sd) after len(d) pairs.

    Under mean mu, M_n(mu) = sqrt(c2 / (n + c2)) * (S / (S - T^2 / (n + c2)))^(n/2), with T and S the sum
    and the sum of squares of d - mu, is the Bayes factor of the scale-invariant statistic (right-Haar prior
    on sigma, N(0, 1/c2) on mu'/sigma): a nonnegative martingale with M_1 = 1, so by Ville's inequality
    P(M_n(mu) >= 1/alpha for some n) <= alpha. The set {mu : M_n(mu) < 1/alpha} is, with d_bar and
    Q = sum (d - d_bar)^2, d_bar +- sqrt(rho (n + c2) Q / (n (n - rho (n + c2)))), rho = 1 - exp(-2 L / n),
    L = log(1/alpha) + log((n + c2) / c2) / 2; unbounded (lo = hi = None) while rho (n + c2) >= n.
    """
    n = len(d)
    if n == 0:
        return None
    m = sum(d) / n
    if n == 1:
        return Interval(ratio=math.exp(m), lo=None, hi=None, k=1, sd_log=None, resolvable=None, method="confidence sequence")
    q = sum((x - m) ** 2 for x in d)
    big_l = math.log(1 / alpha) + 0.5 * math.log((n + c2) / c2)
    rho = 1 - math.exp(-2 * big_l / n)
    sd = math.sqrt(q / (n - 1))
    if rho * (n + c2) >= n:
        return Interval(ratio=math.exp(m), lo=None, hi=None, k=n, sd_log=sd, resolvable=None, method="confidence sequence")
    half = math.sqrt(rho * (n + c2) * q / (n * (n - rho * (n + c2))))
    return Interval(ratio=math.exp(m), lo=math.exp(m - half), hi=math.exp(m + half), k=n, sd_log=sd,
                    resolvable=math.exp(half) - 1, method="confidence sequence")


def sequential_verdict(ci: Interval | None, min_effect: float = 0.1) -> str | None:
    """When a sequential confirmation can stop: "faster" / "slower" (the interval on the ratio excludes 1),
    "below min effect" (it lies inside [1 / (1 + min_effect), 1 + min_effect]: any effect is too small to
    report), or None (go on)."""
    if ci is None or ci.lo is None:
        return None
    if ci.hi < 1:
        return "faster"
    if ci.lo > 1:
        return "slower"
    if 1 / (1 + min_effect) <= ci.lo and ci.hi <= 1 + min_effect:
        return "below min effect"
    return None
