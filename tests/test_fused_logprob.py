"""Fused log-prob kernel vs the plain-torch oracle (full logits + log_softmax), under TRITON_INTERPRET.

Values, entropy and the gradients w.r.t. h and W with one shared random upstream gradient on
both outputs. Tiles are pinned small (BLOCK_M=16, BLOCK_N=32, BLOCK_K=16) so the odd sizes
below cross block edges; bf16 is left to the GPU tier (the interpreter gets it wrong).
"""

import math

import pytest
import torch
from conftest import tol
from rlengine.kernels.fused_logprob import LogProbConfig, fused_logprob, fused_logprob_ref


def _cfg(num_splits: int) -> LogProbConfig:
    return LogProbConfig(block_m=16, block_n=32, block_k=16, num_splits=num_splits, group_m=2,
                         num_warps=4, num_stages=1)


def _inputs(T, C, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, C, generator=g).to(dtype).requires_grad_()
    # Scale so that softmaxes are neither flat nor one-hot: gradients exercise every term.
    w = (torch.randn(V, C, generator=g) * (1.5 / math.sqrt(C))).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return h, w, targets, g


def _compare(h, w, targets, g, temperature, config, dtype):
    T = h.shape[0]
    g_logp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    logp, ent = fused_logprob(h, w, targets, temperature=temperature, return_entropy=True, config=config)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (T,)
    dh, dw = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))
    logp_r, ent_r = fused_logprob_ref(h, w, targets, temperature=temperature, return_entropy=True)
    dh_r, dw_r = torch.autograd.grad((logp_r * g_logp).sum() + (ent_r * g_ent).sum(), (h, w))
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    for name, got, want in (("logp", logp, logp_r), ("entropy", ent, ent_r), ("grad_h", dh, dh_r),
                            ("grad_w", dw, dw_r)):
        torch.testing.assert_close(got.float(), want.float(), **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")


CASES = [
    # (T, C, V, temperature, num_splits): the code path each one covers
    pytest.param(1, 16, 97, 1.0, 1, id="T=1,V=97-odd-vocab-tail"),
    pytest.param(13, 32, 97, 0.7, 1, id="T<BLOCK_M,temp0.7"),
    pytest.param(24, 32, 257, 1.3, 3, id="T-not-multiple-of-BLOCK_M,V=257,3-vocab-splits"),
    pytest.param(20, 24, 300, 1.0, 2, id="C-not-multiple-of-BLOCK_K,2-splits"),
    pytest.param(17, 32, 64, 1.0, 0, id="V-multiple-of-BLOCK_N,auto-splits"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,C,V,temperature,num_splits", CASES)
def test_matches_reference(T, C, V, temperature, num_splits, dtype):
    h, w, targets, g = _inputs(T, C, V, dtype, seed=T * 1000 + V)
    _compare(h, w, targets, g, temperature, _cfg(num_splits), dtype)


def test_default_config_and_strided_inputs():
    """config=None (interpreter default tiles); h a column slice, W a transposed view."""
    T, C, V = 19, 24, 150
    h_big, _, targets, g = _inputs(T, 2 * C, V, torch.float32, seed=7)
    h = h_big.detach()[:, 5:5 + C].requires_grad_()   # stride (2C, 1)
    w = torch.randn(C, V, generator=g).mul(0.3).requires_grad_()
    _compare(h, w.T, targets, g, 0.9, None, torch.float32)


def test_logp_only_and_frozen_head():
    """No entropy output (its gradient path compiled out) and W without grad (dW compiled out)."""
    T, C, V = 21, 32, 111
    h, w, targets, g = _inputs(T, C, V, torch.float32, seed=3)
    w = w.detach()
    g_logp = torch.randn(T, generator=g)
    logp = fused_logprob(h, w, targets, config=_cfg(2))
    (dh,) = torch.autograd.grad((logp * g_logp).sum(), (h,))
    logp_r = fused_logprob_ref(h, w, targets)
    (dh_r,) = torch.autograd.grad((logp_r * g_logp).sum(), (h,))
    torch.testing.assert_close(logp, logp_r, **tol(torch.float32))
    torch.testing.assert_close(dh, dh_r, **tol(torch.float32))


def test_entropy_only_gradient():
    """Only the entropy receives a gradient (the logp gradient path compiled out)."""
    T, C, V = 9, 16, 70
    h, w, targets, g = _inputs(T, C, V, torch.float32, seed=11)
    g_ent = torch.randn(T, generator=g)
    _, ent = fused_logprob(h, w, targets, temperature=1.2, return_entropy=True, config=_cfg(1))
    got = torch.autograd.grad((ent * g_ent).sum(), (h, w))
    _, ent_r = fused_logprob_ref(h, w, targets, temperature=1.2, return_entropy=True)
    want = torch.autograd.grad((ent_r * g_ent).sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(torch.float32))


def test_uniform_logits_by_hand():
    """W = 0: every logit is 0, so logp = -log V and H = log V exactly, for kernel and oracle alike."""
    T, C, V = 5, 16, 97
    h = torch.randn(T, C)
    w = torch.zeros(V, C)
    targets = torch.tensor([0, 96, 50, 1, 33])
    for fn in (lambda: fused_logprob(h, w, targets, return_entropy=True, config=_cfg(2)),
               lambda: fused_logprob_ref(h, w, targets, return_entropy=True)):
        logp, ent = fn()
        torch.testing.assert_close(logp, torch.full((T,), -math.log(V)), atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, torch.full((T,), math.log(V)), atol=1e-6, rtol=0)


def test_empty_batch():
    h = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    logp, ent = fused_logprob(h, w, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_input_checks():
    h, w, t = torch.randn(4, 16), torch.randn(40, 16), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden size"):
        fused_logprob(h, torch.randn(40, 8), t)
    with pytest.raises(ValueError, match="dtype"):
        fused_logprob(h, w.half(), t)
    with pytest.raises(ValueError, match="targets_T"):
        fused_logprob(h, w, t[:3])
    with pytest.raises(ValueError, match="temperature"):
        fused_logprob(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="block_n"):
        LogProbConfig(block_n=48)
