"""csrc/train_backward.cpp and model/train_ops.py: the backward kernels of the CPU torch path's RMSNorm and
SiLU * up against autograd of the torch expressions in float64 (the exact derivative), with bounds from the
arithmetic; the modules' gradients through the Functions against autograd of the torch expressions in the
model's dtype; and the fallback to those expressions where the kernels do not apply."""

import pytest
import torch
import torch.nn.functional as F

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)
from rlengine.model import train_ops
from rlengine.model.layers import RMSNorm, SwiGLUMLP, rms_norm_ref

U = 2.0 ** -24  # fp32 unit roundoff


def _half_ulp(dtype):
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: U}[dtype]  # unit roundoff


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---- RMSNorm


def _norm_exact(g, x, w, eps):
    """float64 autograd of rms_norm_ref: dx, and dw = sum g * x^ (x^ unrounded), plus the magnitudes."""
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = rms_norm_ref(xd, wd, eps)
    dx, dw = torch.autograd.grad(y, (xd, wd), g.double())
    C = x.shape[-1]
    xf = x.double().reshape(-1, C)
    s = (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    xh = xf * s
    u = g.double().reshape(-1, C) * w.double()
    m = (u * xh).abs().sum(-1, keepdim=True) / C
    mag_dx = (s * (u.abs() + xh.abs() * m)).reshape(x.shape)
    mag_dw = (g.double().reshape(-1, C) * xh).abs().sum(0)
    return dx, dw, mag_dx, mag_dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(37, 96), (6, 3, 64), (1, 512), (5, 40)], ids=["tail-rows", "3d", "one-row", "C40"])
def test_rms_norm_backward_matches_float64_autograd(dtype, shape):
    """dx: fp32 sums over C (2C roundings of the magnitudes) plus one rounding to dtype. dw: the forward's
    rounded x^ (half an ulp of dtype per term), fp32 sums over the rows, one rounding."""
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    x, g = _rand(gen, *shape, dtype=dtype), _rand(gen, *shape, dtype=dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    dx, dw = torch.ops.rlengine.rms_norm_backward(g, x, w, 1e-6)
    ref_dx, ref_dw, mag_dx, mag_dw = _norm_exact(g, x, w, 1e-6)
    C, rows = shape[-1], x.numel() // shape[-1]
    h = _half_ulp(dtype)
    assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
    assert ((dx.double() - ref_dx).abs() <= h * ref_dx.abs() + (2 * C + 4) * U * mag_dx).all()
    assert ((dw.double() - ref_dw).abs() <= h * ref_dw.abs() + (h + (rows + 2) * U) * mag_dw).all()


def test_rms_norm_backward_takes_strided_inputs_and_is_deterministic():
    """A q-norm's input is a [T, H, D] view of the fused qkv output; its gradient arrives transposed."""
    gen = torch.Generator().manual_seed(3)
    qkv = _rand(gen, 9, 4 * 64, dtype=torch.bfloat16)
    x = qkv[:, :128].view(9, 2, 64)
    g = _rand(gen, 2, 9, 64, dtype=torch.bfloat16).transpose(0, 1)
    w = _rand(gen, 64, dtype=torch.bfloat16)
    got = torch.ops.rlengine.rms_norm_backward(g, x, w, 1e-6)
    want = torch.ops.rlengine.rms_norm_backward(g.contiguous(), x.contiguous(), w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got, torch.ops.rlengine.rms_norm_backward(g, x, w, 1e-6)))


# ---- SiLU * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(7, 2 * 48), (3, 2, 2 * 37), (1, 2 * 1536)], ids=["rows", "3d-tail", "qwen3-30m"])
def test_silu_and_mul_backward_matches_float64_autograd(dtype, shape):
    """d gate: a product of three fp32 factors with a ~2-ulp exp inside (16 units of fp32 roundoff) and one
    rounding, on the magnitudes of its terms (they cancel near gate = -1.28). d up: go times the forward's rounded silu (half an ulp of dtype) and one rounding."""
    gen = torch.Generator().manual_seed(shape[-1] + len(shape))
    gu = (3 * torch.randn(*shape, generator=gen)).to(dtype)  # gates well into both tails of the sigmoid
    go = _rand(gen, *shape[:-1], shape[-1] // 2, dtype=dtype)
    got = torch.ops.rlengine.silu_and_mul_backward(go, gu)
    gd = gu.double().requires_grad_()
    gate, up = gd.chunk(2, dim=-1)
    (ref,) = torch.autograd.grad(F.silu(gate) * up, gd, go.double())
    h, F_ = _half_ulp(dtype), shape[-1] // 2
    assert got.shape == gu.shape and got.dtype == dtype
    a, b, o = gate.detach(), up.detach(), go.double()
    sg = torch.sigmoid(a)
    mag = (o * b).abs() * (sg + (a * sg * (1 - sg)).abs())  # the terms of d gate before they cancel
    err = (got.double() - ref).abs()
    sub = 2.0 ** -25 if dtype == torch.float16 else 0.0  # half the spacing of fp16's subnormals: silu(-12) is one
    assert (err[..., :F_] <= h * ref[..., :F_].abs() + 16 * U * mag + sub).all()
    assert (err[..., F_:] <= (2 * h + 8 * U) * ref[..., F_:].abs() + sub * (o.abs() + 1)).all()


def test_silu_and_mul_backward_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match=r"go must be \[..., F\]"):
        torch.ops.rlengine.silu_and_mul_backward(torch.randn(2, 4), torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="gu must be"):
        torch.ops.rlengine.silu_and_mul_backward(torch.randn(2, 2), torch.randn(2, 5))


