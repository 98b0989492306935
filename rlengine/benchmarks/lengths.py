"""Length distributions for benchmark prompts and responses: fixed, or ragged like a dataset.

"fixed" gives every item the mean; "uniform" draws integers in [mean/2, 3*mean/2];
"lognormal" has the long right tail of real prompt/response lengths (ShareGPT-like, sigma 0.8
by default) with the requested mean. Draws are clipped to [lo, hi] and seeded, so two
providers (or two runs) see the same lengths. Used by `rlengine bench decode` (prompt
lengths), `serve` (input and output lengths) and `asymmetry` (response lengths: the ragged
tail that d0 stands for).
"""

from __future__ import annotations

import argparse
import math
import random

LENGTH_DISTS = ("fixed", "uniform", "lognormal")


def sample_lengths(dist: str, mean: int, n: int, *, seed: int, lo: int = 1, hi: int | None = None,
                   sigma: float = 0.8) -> list[int]:
    """n integer lengths with the given mean (before clipping to [lo, hi])."""
    if dist not in LENGTH_DISTS:
        raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {dist!r}")
    if mean < 1 or n < 0:
        raise ValueError(f"sample_lengths: mean must be >= 1 and n >= 0, got mean={mean}, n={n}")
    rng = random.Random(seed)
    if dist == "fixed":
        out = [mean] * n
    elif dist == "uniform":
        out = [rng.randint(max(1, mean // 2), max(1, 3 * mean // 2)) for _ in range(n)]
    else:  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2) = mean
        mu = math.log(mean) - sigma * sigma / 2
        out = [max(1, round(rng.lognormvariate(mu, sigma))) for _ in range(n)]
    hi = hi if hi is not None else max(out, default=lo)
    return [min(hi, max(lo, x)) for x in out]


def add_length_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--length-dist", default="fixed", choices=LENGTH_DISTS,
                   help=f"distribution of {what}: fixed (all equal to the mean), uniform in [L/2, 3L/2], "
                        f"or lognormal (long tail, ShareGPT-like)")
