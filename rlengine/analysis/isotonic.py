"""Isotonic (monotone nondecreasing) least-squares fit by pool adjacent violators, and where it crosses a level.

    isotonic([0.1, 0.3, 0.2, 0.5])            # -> [0.1, 0.25, 0.25, 0.5]
    monotone_crossing(n, j, 0.6)              # N* of a noisy J(N) curve on its monotone fit
rlengine.tune finds N* (samples to a target J) this way, and rlengine.plots.tune marks the same N*.
"""

from __future__ import annotations

from typing import Sequence


def isotonic(y: Sequence[float], w: Sequence[float] | None = None) -> list[float]:
    """The nondecreasing least-squares fit to y (weights w, default 1): pool adjacent violators."""
    w = [1.0] * len(y) if w is None else list(w)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, wt in zip(y, w):
        blocks.append([float(v), float(wt), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for m, _, c in blocks:
        out += [m] * c
    return out


def monotone_crossing(n: Sequence[float], j: Sequence[float], target: float) -> float | None:
    """N* where the isotonic fit of J against N first reaches target (linear between evaluations);
    None when the fit never reaches it (the seed is censored at its budget)."""
    if len(n) != len(j) or not n:
        raise ValueError("monotone_crossing needs matching, non-empty N and J")
    fit = isotonic(j)
    if fit[0] >= target:
        return float(n[0])
    for i in range(1, len(fit)):
        if fit[i] >= target:
            lo, hi = fit[i - 1], fit[i]
            return n[i - 1] + (target - lo) / (hi - lo) * (n[i] - n[i - 1])
    return None
