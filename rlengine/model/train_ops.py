"""The torch path's RMSNorm and SiLU * up on the CPU: the engine's forward kernels with one-pass backwards.

The learner (and every forward without the fused path) runs the model's torch path. There, autograd
replays the Hugging Face expressions op by op: an RMSNorm is upcast, square, mean, rsqrt, multiply, round,
multiply forward and about ten ops backward; SwiGLU's backward is silu_backward, two multiplies and the
concatenation of the two halves' gradients. At the learner's shapes these passes over memory, not the
GEMMs, are what a layer adds: a qwen3-30m step of 8 x 256 tokens spent ~250 ms of 2.5 s (bf16, one thread)
in the norms' autograd alone. Here each layer is one autograd Function:
- forward: the engine's kernels (csrc/rms_norm.cpp, csrc/fused_ops.cpp silu_and_mul), which round where
  the torch expressions round (silu_and_mul is bit-identical to them; the norm's sum of squares runs in
  another order, so its results can differ in the last bit);
- backward: csrc/train_backward.cpp, fp32 inside and one rounding per output.
The attention's q / k norm and RoPE are one Function over the fused qkv output (qk_norm_rope, the engine's
forward kernel), whose backward writes the whole projection's gradient.
They save the layer's input only (the norm's [T, C] input instead of its fp32 copy and the intermediates
autograd keeps). Where the kernels do not apply (no extension, float64, another device, a tensor subclass
such as DTensor, tracing by torch.compile) the torch expressions run as before; SiLU * up also keeps them
in fp16 and in builds without AVX-512, where its backward row was slower than autograd's ops.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from rlengine.model import ext as _ext

AVAILABLE = _ext.has_train_ops()
# SiLU * up's backward only where its AVX-512 row is built (csrc/train_backward.cpp silu_backward_vectorized)
SILU = _ext.train_silu()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def applies(*tensors: torch.Tensor) -> bool:
    """True when the CPU kernels run these tensors: plain CPU tensors of one supported dtype."""
    if not AVAILABLE or torch.compiler.is_compiling():
        return False
    first = tensors[0]
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == first.dtype
               for t in tensors) and first.dtype in _DTYPES


class RMSNormFunction(torch.autograd.Function):
    """y = w * round(x * rsqrt(mean(x^2) + eps)) over the last dim; saves x and w."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return torch.ops.rlengine.rms_norm(x, w, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx, dw = torch.ops.rlengine.rms_norm_backward(g, x, w, ctx.eps)
        return dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None


class SiluAndMulFunction(torch.autograd.Function):
    """a = silu(gu[..., :F]) * gu[..., F:]; saves gu."""

    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return torch.ops.rlengine.silu_and_mul(gu)

    @staticmethod
    @once_differentiable
    def backward(ctx, go):
        (gu,) = ctx.saved_tensors
        return torch.ops.rlengine.silu_and_mul_backward(go, gu)


class QKNormRopeFunction(torch.autograd.Function):
    """(q, k, v) of the fused projection's output qkv [T, (H + 2Hkv) D]: per-head RMSNorm of q and k (none when
    q_w is None) then rotate-half RoPE, v copied out; saves qkv and the weights. The backward returns the
    whole qkv gradient in one tensor (no concatenation of the three parts)."""

    @staticmethod
    def forward(ctx, qkv, q_w, k_w, cos_sin, positions, H: int, Hkv: int, eps: float):
        q, k = torch.ops.rlengine.qk_norm_rope(qkv, q_w, k_w, cos_sin, positions, H, Hkv, eps)
        D = cos_sin.shape[-1]
        v = qkv[:, (H + Hkv) * D:].reshape(qkv.shape[0], Hkv, D).clone()
        ctx.save_for_backward(qkv, q_w, k_w, cos_sin, positions)
        ctx.heads, ctx.eps = (H, Hkv), eps
        return q, k, v

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, gk, gv):
        qkv, q_w, k_w, cos_sin, positions = ctx.saved_tensors
        dqkv, dq_w, dk_w = torch.ops.rlengine.qk_norm_rope_backward(gq, gk, gv, qkv, q_w, k_w, cos_sin, positions,
                                                                     *ctx.heads, ctx.eps)
        norm = q_w is not None
        return (dqkv, dq_w if norm and ctx.needs_input_grad[1] else None,
                dk_w if norm and ctx.needs_input_grad[2] else None, None, None, None, None, None)


def qk_norm_rope(qkv: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, H: int, Hkv: int, eps: float):
    """(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) from qkv [T, (H + 2Hkv) D] with the torch path's RoPE
    tables cos / sin [T, 1, D] (already in the model's dtype, so the kernel's rounding of them is exact);
    None where the kernels do not apply (the caller runs the torch expressions)."""
    weights = () if q_w is None else (q_w, k_w)
    if not applies(qkv, *weights) or cos.dim() != 3 or cos.shape[1] != 1 or qkv.dim() != 2:
        return None
    return QKNormRopeFunction.apply(qkv, q_w, k_w, *_rope_table(cos, sin), H, Hkv, eps)


_last_table: tuple = ()  # weak references: (cos, sin, table, positions) of the last call


def _rope_table(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' fp32 [2, T, D] table from cos / sin [T, 1, D], and positions 0..T-1. Every layer of one
    forward receives the same cos / sin: the table is built once and shared (saved once) while the
    forward's graph holds it."""
    global _last_table
    alive = [ref() for ref in _last_table]
    if alive and alive[0] is cos and alive[1] is sin and alive[2] is not None and alive[3] is not None:
        return alive[2], alive[3]
    table = torch.stack([cos[:, 0], sin[:, 0]]).float()  # read at positions 0..T-1
    positions = torch.arange(cos.shape[0], device=cos.device)
    _last_table = tuple(weakref.ref(t) for t in (cos, sin, table, positions))
    return table, positions


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, ref) -> torch.Tensor:
    """RMSNorm of x [..., C] by w [C]: the kernels where they apply, else ref(x, w, eps)."""
    return RMSNormFunction.apply(x, w, eps) if applies(x, w) else ref(x, w, eps)


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] on the last dim: the kernels where they apply, else torch's ops."""
    if SILU and applies(gu) and gu.dtype != torch.float16:
        return SiluAndMulFunction.apply(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up
