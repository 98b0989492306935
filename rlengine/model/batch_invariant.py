"""Batch-invariant mode: one implementation per op, each token's row computed in an order that
depends on nothing but that row, on the engine's prefill and decode and on the learner's forward.

With `model.batch_invariant = True` (LLM(batch_invariant=True), gen.batch_invariant in a job) the
decoder runs Qwen3Model.forward_invariant on both sides, built from the ops here:
- linear / logits: csrc/batch_invariant.cpp's inv_linear (K in one fixed order, fp32 lanes; one
  kernel for 1 row and for 8,192; no measured kernel choice, no split-K);
- rms_norm, qk_norm_rope: the per-row C++ kernels of csrc/rms_norm.cpp and csrc/fused_ops.cpp
  (scalar fp32 loops over one row); silu_and_mul: inv_silu_and_mul, row by row (the default
  path's op runs ATen's silu, whose vector body and scalar tail split where the tensor ends);
- attention: inv_attention_varlen (prefill, learner) and inv_paged_decode (decode) share one
  routine: keys in chunks of 32 aligned to absolute positions, merged in position order, so decode
  over pages and the packed causal pass give the same bits;
- logsumexp: inv_logsumexp over the vocabulary (the sampler's and the learner's log-probs, the
  sampler's race, the top-k / top-p filter's normalisers); log / exp: one scalar routine per
  element (torch's elementwise loops run a vector kernel in the body and a scalar one in the tail,
  so an element's bits would depend on the tensor's size: the sampler's draws and nucleus masses).
Residual adds, RoPE tables, the temperature division and the gathers are elementwise and exact.
Each op is an autograd Function whose forward is the kernel and whose backward is the ordinary
derivative (written out, or the plain-torch reference re-run under autograd): only the forward has
to match the engine. The KV cache then holds exactly what the learner's forward computes.
Devices: CPU tensors run the C++ ops above; CUDA tensors run the Triton kernels of
kernels/invariant_matmul.py, invariant_attention.py and invariant_logsumexp.py (same contracts, their
own fixed orders), and fused_norm.py's rms_norm / qk_norm_rope / silu_and_mul, which are already
row-invariant (one program per row or per (token, head), a whole-row reduction at a block size set
by C or D). On CUDA, log / exp are torch's: its elementwise CUDA kernels compute each element with
the same instruction wherever it sits (no separate vector body and scalar tail), so they need no
kernel. MoE blocks run batch_invariant_moe.py (fixed-order routing and slot sums) on these ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlengine.model import ext as _ext
from rlengine.model.layers import apply_rope, rms_norm_ref

OPS = ("inv_linear", "inv_attention_varlen", "inv_paged_decode", "inv_logsumexp", "inv_log", "inv_exp",
       "inv_silu_and_mul", "rms_norm", "qk_norm_rope")
AVAILABLE = all(_ext.has_op(op) for op in OPS)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_reason(cfg, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why batch-invariant mode cannot run this model here, or None."""
    if device.type == "cuda":
        if not triton_available():
            return "on CUDA it runs the Triton kernels, and triton is not installed"
    elif device.type != "cpu":
        return f"it runs on the CPU (C++ ops) or CUDA (Triton kernels), the model is on {device}"
    elif not AVAILABLE:
        missing = [op for op in OPS if not _ext.has_op(op)]
        return f"the C++ extension lacks {', '.join(missing)} ({_ext.LOAD_ERROR or 'rebuild it'})"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float32, bfloat16, float16"
    return None


def triton_available() -> bool:
    from rlengine.kernels._triton import AVAILABLE as triton_ok
    return triton_ok


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _linear_kernel(x_MK, w_NK, bias_N, fp32_out):
    if _on_cuda(x_MK):
        from rlengine.kernels.invariant_matmul import invariant_matmul
        return invariant_matmul(x_MK, w_NK, bias_N, fp32_out)
    return torch.ops.rlengine.inv_linear(x_MK, w_NK, bias_N, fp32_out)


def _rms_norm_kernel(x, w, eps):
    if _on_cuda(x):
        from rlengine.kernels import fused_norm
        return fused_norm.rms_norm(x, w, eps)
    return torch.ops.rlengine.rms_norm(x, w, eps)


def _qk_norm_rope_kernel(*args):
    if _on_cuda(args[0]):
        from rlengine.kernels import fused_norm
        return fused_norm.qk_norm_rope(*args)
    return torch.ops.rlengine.qk_norm_rope(*args)


def _silu_and_mul_kernel(x):
    if _on_cuda(x):
        from rlengine.kernels import fused_norm
        return fused_norm.silu_and_mul(x)
    return torch.ops.rlengine.inv_silu_and_mul(x)


def _attention_kernel(q_THD, k_TKD, v_TKD, cu_seqlens, scale):
    if _on_cuda(q_THD):
        from rlengine.kernels.invariant_attention import invariant_attention_varlen
        return invariant_attention_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, scale)
    return torch.ops.rlengine.inv_attention_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, scale)


