"""Small-M GEMMs with RMSNorm prologue, SiLU*up and residual epilogues (kernels/small_m_gemm.py).

Under TRITON_INTERPRET=1 against the plain-torch references, fp32 and fp16. Cases: M = 1 (a single
decode row), odd M = 7, M = 64 (the largest); K not a multiple of BLOCK_K; N not a multiple of BLOCK_N;
split-K 1 (the epilogue in the program) and 2 / 4 (partials, the last program reduces), and the
heuristic's own config. Outputs are poisoned with NaN first. Error bounds follow from the arithmetic:
the kernel rounds x * g to the weight dtype before the dot (u |h| . |w| per output), sums in fp32 (K u32
|h| . |w|) and rounds the output once (u |y|); the SiLU epilogue propagates the two sums' errors through
d(silu(a) b) <= 1.1 |b| da + |silu(a)| db.
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine.kernels import small_m_gemm as sm

U = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11}
CASES = [  # (M, N, K, config): which path
    pytest.param(1, 40, 100, sm.SmallMConfig(32, 32, 1), id="M1-nosplit-Ktail"),
    pytest.param(7, 72, 200, sm.SmallMConfig(32, 64, 4), id="M7-split4-Ntail-Ktail"),
    pytest.param(64, 33, 70, sm.SmallMConfig(32, 32, 2), id="M64-split2-Ntail-Ktail"),
    pytest.param(5, 48, 96, None, id="M5-heuristic-config"),
]


def _inputs(M, N, K, dtype, seed, rows_w):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype)
    gw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    w = (torch.randn(rows_w, K, generator=g) * K ** -0.5).to(dtype)
    return x, gw, w


def _dot_bound(h, w, dtype, K):
    """Per-output bound on |kernel - fp32 reference| of h @ w.T before the epilogue."""
    hw = h.abs().float() @ w.abs().float().t()
    return (U[dtype] + 2 * K * U[torch.float32]) * hw


def _workspace():
    return sm.SmallMWorkspace(8, 64, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,config", CASES)
def test_norm_linear_with_bias(dtype, M, N, K, config):
    x, gw, w = _inputs(M, N, K, dtype, M * N + K, N)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(dtype)
    ws = _workspace()
    out = torch.full((M, N), float("nan"), dtype=dtype)
    got = sm.norm_linear(x, gw, 1e-6, w, bias, out=out, workspace=ws, config=config)
    want = sm.norm_linear_ref(x, gw, 1e-6, w, bias)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gw.float()
    bound = _dot_bound(h, w, dtype, K) + U[dtype] * want.float().abs() + 1e-30
    assert got is out and torch.isfinite(got).all()
    assert ((got.float() - want.float()).abs() <= bound).all(), ((got.float() - want.float()).abs() / bound).max()
    assert not ws.counters.any()  # the last program of each tile reset its counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,config", CASES)
def test_norm_gate_up_silu(dtype, M, N, K, config):
    x, gw, w = _inputs(M, N, K, dtype, M + N * K, 2 * N)
    ws = _workspace()
    out = torch.full((M, N), float("nan"), dtype=dtype)
    got = sm.norm_gate_up_silu(x, gw, 1e-6, w, out=out, workspace=ws, config=config)
    want = sm.norm_gate_up_silu_ref(x, gw, 1e-6, w)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gw.float()
    y = h @ w.float().t()
    e = _dot_bound(h, w, dtype, K)
    a, b = y[:, :N], y[:, N:]
    bound = 1.1 * b.abs() * e[:, :N] + F.silu(a).abs() * e[:, N:] + U[dtype] * want.float().abs() + 1e-30
    assert torch.isfinite(got).all()
    assert ((got.float() - want.float()).abs() <= bound).all(), ((got.float() - want.float()).abs() / bound).max()
    assert not ws.counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,config", CASES)
def test_linear_residual_in_place(dtype, M, N, K, config):
    x, _, w = _inputs(M, N, K, dtype, 7 * M + N + K, N)
    residual = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = sm.linear_residual_ref(x, w, residual)
    got = sm.linear_residual(x, w, residual, workspace=_workspace(), config=config)
    bound = _dot_bound(x, w, dtype, K) + U[dtype] * want.float().abs() + 1e-30
    assert got is residual
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_two_launches_on_one_workspace_agree():
    """The counters reset themselves: a second split-K launch on the same workspace reduces correctly."""
    x, gw, w = _inputs(3, 64, 128, torch.float32, 11, 64)
    ws, cfg = _workspace(), sm.SmallMConfig(32, 32, 4)
    first = sm.norm_linear(x, gw, 1e-6, w, workspace=ws, config=cfg).clone()
    torch.testing.assert_close(sm.norm_linear(x, gw, 1e-6, w, workspace=ws, config=cfg), first, rtol=0, atol=0)


def test_heuristic_splits_k_for_decode_shapes():
    """Qwen3-0.6B on 132 SMs: qkv (N 4096, K 1024) is 128 tiles of 32, one wave without a split; down
    (N 1024, K 3072) is 32 tiles -> split 4; gate_up (F 3072) 96 tiles, no split."""
    assert sm.choose_config(1, 4096, 1024, torch.bfloat16, sm.EPI_NONE) == sm.SmallMConfig(32, 128, 1)
    assert sm.choose_config(1, 1024, 3072, torch.bfloat16, sm.EPI_RESIDUAL).split_k == 4
    assert sm.choose_config(64, 3072, 1024, torch.bfloat16, sm.EPI_SILU).split_k == 1
    picks = {sm.choose_config(M, N, K, torch.bfloat16, sm.EPI_NONE, sms) for M in (1, 16, 17, 64)
             for N, K in ((4096, 1024), (1024, 3072), (6144, 4096), (4096, 14336), (96, 64)) for sms in (78, 132)}
    assert picks <= set(sm.CANDIDATES), picks - set(sm.CANDIDATES)  # the sm_90 tier compiles every candidate


@pytest.mark.parametrize("bad,match", [
    (dict(M=65), "1..64 rows"), (dict(gk=7), "norm weight"), (dict(wdtype=torch.float16), "share a dtype"),
])
def test_bad_inputs_name_the_problem(bad, match):
    M = bad.get("M", 2)
    x = torch.randn(M, 16)
    g = torch.ones(bad.get("gk", 16))
    w = torch.randn(32, 16).to(bad.get("wdtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        sm.norm_linear(x, g, 1e-6, w)


def test_split_k_without_workspace_is_refused():
    with pytest.raises(ValueError, match="SmallMWorkspace"):
        sm.norm_linear(torch.randn(2, 64), torch.ones(64), 1e-6, torch.randn(32, 64),
                       config=sm.SmallMConfig(32, 32, 2))


def test_a_launch_beyond_the_workspace_is_refused():
    with pytest.raises(ValueError, match="workspace holds 1 tiles, 2 split programs"):
        sm.norm_linear(torch.randn(2, 64), torch.ones(64), 1e-6, torch.randn(32, 64),
                       workspace=sm.SmallMWorkspace(1, 2, "cpu"), config=sm.SmallMConfig(32, 32, 4))