# ---- the modules


def _graph_names(t):
    """Names of every autograd node behind t."""
    seen, names, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(node.name())
            todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_modules_run_the_functions_and_match_torch_autograd(dtype):
    """RMSNorm and SwiGLUMLP take the kernels on the CPU: outputs within one rounding of the torch
    expressions, gradients (x and every parameter) within the roundings autograd adds in dtype."""
    assert train_ops.AVAILABLE
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    norm, mlp = RMSNorm(64, 1e-6).to(dtype), SwiGLUMLP(64, 96).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(64, generator=gen))
    x = _rand(gen, 2, 24, 64, dtype=dtype).requires_grad_()
    g = _rand(gen, 2, 24, 64, dtype=dtype)
    names = _graph_names(mlp(norm(x)))
    assert "RMSNormFunctionBackward" in names
    assert ("SiluAndMulFunctionBackward" in names) == train_ops.SILU  # AVX-512 builds: the SiLU Function too

    def run(fast):
        train_ops_available, silu = train_ops.AVAILABLE, train_ops.SILU
        train_ops.AVAILABLE = train_ops.SILU = fast
        try:
            norm.zero_grad(), mlp.zero_grad()
            x.grad = None
            out = mlp(norm(x))
            out.backward(g)
            return [out.detach(), x.grad, norm.weight.grad] + [p.grad for p in mlp.parameters()]
        finally:
            train_ops.AVAILABLE, train_ops.SILU = train_ops_available, silu

    got, want = run(True), run(False)
    h = _half_ulp(dtype)
    for a, b in zip(got, want):  # a few roundings of dtype on values of each tensor's scale
        assert (a.double() - b.double()).abs().max() <= 16 * h * b.double().abs().max(), (a - b).abs().max()


