"""The batch-invariant matmul in Triton: y[M, N] = x[M, K] @ w[N, K].T (+ bias), the GPU twin of
csrc/batch_invariant.cpp's inv_linear (rlengine/model/batch_invariant.py dispatches CUDA tensors here).

Each output element is one fp32 accumulation over K in BLOCK_K steps taken in order (tl.dot into
the running accumulator), then + bias and one rounding; what decides that order is the tile config,
and the config is a function of (N, K, dtype, device kind) alone, never of M (the batch). The grid
is persistent (at most one program per SM, each walking tiles pid, pid + programs, ...), so the
launch shape changes with M but what a tile computes does not; there is no split-K and no
autotuning. A row computed alone therefore equals the same row inside a batch of any size, bit for
bit: one decode token and the learner's 8,192-row pass give the same numbers.
Simplification: one config row per (N, K) class, picked by rule rather than measured per machine:
batch invariance forbids a choice that moves with the batch, and a measured choice per (N, K) would
have to be pinned across processes to keep the engine's and the learner's bits equal.

Dimension legend: M rows of x (tokens), N output features, K input features. BLOCK_M / BLOCK_N /
BLOCK_K are tile sizes, GROUP_M the tile-order swizzle (L2 reuse; it moves no arithmetic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rlengine.kernels._triton import tl, triton

INTERPRETER_PROGRAMS = 3  # the interpreter's "SM count": > 1 so the persistent loop strides


@triton.jit
def _inv_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, tiles_m * tiles_n, programs):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm   # int64: M * K may pass 2^31
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn   # the LM head: V * C elements
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K in one fixed order: the same steps for every row and every M
            ks = k0 + offs_k
            mask_k = ks < K
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """One tile config: what every row of an (N, K) matmul is computed with."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot_precision: str  # "ieee" for fp32 (exact fp32 products, no TF32); ignored for 16-bit inputs


def matmul_config(N: int, K: int, dtype: torch.dtype, device_type: str) -> MatmulConfig:
    """The tile config of an [., K] x [N, K] matmul: a function of N, K, the dtype and the device kind only."""
    if device_type != "cuda":  # the interpreter: small tiles keep numpy's per-program work short
        return MatmulConfig(1, 64, 64, 4, 1, "ieee")
    if dtype == torch.float32:  # exact fp32 dots: 64 x 64 x 32 fp32 tiles stay within the registers
        return MatmulConfig(64, 64, 32, 4, 3, "ieee")
    block_n = 128 if N >= 1024 else 64
    return MatmulConfig(64, block_n, 64, 4, 4 if K >= 256 else 2, "ieee")


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def _check(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None) -> None:
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"invariant_matmul: x must be [M, K] and w [N, K], got {tuple(x_MK.shape)} and "
                         f"{tuple(w_NK.shape)}")
    if x_MK.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w_NK.dtype != x_MK.dtype:
        raise ValueError(f"invariant_matmul: x and w must share one dtype of float32, bfloat16, float16; got "
                         f"{x_MK.dtype} and {w_NK.dtype}")
    if bias_N is not None and (bias_N.shape != (w_NK.shape[0],) or bias_N.device != x_MK.device):
        raise ValueError(f"invariant_matmul: bias must be [N] = [{w_NK.shape[0]}] on {x_MK.device}, got "
                         f"{tuple(bias_N.shape)} on {bias_N.device}")
    if w_NK.device != x_MK.device:
        raise ValueError(f"invariant_matmul: w is on {w_NK.device} but x is on {x_MK.device}")


def invariant_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                     fp32_out: bool = False, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> y [M, N] in x's dtype (fp32 with fp32_out).

    fp32 accumulation over K in one order fixed by matmul_config(N, K, ...); rows of x and w need a
    contiguous last dim (others are made so). `config` pins another config (tests only). Allocates y.
    """
    _check(x_MK, w_NK, bias_N)
    x_MK = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    w_NK = w_NK if w_NK.stride(1) == 1 else w_NK.contiguous()
    M, K = x_MK.shape
    N = w_NK.shape[0]
    y = torch.empty(M, N, dtype=torch.float32 if fp32_out else x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias_N.float().expand(M, N)) if bias_N is not None else y.zero_()
    cfg = config or matmul_config(N, K, x_MK.dtype, x_MK.device.type)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    grid = (min(tiles, _programs(x_MK.device)),)
    _inv_matmul_kernel[grid](x_MK, w_NK, bias_N if bias_N is not None else w_NK, y, M, N, K,
                             x_MK.stride(0), w_NK.stride(0), y.stride(0), HAS_BIAS=bias_N is not None,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
                             DOT_PRECISION=cfg.dot_precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def invariant_matmul_ref(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                         fp32_out: bool = False) -> torch.Tensor:
    """Plain-torch reference: the product in float64, rounded once to the output dtype."""
    y = x_MK.double() @ w_NK.double().T
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(torch.float32 if fp32_out else x_MK.dtype)
