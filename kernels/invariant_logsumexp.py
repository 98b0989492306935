"""The batch-invariant log-sum-exp over the vocabulary in Triton: the GPU twin of
csrc/batch_invariant.cpp's inv_logsumexp, behind the sampler's and the learner's log-probs in
batch-invariant mode (rlengine/model/batch_invariant.py dispatches CUDA tensors here).

One program per row reads the row in chunks of BLOCK_V = 1024 in order, twice: the max (exact in
any order), then exp(z - max) added lane-wise into BLOCK_V fp32 lanes, chunk after chunk, the lanes
summed by one tree at the end. BLOCK_V is a constant, so a row's order of additions depends on V
alone, never on the number of rows. The log-softmax is z - lse (elementwise). Two reads of the row
instead of an online max: the sum then needs no rescaling, which is both simpler and closer.
Dimension legend: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import torch

from rlengine.kernels._triton import tl, triton

BLOCK_V = 1024  # vocabulary entries per chunk: fixed, the order of every row's additions


@triton.jit
def _inv_logsumexp_kernel(z_ptr, out_ptr, V, stride_z, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    z_row = z_ptr + row * stride_z
    mx = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        z = tl.load(z_row + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        mx = tl.maximum(mx, z)
    m = tl.max(mx, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: exp(-inf - 0) = 0, lse = -inf
    lanes = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        z = tl.load(z_row + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        lanes += tl.exp(z - m_safe)
    tl.store(out_ptr + row, m_safe + tl.log(tl.sum(lanes, 0)))


def invariant_logsumexp(z_NV: torch.Tensor) -> torch.Tensor:
    """log sum exp over V of fp32 z [N, V] (contiguous last dim) -> [N] fp32 (a new tensor); -inf for a row of -inf."""
    if z_NV.dim() != 2 or z_NV.dtype != torch.float32 or z_NV.stride(1) != 1:
        raise ValueError(f"invariant_logsumexp: z must be float32 [N, V] with a contiguous last dim, got "
                         f"{z_NV.dtype} {tuple(z_NV.shape)} strides {z_NV.stride()}")
    N, V = z_NV.shape
    out = torch.empty(N, dtype=torch.float32, device=z_NV.device)
    if N and V:
        _inv_logsumexp_kernel[(N,)](z_NV, out, V, z_NV.stride(0), BLOCK_V=BLOCK_V, num_warps=4)
    elif N:
        out.fill_(float("-inf"))
    return out


def invariant_logsumexp_ref(z_NV: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference in float64."""
    return z_NV.double().logsumexp(-1)