def test_float64_and_other_tensors_keep_the_torch_expressions():
    """float64 (the oracle dtype) never reaches the kernels: bit-identical to rms_norm_ref / silu * up."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 32, generator=gen, dtype=torch.float64), torch.randn(32, generator=gen, dtype=torch.float64)
    assert not train_ops.applies(x, w)
    assert torch.equal(train_ops.rms_norm(x, w, 1e-6, rms_norm_ref), rms_norm_ref(x, w, 1e-6))
    gu = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    assert torch.equal(train_ops.silu_and_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:])
    assert not train_ops.applies(torch.randn(3, dtype=torch.float32), torch.randn(3, dtype=torch.bfloat16))


# ---- q / k RMSNorm + RoPE over the fused qkv output


def _rope_exact(qkv, q_w, k_w, cos, sin, H, Hkv, D, eps, grads):
    """float64 autograd of the torch path (split, per-head rms_norm_ref, apply_rope) on the same values."""
    from rlengine.model.layers import apply_rope
    T = qkv.shape[0]
    x = qkv.double().requires_grad_()
    ws = [w.double().requires_grad_() for w in (q_w, k_w)] if q_w is not None else []
    q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, Hkv, D)
    if ws:
        q, k = rms_norm_ref(q, ws[0], eps), rms_norm_ref(k, ws[1], eps)
    c, s = cos.double(), sin.double()
    outs = (apply_rope(q, c, s), apply_rope(k, c, s), v.view(T, Hkv, D))
    return torch.autograd.grad(outs, [x] + ws, [g.double() for g in grads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
def test_qk_norm_rope_backward_matches_float64_autograd(dtype, norm):
    """dqkv: RoPE's transpose (two fp32 products per element) then the head norm's backward (2D roundings of
    the magnitudes) and one rounding; v's columns are gv exactly. dq_w / dk_w: the forward's rounded x^ and
    fp32 sums over tokens and heads."""
    from rlengine.model.config import ModelConfig
    from rlengine.model.layers import RotaryEmbedding
    T, H, Hkv, D, eps = 11, 4, 2, 32, 1e-6
    gen = torch.Generator().manual_seed(7 + norm)
    qkv = _rand(gen, T, (H + 2 * Hkv) * D, dtype=dtype)
    q_w, k_w = ((1 + 0.5 * torch.randn(2, D, generator=gen)).to(dtype).unbind(0) if norm else (None, None))
    rot = RotaryEmbedding(ModelConfig(vocab_size=64, hidden_size=H * D, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                                      max_position_embeddings=64))
    rot.build(torch.device("cpu"))
    positions = torch.randperm(64, generator=gen)[:T]
    cos, sin = rot(positions, dtype)  # [T, 1, D] in dtype, as the torch path builds them
    grads = [_rand(gen, T, h, D, dtype=dtype) for h in (H, Hkv, Hkv)]
    cos_sin = torch.stack([cos[:, 0], sin[:, 0]]).float()
    dqkv, dq_w, dk_w = torch.ops.rlengine.qk_norm_rope_backward(*grads, qkv, q_w, k_w, cos_sin, torch.arange(T),
                                                                 H, Hkv, eps)
    ref = _rope_exact(qkv, q_w, k_w, cos, sin, H, Hkv, D, eps, grads)
    h = _half_ulp(dtype)
    # magnitudes: |d x~| <= |g_i c_i| + |g_partner s_partner| per element, then the norm's terms
    g_qk = torch.cat([grads[0], grads[1]], dim=1).double()
    c, s = cos.double(), sin.double()
    partner = torch.cat([g_qk[..., D // 2:], g_qk[..., :D // 2]], dim=-1)
    dxt = (g_qk * c).abs() + (partner * s).abs()
    x = qkv.double()[:, :(H + Hkv) * D].view(T, H + Hkv, D)
    if norm:
        w = torch.stack([q_w.double()] * H + [k_w.double()] * Hkv)  # [H + Hkv, D]
        r = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        xh = x * r
        u = dxt * w.abs()
        mag = r * (u + xh.abs() * (u * xh.abs()).sum(-1, keepdim=True) / D)
    else:
        mag = dxt
    ref_qk = ref[0][:, :(H + Hkv) * D].view(T, H + Hkv, D)
    got_qk = dqkv.double()[:, :(H + Hkv) * D].view(T, H + Hkv, D)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    assert ((got_qk - ref_qk).abs() <= h * ref_qk.abs() + (2 * D + 8) * U * mag).all()
    assert torch.equal(dqkv[:, (H + Hkv) * D:], grads[2].reshape(T, Hkv * D))
    if not norm:
        assert dq_w.numel() == 0 and dk_w.numel() == 0
        return
    for got_w, ref_w, heads in ((dq_w, ref[1], slice(0, H)), (dk_w, ref[2], slice(H, H + Hkv))):
        terms = (dxt[:, heads] * xh[:, heads].abs()).sum((0, 1))
        n = T * (heads.stop - heads.start)
        assert got_w.dtype == dtype
        assert ((got_w.double() - ref_w).abs() <= h * ref_w.abs() + (h + (n + 4) * U) * terms).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_module_gradients_through_the_function(dtype):
    """A whole torch-path forward + backward of a tiny Qwen3 (q/k norm, GQA): with the kernels against the
    torch expressions, every parameter's gradient within a few roundings of dtype at each tensor's scale."""
    from rlengine.model.config import ModelConfig
    from rlengine.model.qwen3 import Qwen3ForCausalLM
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() == 1 else p.normal_(0, p.shape[-1] ** -0.5)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))

    def grads(fast):
        saved = train_ops.AVAILABLE, train_ops.SILU
        train_ops.AVAILABLE = train_ops.SILU = fast
        try:
            model.zero_grad(set_to_none=True)
            model(ids).float().logsumexp(-1).sum().backward()
            return {n: p.grad.double() for n, p in model.named_parameters()}
        finally:
            train_ops.AVAILABLE, train_ops.SILU = saved

    assert "QKNormRopeFunctionBackward" in _graph_names(model(ids))
    got, want = grads(True), grads(False)
    h = _half_ulp(dtype)
    for name in want:
        scale = want[name].abs().max()
        assert (got[name] - want[name]).abs().max() <= 32 * h * scale, name
