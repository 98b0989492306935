"""Fused log-prob kernel vs the plain-torch oracle (full logits + log_softmax), under TRITON_INTERPRET.

Values, entropy and the gradients w.r.t. h and W with one shared random upstream gradient on
both outputs. Tiles are pinned small (BLOCK_M=16, BLOCK_N=32, BLOCK_K=16) so the odd sizes
below cross block edges, and the backward's d(logits) chunks are small enough that its vocab
and token chunk loops run several times; bf16 is left to the GPU tier (the interpreter gets it
wrong).
"""

import math

import pytest
import torch

from rlengine.kernels import fused_logprob as flp
from rlengine.kernels.fused_logprob import LogProbConfig, fused_logprob, fused_logprob_ref

from tests.support.tolerances import tol


def _cfg(num_splits: int, chunk_elems: int = 2**26, max_chunk_tokens: int = 16384,
         skip_zero_rows: bool = True) -> LogProbConfig:
    return LogProbConfig(block_m=16, block_n=32, block_k=16, num_splits=num_splits, group_m=2,
                         num_warps=4, num_stages=1, chunk_elems=chunk_elems, max_chunk_tokens=max_chunk_tokens,
                         skip_zero_rows=skip_zero_rows)


def _inputs(T, C, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, C, generator=g).to(dtype).requires_grad_()
    # Scale so that softmaxes are neither flat nor one-hot: gradients exercise every term.
    w = (torch.randn(V, C, generator=g) * (1.5 / math.sqrt(C))).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    return h, w, targets, g


def _compare(h, w, targets, g, temperature, config, dtype, g_logp=None, g_ent=None):
    T = h.shape[0]
    g_logp = torch.randn(T, generator=g) if g_logp is None else g_logp
    g_ent = torch.randn(T, generator=g) if g_ent is None else g_ent
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
    # (T, C, V, temperature, num_splits, backward chunk (elems, max tokens)): the path each covers
    pytest.param(1, 16, 97, 1.0, 1, (2**26, 16384), id="T=1,V=97-odd-vocab-tail,one-chunk"),
    pytest.param(13, 32, 97, 0.7, 1, (13 * 32, 16384), id="T<BLOCK_M,temp0.7,vocab-chunks-of-one-tile"),
    pytest.param(24, 32, 257, 1.3, 3, (16 * 64, 16), id="V=257,3-vocab-splits,2-token-chunks,5-vocab-chunks"),
    pytest.param(20, 24, 300, 1.0, 2, (2**26, 7), id="C-not-multiple-of-BLOCK_K,token-chunks-of-7"),
    pytest.param(17, 32, 64, 1.0, 0, (17 * 64, 16384), id="V-multiple-of-BLOCK_N,auto-splits,V_c=V"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,C,V,temperature,num_splits,chunk", CASES)
def test_matches_reference(T, C, V, temperature, num_splits, chunk, dtype):
    h, w, targets, g = _inputs(T, C, V, dtype, seed=T * 1000 + V)
    _compare(h, w, targets, g, temperature, _cfg(num_splits, *chunk), dtype)


def test_chunk_shape():
    cfg = _cfg(1, chunk_elems=16 * 64, max_chunk_tokens=16)
    assert flp.chunk_shape(24, 257, cfg) == (16, 64)     # T capped, V_c = 1024 // 16 rounded to BLOCK_N
    assert flp.chunk_shape(5, 40, cfg) == (5, 64)        # V_c never exceeds V rounded up to BLOCK_N
    assert flp.chunk_shape(16, 257, _cfg(1, chunk_elems=40)) == (16, 32)  # at least one tile


@pytest.mark.parametrize("skip", [True, False], ids=["skip-zero-rows", "keep-zero-rows"])
def test_masked_tokens_are_skipped_exactly(skip):
    """Prompt/padding tokens (both upstream gradients 0) get zero grad_h and add nothing to grad_W,
    whether they are dropped before the matmuls (one host sync) or multiplied through."""
    T, C, V = 30, 16, 130
    h, w, targets, g = _inputs(T, C, V, torch.float32, seed=21)
    mask = torch.rand(T, generator=g) < 0.5
    mask[0], mask[-1] = False, True
    g_logp, g_ent = torch.randn(T, generator=g) * mask, torch.randn(T, generator=g) * mask
    g_ent[3] = 1.0 if not mask[3] else g_ent[3]  # a row with an entropy gradient only stays live
    _compare(h, w, targets, g, 1.0, _cfg(1, 16 * 64, 16, skip_zero_rows=skip), torch.float32, g_logp, g_ent)


def test_all_rows_masked():
    T, C, V = 9, 16, 40
    h, w, targets, _ = _inputs(T, C, V, torch.float32, seed=4)
    logp, ent = fused_logprob(h, w, targets, return_entropy=True, config=_cfg(1))
    dh, dw = torch.autograd.grad((logp * 0).sum() + (ent * 0).sum(), (h, w))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_backward_is_bitwise_reproducible():
    """No atomics: two backward passes give identical bits (the old atomic_add kernel did not on GPU)."""
    T, C, V = 40, 32, 200
    h, w, targets, g = _inputs(T, C, V, torch.float32, seed=5)
    g_logp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    runs = []
    for _ in range(2):
        logp, ent = fused_logprob(h, w, targets, return_entropy=True, config=_cfg(2, 16 * 64, 16))
        runs.append(torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_default_configs_per_device_and_dtype():
    """fp32 on CUDA gets its own smaller tiles (FMA dots, 2 stages): the 16-bit config would need
    (128*64 + 64*128) * 4 B * 3 stages = 192 KiB of shared memory."""
    cuda = torch.device("cuda")
    fp32, bf16 = flp.default_config(cuda, torch.float32), flp.default_config(cuda, torch.bfloat16)
    assert bf16 == flp.default_config(cuda, torch.float16) and (bf16.block_m, bf16.block_n) == (128, 128)
    smem = lambda c: (c.block_m + c.block_n) * c.block_k * 4 * c.num_stages  # noqa: E731
    assert smem(fp32) <= 64 * 1024 and fp32.num_warps * 32 * 64 >= fp32.block_m * fp32.block_n
    assert flp.default_config(torch.device("cpu"), torch.float32).block_m == 16


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
