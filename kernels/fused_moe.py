"""Fused MoE expert MLP (SwiGLU) in Triton: forward and backward, grouped GEMMs over sorted pairs.

Sits inside the Qwen3-MoE block (rlengine/model/moe.py): the model routes in plain torch
(softmax, top-k, renormalise), this op applies the experts. Pairs p = t*K + k are sorted by
expert into BLOCK_M-aligned segments on the device (moe_align.py); each GEMM program takes one
block of rows of one expert and gathers its activation rows by index (no padded copy of x).
Forward: gate/up GEMM with SwiGLU in the epilogue -> h [N, F]; down GEMM with the routing
weight applied -> one row per pair [N, C]; then a deterministic sum over the K slots (a
[T, K, C] reduction rather than atomics, so results are bitwise reproducible).
One kernel family and one config table serve decode (few rows per expert) and training.
The grouped-GEMM core and the configs are in moe_gemm.py, the two backward variants ("v1", the
default, and "sorted", which saves gu in expert-sorted order) in fused_moe_bwd.py.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k, N = T*K routed pairs.
"""

from __future__ import annotations

import torch

from rlengine.kernels._triton import tl, triton

from . import moe_gemm as gemm
from .fused_moe_bwd import BACKWARDS, moe_backward
from .moe_align import MoEAlignment, moe_align
from .moe_gemm import MoEConfig, Tiles, _block_rows, _expert_matmul, _sorted_rows, pin_config, select_config
from .moe_tuning import tuned_launch

__all__ = ["BACKWARDS", "MoEConfig", "Tiles", "pin_config", "select_config", "gate_up", "fused_moe", "fused_moe_ref"]

