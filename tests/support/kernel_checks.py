"""Kernel-vs-reference checks with tolerances derived from dtype and accumulation.

Shared by the GPU tier (tests/gpu/test_triton_kernels_gpu.py), the interpreter runs of the kernels
(tests/kernels) and the planted-bug controls that prove each check fails on a bug
(tests/kernels/test_planted_bugs.py), so the check that runs on a GPU is the one shown to catch it.
Every bound below says where it comes from:
  - fused log-prob: kernel and oracle both accumulate the logits in fp32 from the same 16-bit
    inputs, so log-probs and entropies agree to fp32 summation-order error (~1e-6 |z|): atol 1e-3,
    rtol 1e-4. Gradients go through d(logits) rounded once to the input dtype (2^-9 relative in
    bf16) and are compared by relative norm < 1e-2. fp32 inputs (no rounding anywhere, exact fp32
    dots on both sides): atol 1e-4, rtol 1e-5, relative norm < 1e-4.
  - paged decode: reference in fp64 from the same (16-bit-rounded) q, K, V; the kernel's only
    16-bit rounding is the output store (2^-9 relative in bf16), so |err| <= 2^-8 |ref| + 1e-5;
    fp32 kernels: 2^-14 |ref| + 1e-6 (fp32 exp2 and sums over a few thousand tokens).
  - fused MoE: bf16 intermediates (h, pre-activations, d(pre-activations)) are each rounded once:
    relative norm < 1e-2 for the output and every gradient.
A missing vocab tile moves the log-sum-exp by ~log(1 + 1/32) = 3e-2 (one tile of 32): caught by
atol 1e-3. A dropped token is caught by the needle tests, where it carries almost all the mass.
"""

from __future__ import annotations

import torch

# dtype -> (logp/entropy atol, rtol, gradient relative-norm bound)
LOGPROB_TOL = {torch.float32: (1e-4, 1e-5, 1e-4), torch.float16: (1e-3, 1e-4, 1e-2),
               torch.bfloat16: (1e-3, 1e-4, 1e-2)}
DECODE_TOL = {torch.float32: (2**-14, 1e-6), torch.float16: (2**-8, 1e-5), torch.bfloat16: (2**-8, 1e-5)}
MOE_REL_NORM = 1e-2


def rel_norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def assert_rel_norm(got: torch.Tensor, want: torch.Tensor, bound: float, name: str) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_norm_error(got, want)
    assert err < bound, f"{name}: relative norm error {err:.3e} >= {bound:.0e}"


def assert_logprob_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    atol, rtol, _ = LOGPROB_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def check_logprob(fused, ref, h, w, targets, g_logp, g_ent) -> None:
    """Values, then the gradients of sum(g_logp * logp) + sum(g_ent * H) and of the entropy term
    alone (so a wrong or missing entropy gradient cannot hide behind the larger log-prob one).
    fused / ref: callables (h, w, targets, return_entropy=True) -> (logp, entropy)."""
    lp, ent = fused(h, w, targets, return_entropy=True)
    lp_r, ent_r = ref(h, w, targets, return_entropy=True)
    assert_logprob_close(lp, lp_r, h.dtype, "logp")
    assert_logprob_close(ent, ent_r, h.dtype, "entropy")
    bound = LOGPROB_TOL[h.dtype][2]
    params = [t for t in (h, w) if t.requires_grad]
    for label, loss, loss_r in (("logp+entropy", (lp * g_logp).sum() + (ent * g_ent).sum(),
                                 (lp_r * g_logp).sum() + (ent_r * g_ent).sum()),
                                ("entropy-only", (ent * g_ent).sum(), (ent_r * g_ent).sum())):
        got = torch.autograd.grad(loss, params, retain_graph=True)
        want = torch.autograd.grad(loss_r, params, retain_graph=True)
        names = [n for n, t in (("grad_h", h), ("grad_w", w)) if t.requires_grad]
        for name, a, b in zip(names, got, want):
            assert_rel_norm(a.float(), b.float(), bound, f"{label} {name}")


def assert_decode_close(out: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, name: str = "out") -> None:
    """Elementwise |out - ref| <= rtol |ref| + atol against an fp64 reference."""
    rtol, atol = DECODE_TOL[dtype]
    assert not out.isnan().any(), f"{name}: NaN (unwritten or contaminated elements)"
    err = (out.double() - ref64).abs()
    excess = err - (rtol * ref64.abs() + atol)
    worst = int(excess.flatten().argmax())
    assert excess.max() <= 0, (f"{name}: {int((excess > 0).sum())} elements outside {rtol:.2e}|ref| + {atol:.0e}; "
                               f"worst |err| {err.flatten()[worst]:.3e} at |ref| {ref64.abs().flatten()[worst]:.3e}")


def sdpa_fp64(q_HD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """One sequence's decode attention in fp64: q [H, D], k/v [ctx, Hkv, D] -> [H, D] fp64."""
    H, Hkv = q_HD.shape[0], k_NHD.shape[1]
    k = k_NHD.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)   # [H, ctx, D]
    v = v_NHD.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    s = torch.einsum("hd,hnd->hn", q_HD.double(), k) * sm_scale
    return torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v)


def packed_causal_fp64(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, cu: list[int],
                       scale: float) -> torch.Tensor:
    """Causal attention of each packed sequence cu[i]:cu[i+1] alone, in float64, the KV heads repeated
    (no GQA path): [T, H, D]."""
    G = q_THD.shape[1] // k_TKD.shape[1]
    outs = []
    for a, b in zip(cu, cu[1:]):
        qd, kd, vd = (x[a:b].double().transpose(0, 1) for x in (q_THD, k_TKD, v_TKD))
        s = (qd @ kd.repeat_interleave(G, 0).transpose(1, 2)) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vd.repeat_interleave(G, 0)).transpose(0, 1))
    return torch.cat(outs)


def plant_needle(q_BHD: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor, b: int, pos: int,
                 boost: float = 12.0) -> None:
    """Make token `pos` of sequence b carry ~all the attention mass of every head, in place.

    Each KV head's query heads get one shared direction u (|u| = sqrt(D)) and K[pos] = boost * u,
    so score(pos) - score(other) ~ boost * sqrt(D) * D^-0.5 = boost nats; V[pos] is set far from
    the average of the others so dropping the token moves the output by ~|V[pos]|."""
    H, D = q_BHD.shape[1], q_BHD.shape[2]
    Hkv = k_seq.shape[1]
    gen = torch.Generator().manual_seed(pos)
    u = torch.randn(Hkv, D, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True) * D**0.5
    q_BHD[b] = u.repeat_interleave(H // Hkv, dim=0).to(q_BHD.dtype)
    k_seq[pos] = (boost * u / D**0.5).to(k_seq.dtype)
    v_seq[pos] = (4.0 * torch.sign(torch.randn(Hkv, D, generator=gen))).to(v_seq.dtype)
