"""Op dispatch of the no-grad fast path: which kernels run the engine's forward on each device.

The model (qwen3.py) calls fused_ops_for(device) once per forward and runs its fused layer path
with the returned FusedOps, or its plain torch path when there is none; the learner's forward is
always the torch path. logits_fp32 / linear_nograd are the LM head and projection helpers the two
sides share. One table per device, chosen here and nowhere else:
- CPU: the C++ ops of csrc/fused_ops.cpp, and projections through the C++ skinny linear
  (csrc/skinny_linear.cpp), a weight-streaming GEMV for the few-row matmuls of decode.
- GPU: the Triton kernels of kernels/fused_norm.py (capturable in the decode CUDA graphs).
- Neither built: None, the torch ops.
Fused kernels replace the elementwise chains of each layer (residual add + RMSNorm, q/k norm +
RoPE, SiLU * up), which dominate a small model's decode step through per-op dispatch (CPU) or
per-kernel launch (GPU) cost. Same math as the torch path. SKINNY is read at call time, so a
benchmark may switch the skinny linear off (bench/bench_skinny_linear.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rlengine import _ext

FUSED = all(_ext.has_op(op) for op in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul"))
SKINNY = _ext.has_op("skinny_linear")


def linear_nograd(x_TC: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on the CPU inference path (no bias): the skinny linear when built and on."""
    return torch.ops.rlengine.skinny_linear(x_TC, w) if SKINNY else F.linear(x_TC, w)


def logits_fp32(h_BC: torch.Tensor, w_VC: torch.Tensor) -> torch.Tensor:
    """h @ W^T with low-precision inputs, fp32 accumulation and fp32 output: [B, C] x [V, C] -> [B, V].

    CUDA: one GEMM with out_dtype=float32 (cuBLAS accumulates in fp32; no fp32 copy of W).
    Elsewhere: upcast both inputs (exact) and multiply in fp32. A float64 model (the test-only
    dtype of the exact multi-rank comparisons) keeps float64 logits: no fp32 rounding enters.
    """
    if h_BC.dtype == torch.float64:
        return F.linear(h_BC, w_VC.double())
    if h_BC.device.type == "cuda" and _MM_OUT_DTYPE:
        return torch.mm(h_BC, w_VC.t(), out_dtype=torch.float32)
    return F.linear(h_BC.float(), w_VC.float())


def _mm_has_out_dtype() -> bool:
    try:
        return "out_dtype" in str(torch.ops.aten.mm.dtype._schema)
    except (AttributeError, RuntimeError):
        return False


_MM_OUT_DTYPE = _mm_has_out_dtype()


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The kernels of the no-grad fast path, one set per device with the same signatures:
    the C++ ops on the CPU, kernels/fused_norm.py (Triton) on a GPU."""

    rms_norm: Callable
    fused_add_rms_norm: Callable
    qk_norm_rope: Callable
    silu_and_mul: Callable
    linear: Callable  # x @ w.T without bias


CPU_OPS = FusedOps(torch.ops.rlengine.rms_norm, torch.ops.rlengine.fused_add_rms_norm,
                   torch.ops.rlengine.qk_norm_rope, torch.ops.rlengine.silu_and_mul,
                   linear_nograd) if FUSED else None


@functools.cache
def triton_ops() -> FusedOps | None:
    """The Triton set (None without triton); also usable on the CPU under TRITON_INTERPRET=1 (tests)."""
    try:
        from rlengine.kernels import _triton, fused_norm
    except ImportError:
        return None
    if not _triton.AVAILABLE:  # the kernel module imports without triton, its kernels do not launch
        return None
    return FusedOps(fused_norm.rms_norm, fused_norm.fused_add_rms_norm, fused_norm.qk_norm_rope,
                    fused_norm.silu_and_mul, F.linear)


def fused_ops_for(device: torch.device) -> FusedOps | None:
    """The fast path's kernels for `device`, or None to run the plain torch path."""
    if device.type == "cpu":
        return CPU_OPS
    if device.type == "cuda":
        return triton_ops()
    return None
