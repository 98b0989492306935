"""Every registered policy loss passes torch.autograd.gradcheck in float64 (analytic gradient = finite
differences of the loss value) on packed tokens with masked positions, token-level advantages of both
signs and ratios spread around 1. Inputs are random, so no point sits on a clip boundary or a kink.
clip_cov keeps every candidate (clip_cov_ratio = 1) so the selection does not change between calls.
Losses whose gradient is defined through a stop-gradient factor (gspo's sequence ratio, cispo's and
dppo's truncated IS weight) are checked where that factor is locally constant, as the surrogate
treats it: one-token sequences for gspo, every ratio outside a tiny clip range for cispo, every ratio
above the truncation for dppo; elsewhere the loss VALUE is not the gradient's antiderivative, by design.
"""

import pytest
import torch

from rlengine.rl.algo.registry import POLICY_LOSSES

OPTIONS = {"dro": {"dro_beta": 0.3}, "clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.1},
           "kl_cov": {"kl_cov_ratio": 0.3}, "cispo": {"clip_low": 1e-4, "clip_high": 1e-4},
           "dppo_tv": {"clip_ratio_c": 0.01}, "dppo_kl": {"clip_ratio_c": 0.01}}


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_gradcheck(name):
    g = torch.Generator().manual_seed(11)
    T = 14
    old = (torch.rand(T, generator=g, dtype=torch.float64) * 0.8 + 0.1).log()
    logp = (old + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).clamp(max=-0.01).requires_grad_(True)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) > 0.25).double()
    seq_ids = torch.arange(T) if name == "gspo" else torch.tensor([0] * 5 + [1] * 4 + [2] * 5)
    loss = POLICY_LOSSES[name]

    def f(lp):
        kw = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0, **OPTIONS.get(name, {})}
        return loss.fn(lp, old, adv, mask, seq_ids, **kw)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-8)
