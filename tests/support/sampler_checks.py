"""Pearson chi-square check of drawn tokens against a target distribution, shared by the sampler's CPU
tests (tests/engine/test_sampler.py, where the approximation below is checked against tables) and its
GPU tier. The critical value is the Wilson-Hilferty approximation of the chi-square quantile."""

import math

import torch

Z_999 = 3.0902  # standard normal quantile at 1 - 1e-3


def chi2_critical(dof: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile with `dof` degrees of freedom."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_matches_distribution(tokens: torch.Tensor, target_V: torch.Tensor) -> None:
    """Pearson chi-square of the drawn tokens against `target_V` (zeros must never be drawn)."""
    counts = torch.bincount(tokens, minlength=target_V.numel()).double()
    support = target_V > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the target's support: {counts[~support]}"
    if support.sum() == 1:
        return  # a single allowed token: the support check above is the whole test
    expected = target_V[support].double() * tokens.numel()
    observed = counts[support]
    # pool the bins expected to get fewer than 5 draws into one (the chi-square approximation needs >= 5)
    small = expected < 5
    if small.any():
        order = expected.argsort()
        rest = small.clone()
        if expected[small].sum() < 5:  # still too small: fold in the smallest regular bin
            rest[order[int(small.sum())]] = True
        expected = torch.cat([expected[~rest], expected[rest].sum()[None]])
        observed = torch.cat([observed[~rest], observed[rest].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum().item()
    dof = expected.numel() - 1
    if dof == 0:
        return
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} over {dof} dof exceeds {chi2_critical(dof):.1f}"


def random_logits(V: int, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale
