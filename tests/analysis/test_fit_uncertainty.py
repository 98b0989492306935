"""Uncertainty of the d0, d1, gamma fits: standard errors against the matrix form of least squares
(s^2 (X^T X)^-1, computed independently with torch.linalg), and bootstrap intervals."""

import random

import pytest
import torch

from rlengine.analysis.fits import bootstrap_fits, fit_generation_time, fit_training_time

B = [8, 8, 16, 16, 32, 32, 64, 64]
T_GEN = [0.52, 0.47, 0.61, 0.66, 0.88, 0.83, 1.27, 1.21]


def _ols_se(X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    beta = torch.linalg.solve(X.T @ X, X.T @ y)
    resid = y - X @ beta
    s2 = (resid @ resid) / (X.shape[0] - X.shape[1])
    return beta, torch.sqrt(torch.diag(s2 * torch.linalg.inv(X.T @ X)))


def test_linear_fit_standard_errors_match_matrix_form():
    x, y = torch.tensor(B, dtype=torch.float64), torch.tensor(T_GEN, dtype=torch.float64)
    beta, se = _ols_se(torch.stack([torch.ones_like(x), x], 1), y)
    fit = fit_generation_time(B, T_GEN)
    assert (fit.d0, fit.d1) == pytest.approx(beta.tolist(), rel=1e-9)
    assert (fit.d0_se, fit.d1_se) == pytest.approx(se.tolist(), rel=1e-9)
    two = fit_generation_time([8, 16], [0.5, 0.6])   # no residual degrees of freedom
    assert two.d0_se is None and two.d1_se is None


def test_proportional_fit_standard_error_matches_matrix_form():
    x, y = torch.tensor(B, dtype=torch.float64), 0.06 * torch.tensor(B, dtype=torch.float64) * torch.tensor(
        [1.0, 1.05, 0.97, 1.02, 0.99, 1.01, 0.98, 1.03], dtype=torch.float64)
    beta, se = _ols_se(x[:, None], y)
    fit = fit_training_time(B, y.tolist())
    assert fit.gamma == pytest.approx(beta.item(), rel=1e-9) and fit.gamma_se == pytest.approx(se.item(), rel=1e-9)
    assert fit_training_time([8], [0.5]).gamma_se is None


def test_bootstrap_intervals():
    rng = random.Random(1)
    bs = [b for b in (8, 16, 32, 64) for _ in range(4)]
    noisy = [0.4 + 0.01 * b + rng.gauss(0, 0.02) for b in bs]
    train = [0.06 * b * (1 + rng.gauss(0, 0.03)) for b in bs]
    iv = bootstrap_fits(bs, noisy, train, resamples=400, seed=3)
    fit = fit_generation_time(bs, noisy)
    assert iv.d0[0] < fit.d0 < iv.d0[1] and iv.d1[0] < fit.d1 < iv.d1[1] and iv.gamma[0] < 0.06 < iv.gamma[1]
    assert iv == bootstrap_fits(bs, noisy, train, resamples=400, seed=3)         # deterministic per seed
    exact = bootstrap_fits(bs, [0.4 + 0.01 * b for b in bs], [0.06 * b for b in bs], resamples=50)
    assert exact.d0 == pytest.approx((0.4, 0.4)) and exact.gamma == pytest.approx((0.06, 0.06))
    # a planted bug check: intervals widen with the noise
    wider = bootstrap_fits(bs, [t + rng.gauss(0, 0.2) for t in noisy], train, resamples=400, seed=3)
    assert wider.d1[1] - wider.d1[0] > iv.d1[1] - iv.d1[0]
    with pytest.raises(ValueError, match=">= 3 observations"):
        bootstrap_fits([8, 16], [0.5, 0.6], [0.5, 1.0])