# ----------------------------------------------------------------------------------------------
# Layer 1: Triton kernels.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, sorted_ids_ptr, expert_ids_ptr, h_ptr, gu_ptr, N, F, C,
                    stride_xt, stride_we, stride_wf, stride_wc, stride_h, stride_gu,
                    TOPK: tl.constexpr, SAVE_PREACT: tl.constexpr, GU_SORTED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """h[p, f] = silu(x[t] . w13[e, f]) * (x[t] . w13[e, F + f]); with SAVE_PREACT also the
    pre-activations gu[r, f] (gate) and gu[r, F + f] (up) for backward, r = p or, GU_SORTED,
    the row's sorted position."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    g, u = _expert_matmul(x_ptr, stride_xt, pair // TOPK, valid, w13_ptr + e * stride_we, stride_wc,
                          stride_wf, offs_n, n_mask, F * stride_wf, C, True, BLOCK_M, BLOCK_N, BLOCK_K,
                          DOT_PRECISION)
    h = g * tl.sigmoid(g) * u
    mask = valid[:, None] & n_mask[None, :]
    tl.store(h_ptr + pair[:, None] * stride_h + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    if SAVE_PREACT:
        gu_rows = _sorted_rows(pid_m, BLOCK_M) if GU_SORTED else pair
        gu_ptrs = gu_ptr + gu_rows[:, None] * stride_gu + offs_n[None, :]
        tl.store(gu_ptrs, g.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptrs + F, u.to(gu_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Layer 2: input checks and launchers (configs: moe_gemm.py, tile choice: moe_tuning.py).
# ----------------------------------------------------------------------------------------------

def _check_inputs(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK) -> None:
    """Raise ValueError naming the offending tensor; no device sync (ids' range is not read)."""
    named = {"x_TC": x_TC, "w13_EFC": w13_EFC, "w2_ECF": w2_ECF, "topk_weights_TK": topk_weights_TK,
             "topk_ids_TK": topk_ids_TK}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = 3 if name.startswith("w") else 2
        if t.dim() != want:
            raise ValueError(f"{name} must be {want}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
        if t.device != x_TC.device:
            raise ValueError(f"{name} is on {t.device} but x_TC is on {x_TC.device}")
    if x_TC.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x_TC must be float16, bfloat16 or float32, got {x_TC.dtype}")
    for name in ("w13_EFC", "w2_ECF", "topk_weights_TK"):
        if named[name].dtype != x_TC.dtype:
            raise ValueError(f"{name} has dtype {named[name].dtype} but x_TC has {x_TC.dtype}")
    if topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids_TK must be int64 or int32, got {topk_ids_TK.dtype}")
    T, C = x_TC.shape
    E, F2, Cw = w13_EFC.shape
    if F2 % 2 or F2 == 0:
        raise ValueError(f"w13_EFC must be [E, 2F, C] with gate rows then up rows, got {tuple(w13_EFC.shape)}")
    if Cw != C:
        raise ValueError(f"w13_EFC hidden dim {Cw} != x_TC hidden dim {C} (w13_EFC {tuple(w13_EFC.shape)})")
    if tuple(w2_ECF.shape) != (E, C, F2 // 2):
        raise ValueError(f"w2_ECF must be [E, C, F] = {(E, C, F2 // 2)} to match w13_EFC "
                         f"{tuple(w13_EFC.shape)}, got {tuple(w2_ECF.shape)}")
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.shape[0] != T:
        raise ValueError(f"topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
                         f"{tuple(topk_weights_TK.shape)} must both be [T={T}, K]")
    K = topk_ids_TK.shape[1]
    if not 1 <= K <= E:
        raise ValueError(f"topk_ids_TK has K={K} experts per token, need 1 <= K <= E={E}")
    if x_TC.device.type != "cuda" and isinstance(_gate_up_kernel, triton.runtime.JITFunction):  # not interpreted
        raise ValueError(f"x_TC is on {x_TC.device}: the Triton kernels need a CUDA device or TRITON_INTERPRET=1; "
                         "use fused_moe_ref on the CPU")


def gate_up(x_TC, w13_EFC, align: MoEAlignment, cfg: MoEConfig, *, save_preact: bool, gu_sorted: bool = False):
    """SwiGLU of the gate/up projections per pair: h [N, F] and, if save_preact, gu (gate then up
    pre-activations, [N, 2F] by pair or with gu_sorted [N_pad, 2F] by sorted position; padding
    rows unwritten), both in x's dtype. Pair rows are written by index."""
    gemm.check_align(align, cfg)
    N, (_, F2, C) = align.num_pairs, w13_EFC.shape
    F, tiles = F2 // 2, cfg.tiles("gate_up")
    h = gemm.alloc((N, F), x_TC.dtype, x_TC.device)
    gu_rows = align.sorted_token_ids.numel() if gu_sorted else N
    gu = gemm.alloc((gu_rows, F2), x_TC.dtype, x_TC.device) if save_preact else h  # h: unused placeholder
    grid = (align.expert_ids.numel(), triton.cdiv(F, tiles.block_n))
    _gate_up_kernel[grid](x_TC, w13_EFC, align.sorted_token_ids, align.expert_ids, h, gu, N, F, C,
                          x_TC.stride(0), *w13_EFC.stride(), h.stride(0), gu.stride(0),
                          TOPK=align.num_pairs // x_TC.shape[0], SAVE_PREACT=save_preact, GU_SORTED=gu_sorted,
                          BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                          **gemm.launch_opts(tiles, x_TC.dtype))
    return h, (gu if save_preact else None)


def _forward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, *, save_preact: bool, gu_sorted: bool = False):
    T, C = x_TC.shape
    E, F2, _ = w13_EFC.shape
    K = topk_ids_TK.shape[1]
    cfg = select_config(T * K, E, C, F2 // 2)
    align = moe_align(topk_ids_TK, E, cfg.block_m)
    # the default path runs the call's shared tiles; the sorted one each kernel's tuned tiles
    launch = (lambda kernel, run: tuned_launch(kernel, cfg, (T * K, E, C, F2 // 2), x_TC.device, x_TC.dtype, run)
              ) if gu_sorted else (lambda kernel, run: run(cfg))
    h, gu = launch("gate_up", lambda c: gate_up(x_TC, w13_EFC, align, c, save_preact=save_preact, gu_sorted=gu_sorted))
    y_NC = launch("down", lambda c: gemm.pair_gemm(h, w2_ECF, align, c, reduce_dim=2, scale_N=topk_weights_TK,
                                                   kernel="down"))
    return y_NC.view(T, K, C).sum(1), (cfg, align, gu)


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd.
# ----------------------------------------------------------------------------------------------

class FusedMoEFunction(torch.autograd.Function):
    """Fused MoE with backward for x, w13, w2 and topk_weights (topk_ids: no gradient).

    Saved: inputs, the sort (int32, O(N)) and the pre-activations gu ([N, 2F] by pair for
    "v1", [N_pad, 2F] in sorted order for "sorted"). Backward recomputes h = silu(gate) * up
    elementwise from gu (no GEMM is recomputed); see fused_moe_bwd.py for each variant's launches.
    """

    @staticmethod
    def forward(ctx, x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, backward):
        y_TC, (cfg, align, gu) = _forward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, save_preact=True,
                                          gu_sorted=backward == "sorted")
        ctx.save_for_backward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu)
        ctx.cfg, ctx.align, ctx.variant = cfg, align, backward
        return y_TC

    @staticmethod
    def backward(ctx, dy_TC):
        x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu = ctx.saved_tensors
        grads = _backward(dy_TC.contiguous(), x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, ctx.cfg, ctx.align,
                          need=ctx.needs_input_grad[:3], variant=ctx.variant)
        return *grads, None, None


def _backward(dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, cfg: MoEConfig, align: MoEAlignment, *,
              need=(True, True, True), variant: str = "v1"):
    """(dx [T, C] | None, dW13 | None, dW2 | None, d topk_weights [T, K]) for `need` = which of x,
    w13, w2 want a gradient, through the backward `variant` (fused_moe_bwd.moe_backward)."""
    return moe_backward(variant, dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, cfg, align, need=need)


# ----------------------------------------------------------------------------------------------
# Public entry and plain-torch reference.
# ----------------------------------------------------------------------------------------------

def fused_moe(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, *, backward: str = "v1") -> torch.Tensor:
    """y_TC = sum_k topk_weights[t, k] * (silu(x W_gate^T) * (x W_up^T)) W_down^T of expert topk_ids[t, k].

    x_TC [T, C]; w13_EFC [E, 2F, C] (gate rows, then up rows); w2_ECF [E, C, F];
    topk_weights_TK [T, K] in x's dtype; topk_ids_TK [T, K] int64/int32. All contiguous, one
    device (CUDA, or CPU under TRITON_INTERPRET=1). Returns y_TC [T, C] in x's dtype, fp32
    accumulation. No host sync; allocates O(N*(C + 2F)) scratch. Autograd-aware: without
    grad, pre-activations are not stored. backward: "v1" (pair order, deterministic) or
    "sorted" (expert-sorted intermediates, fused top-k sum: dx's last bits vary from run to run
    with the order of fp32 atomics; see fused_moe_bwd.py).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    _check_inputs(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK)
    if x_TC.shape[0] == 0:
        return x_TC * 0  # empty [0, C]; no kernel launches on an empty grid
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_TC, w13_EFC, w2_ECF, topk_weights_TK)):
        return FusedMoEFunction.apply(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, backward)
    return _forward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, save_preact=False)[0]


def fused_moe_ref(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK) -> torch.Tensor:
    """Plain-torch oracle: a Python loop over experts with index_add, fp32 math, same
    signature and result dtype as fused_moe. Host-syncs (boolean indexing); differentiable."""
    T, C = x_TC.shape
    F = w13_EFC.shape[1] // 2
    y = torch.zeros(T, C, dtype=torch.float32, device=x_TC.device)
    for e in range(w13_EFC.shape[0]):
        tok, slot = torch.where(topk_ids_TK == e)
        if tok.numel() == 0:
            continue
        gu = x_TC[tok].float() @ w13_EFC[e].float().t()
        h = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
        out = (h @ w2_ECF[e].float().t()) * topk_weights_TK[tok, slot].float()[:, None]
        y = y.index_add(0, tok, out)
    return y.to(x_TC.dtype)