def _logsumexp_kernel(z_NV):
    if _on_cuda(z_NV):
        from rlengine.kernels.invariant_logsumexp import invariant_logsumexp
        return invariant_logsumexp(z_NV)
    return torch.ops.rlengine.inv_logsumexp(z_NV)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, bias_N, fp32_out):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.has_bias = bias_N is not None
        return _linear_kernel(x_MK, w_NK, bias_N, fp32_out)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_NK = ctx.saved_tensors
        g = g_MN.float() if g_MN.dtype != x_MK.dtype else g_MN
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ w_NK.to(g.dtype)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x_MK.to(g.dtype)).to(w_NK.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(w_NK.dtype)
        return gx, gw, gb, None


def linear(x: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N] in x's dtype, fp32 accumulation in one fixed order."""
    x_MK = x.reshape(-1, x.shape[-1])
    return _Linear.apply(x_MK, w_NK, bias_N, False).view(*x.shape[:-1], w_NK.shape[0])


def logits(h_TC: torch.Tensor, w_VC: torch.Tensor) -> torch.Tensor:
    """The LM head: [T, C] x [V, C] -> [T, V] fp32 logits from compute-dtype weights."""
    return _Linear.apply(h_TC, w_VC, None, True)


class _KernelForward(torch.autograd.Function):
    """Forward = a C++ kernel; backward = autograd through its plain-torch reference, re-run."""

    @staticmethod
    def forward(ctx, kernel, reference, *args):
        ctx.reference, ctx.args = reference, args
        return kernel(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = [a.detach().requires_grad_(need) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a, need in zip(ctx.args, ctx.needs_input_grad[2:])]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        with torch.enable_grad():
            outs = ctx.reference(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                  allow_unused=True) if pairs and wanted else [None] * len(wanted)
        out = [None] * len(args)
        for i, g in zip(wanted, got):
            out[i] = g
        return (None, None, *out)


def _apply(kernel, reference, *args):
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _KernelForward.apply(kernel, reference, *args)
    return kernel(*args)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _apply(_rms_norm_kernel, rms_norm_ref, x, w, eps)


def _qk_norm_rope_ref(qkv_TW, q_w, k_w, cos_sin, positions_T, H, Hkv, eps):
    D = cos_sin.shape[-1]
    T = qkv_TW.shape[0]
    q = qkv_TW[:, :H * D].reshape(T, H, D)
    k = qkv_TW[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
    if q_w is not None:
        q, k = rms_norm_ref(q, q_w, eps), rms_norm_ref(k, k_w, eps)
    cs = cos_sin[:, positions_T].to(qkv_TW.dtype)
    cos, sin = cs[0].unsqueeze(1), cs[1].unsqueeze(1)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def qk_norm_rope(qkv_TW, q_w, k_w, cos_sin, positions_T, H: int, Hkv: int, eps: float):
    """(q [T, H, D], k [T, Hkv, D]) from the qkv projection: per-head RMSNorm (when q_w) then RoPE."""
    return _apply(_qk_norm_rope_kernel, _qk_norm_rope_ref, qkv_TW, q_w, k_w, cos_sin, positions_T,
                  H, Hkv, eps)


def _silu_and_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _apply(_silu_and_mul_kernel, _silu_and_mul_ref, x)


def _attention_ref(q_THD, k_TKD, v_TKD, cu_T, scale):
    from rlengine.model.attention import PackedCausal
    return PackedCausal(cu_T.tolist(), scale).attend(0, q_THD, k_TKD, v_TKD)  # padded under autograd


def attention_varlen(q_THD, k_TKD, v_TKD, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of sequences packed along T (cu_seqlens int64 [B+1] on the CPU)."""
    return _apply(_attention_kernel, _attention_ref, q_THD, k_TKD, v_TKD, cu_seqlens, scale)


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_NV):
        lse_N = _logsumexp_kernel(z_NV)
        ctx.save_for_backward(z_NV, lse_N)
        return lse_N

    @staticmethod
    def backward(ctx, g_N):
        z_NV, lse_N = ctx.saved_tensors
        return g_N[:, None] * (z_NV - lse_N[:, None]).exp()


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """log sum exp over the last dim of fp32 z [..., V] -> [...]; -inf for a row of -inf."""
    z_NV = z.reshape(-1, z.shape[-1]).float()
    if not z_NV.is_contiguous():
        z_NV = z_NV.contiguous()
    return _LogSumExp.apply(z_NV).view(z.shape[:-1])


def log(x: torch.Tensor) -> torch.Tensor:
    """Elementwise log of fp32 x, the same bits wherever an element sits (no autograd)."""
    return torch.log(x) if _on_cuda(x) else torch.ops.rlengine.inv_log(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    """Elementwise exp of fp32 x, the same bits wherever an element sits (no autograd)."""
    return torch.exp(x) if _on_cuda(x) else torch.ops.rlengine.inv_exp(x)


class InvariantCausal:
    """The attention context of the invariant forward: causal per sequence, packed along T."""

    def __init__(self, cu_seqlens: list[int], scale: float):
        self.cu = torch.tensor(list(cu_seqlens), dtype=torch.int64)
        self.scale = scale

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        return attention_varlen(q_THD, k_TKD, v_TKD, self.cu, self.scale)
