"""Fused MoE expert MLP (SwiGLU) in Triton: forward and backward, grouped GEMMs over sorted pairs.

Sits inside the Qwen3-MoE block (rlengine/model/moe.py): the model routes in plain torch
(softmax, top-k, renormalise), this op applies the experts. Pairs p = t*K + k are sorted by
expert into BLOCK_M-aligned segments on the device (moe_align.py); each GEMM program takes one
block of rows of one expert and gathers its activation rows by index (no padded copy of x).
Forward: gate/up GEMM with SwiGLU in the epilogue -> h [N, F]; down GEMM with the routing
weight applied -> one row per pair [N, C]; then a deterministic sum over the K slots (a
[T, K, C] reduction rather than atomics, so results are bitwise reproducible).
One kernel family and one config table serve decode (few rows per expert) and training.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k, N = T*K routed pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlengine.kernels._triton import tl, triton

from .moe_align import MoEAlignment, moe_align

# ----------------------------------------------------------------------------------------------
# Layer 1: Triton kernels.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M: tl.constexpr):
    """Pair indices of one sorted block, and which of them are real (padding = N)."""
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pair, pair < N


@triton.jit
def _expert_matmul(a_ptr, stride_am, a_rows, row_mask, b_ptr, stride_bk, stride_bn, offs_n, n_mask,
                   up_offset, KDIM, DUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[m, n] = sum_k A[a_rows[m], k] * B[k, n] in fp32 (A rows gathered, A's inner stride 1).

    With DUAL, also acc2 from a second B tile at b_ptr + up_offset, sharing the A loads
    (gate and up projections of the same rows)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    for k0 in range(0, KDIM, BLOCK_K):
        k_mask = offs_k < KDIM - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        acc = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc, input_precision=DOT_PRECISION)
        if DUAL:
            b2 = tl.load(b_ptrs + up_offset, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc2


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, sorted_ids_ptr, expert_ids_ptr, h_ptr, gu_ptr, N, F, C,
                    stride_xt, stride_we, stride_wf, stride_wc, stride_h, stride_gu,
                    TOPK: tl.constexpr, SAVE_PREACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """h[p, f] = silu(x[t] . w13[e, f]) * (x[t] . w13[e, F + f]); with SAVE_PREACT also the
    pre-activations gu[p, f] (gate) and gu[p, F + f] (up) for backward."""
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
        gu_ptrs = gu_ptr + pair[:, None] * stride_gu + offs_n[None, :]
        tl.store(gu_ptrs, g.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptrs + F, u.to(gu_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pair_gemm_kernel(a_ptr, b_ptr, scale_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, N, NOUT, KDIM,
                      stride_am, stride_be, stride_bk, stride_bn, stride_om,
                      HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[p, n] = scale[p] * sum_k a[p, k] * B[e, k, n], one row per pair (B via strides).

    Forward down projection (a = h, B = w2 read transposed, scale = routing weight) and the
    backward dx per pair (a = dgu, B = w13)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NOUT
    acc, _ = _expert_matmul(a_ptr, stride_am, pair, valid, b_ptr + e * stride_be, stride_bk, stride_bn,
                            offs_n, n_mask, 0, KDIM, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_bwd_kernel(dy_ptr, w2_ptr, gu_ptr, topk_w_ptr, dgu_ptr, hw_ptr, dtw_part_ptr,
                     sorted_ids_ptr, expert_ids_ptr, N, F, C,
                     stride_dy, stride_we, stride_wc, stride_wf, stride_gu, stride_hw, stride_part,
                     TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Per pair p (token t, weight w, expert e), with dh = dy[t] . w2[e] (an [F] row):
    dtw_part[p, pid_n] = sum_f dh * h over this F tile, dgu = SwiGLU backward of w * dh,
    hw = w * h (the B operand of dw2). h = silu(g) * u is recomputed from saved gu."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    dh, _ = _expert_matmul(dy_ptr, stride_dy, pair // TOPK, valid, w2_ptr + e * stride_we, stride_wc,
                           stride_wf, offs_n, n_mask, 0, C, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    mask = valid[:, None] & n_mask[None, :]
    gu_ptrs = gu_ptr + pair[:, None] * stride_gu + offs_n[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    tl.store(dtw_part_ptr + pair * stride_part + pid_n, tl.sum(dh * h, axis=1), mask=valid)
    dh = dh * w
    dgu_ptrs = dgu_ptr + pair[:, None] * stride_gu + offs_n[None, :]
    tl.store(dgu_ptrs, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptrs + F, (dh * silu).to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(hw_ptr + pair[:, None] * stride_hw + offs_n[None, :], (h * w).to(hw_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, sorted_ids_ptr, expert_offsets_ptr, N, P, Q,
                        stride_a, stride_b, stride_oe, stride_op, stride_oq,
                        TOPK: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """out[e, p, q] = sum over the rows r of expert e of A[r, p] * B[r, q].

    A row r is pair sorted_ids[r] or its token (A_BY_TOKEN), same for B. Each program owns one
    [BLOCK_P, BLOCK_Q] tile of one expert and writes it (zeros for an expert with no rows), so
    the result is deterministic and needs no zero-initialised buffer."""
    pid_p = tl.program_id(0)
    pid_q = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    start = tl.load(expert_offsets_ptr + e)
    end = tl.load(expert_offsets_ptr + e + 1)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = offs_p < P
    q_mask = offs_q < Q
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        pair = tl.load(sorted_ids_ptr + rows, mask=rows < end, other=N).to(tl.int64)
        valid = pair < N
        a_rows = pair // TOPK if A_BY_TOKEN else pair
        b_rows = pair // TOPK if B_BY_TOKEN else pair
        a = tl.load(a_ptr + a_rows[None, :] * stride_a + offs_p[:, None], mask=p_mask[:, None] & valid[None, :],
                    other=0.0)
        b = tl.load(b_ptr + b_rows[:, None] * stride_b + offs_q[None, :], mask=valid[:, None] & q_mask[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + e * stride_oe + offs_p[:, None] * stride_op + offs_q[None, :] * stride_oq
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Layer 2: configs, input checks and launchers.
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """Tile sizes of the grouped GEMMs (row-block kernels) and of the weight-gradient kernel."""

    block_m: int  # sorted rows per program; also the padding unit of moe_align
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    wgrad_block: int = 64  # BLOCK_P = BLOCK_Q of the dW kernel
    wgrad_block_r: int = 32  # rows reduced per step in the dW kernel

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "wgrad_block", "wgrad_block_r"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEConfig.{name} must be a power of two >= 16 (tl.dot), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MoEConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"MoEConfig.num_stages must be in [1, 6], got {self.num_stages}")


# (largest average rows per expert N/E, config). Decode has ~K*T/E << 16 rows per expert, so
# small BLOCK_M wastes least padding; training has hundreds to thousands and wants big tiles.
_CONFIG_TABLE = (
    (16, MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (64, MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    (512, MoEConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    (float("inf"), MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3, wgrad_block=128)),
)


class pin_config:
    """Pin one MoEConfig for every call (tests); pin_config(None) unpins. As a context manager
    it restores the previous pin on exit."""

    _pinned: MoEConfig | None = None

    def __init__(self, cfg: MoEConfig | None):
        if cfg is not None and not isinstance(cfg, MoEConfig):
            raise ValueError(f"pin_config expects a MoEConfig or None, got {type(cfg).__name__}")
        self._previous = pin_config._pinned
        pin_config._pinned = cfg

    def __enter__(self):
        return pin_config._pinned

    def __exit__(self, *exc):
        pin_config._pinned = self._previous
        return False


def select_config(num_pairs: int, num_experts: int, hidden: int, ffn: int) -> MoEConfig:
    """Config from the table keyed on average rows per expert, tiles clipped to the dims."""
    if pin_config._pinned is not None:
        return pin_config._pinned
    rows_per_expert = num_pairs / num_experts
    cfg = next(c for limit, c in _CONFIG_TABLE if rows_per_expert <= limit)
    small = max(16, triton.next_power_of_2(min(hidden, ffn)))
    return MoEConfig(block_m=cfg.block_m, block_n=min(cfg.block_n, small), block_k=min(cfg.block_k, small),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     wgrad_block=min(cfg.wgrad_block, small), wgrad_block_r=cfg.wgrad_block_r)


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


def _check_align(align: MoEAlignment, cfg: MoEConfig) -> None:
    if align.block_m != cfg.block_m:
        raise ValueError(f"align.block_m={align.block_m} must equal cfg.block_m={cfg.block_m}: "
                         "kernels read sorted rows in blocks of BLOCK_M")


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Every kernel output buffer comes from here (tests poison it with nan)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_opts(cfg: MoEConfig, dtype: torch.dtype) -> dict:
    # fp32 tiles take twice the shared memory per stage; one stage fewer keeps them in budget.
    stages = cfg.num_stages if dtype != torch.float32 else max(1, cfg.num_stages - 1)
    return {"num_warps": cfg.num_warps, "num_stages": stages,
            # fp32 runs must match the reference at 1e-4: no TF32 inside tl.dot.
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def gate_up(x_TC, w13_EFC, align: MoEAlignment, cfg: MoEConfig, *, save_preact: bool):
    """SwiGLU of the gate/up projections per pair: h [N, F] and, if save_preact, gu [N, 2F]
    (gate then up pre-activations), both in x's dtype. Pair rows are written by index."""
    _check_align(align, cfg)
    N, (_, F2, C) = align.num_pairs, w13_EFC.shape
    F = F2 // 2
    h = _alloc((N, F), x_TC.dtype, x_TC.device)
    gu = _alloc((N, F2), x_TC.dtype, x_TC.device) if save_preact else h  # h: unused placeholder
    grid = (align.expert_ids.numel(), triton.cdiv(F, cfg.block_n))
    _gate_up_kernel[grid](x_TC, w13_EFC, align.sorted_token_ids, align.expert_ids, h, gu, N, F, C,
                          x_TC.stride(0), *w13_EFC.stride(), h.stride(0), gu.stride(0),
                          TOPK=align.num_pairs // x_TC.shape[0], SAVE_PREACT=save_preact, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **_launch_opts(cfg, x_TC.dtype))
    return h, (gu if save_preact else None)


def pair_gemm(a_NK, w_E, align: MoEAlignment, cfg: MoEConfig, *, reduce_dim: int, scale_N=None):
    """out[p, :] = scale[p] * a[p, :] @ B_e with B_e = w_E[e] reduced over dim `reduce_dim`
    (1 or 2) of the [E, *, *] weight; returns [N, NOUT] in a's dtype."""
    _check_align(align, cfg)
    N, KDIM = a_NK.shape
    NOUT = w_E.shape[3 - reduce_dim]
    out = _alloc((N, NOUT), a_NK.dtype, a_NK.device)
    stride_bk, stride_bn = (w_E.stride(1), w_E.stride(2)) if reduce_dim == 1 else (w_E.stride(2), w_E.stride(1))
    grid = (align.expert_ids.numel(), triton.cdiv(NOUT, cfg.block_n))
    _pair_gemm_kernel[grid](a_NK, w_E, scale_N if scale_N is not None else a_NK, out, align.sorted_token_ids,
                            align.expert_ids, N, NOUT, KDIM, a_NK.stride(0), w_E.stride(0), stride_bk, stride_bn,
                            out.stride(0), HAS_SCALE=scale_N is not None, BLOCK_M=cfg.block_m,
                            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **_launch_opts(cfg, a_NK.dtype))
    return out


def down_backward(dy_TC, w2_ECF, gu_NF2, topk_weights_TK, align: MoEAlignment, cfg: MoEConfig):
    """Backward through the down projection and SwiGLU: returns dgu [N, 2F], hw = w*h [N, F]
    (x dtype) and d topk_weights [T, K] (fp32 partial sums over F tiles, summed here)."""
    _check_align(align, cfg)
    N, (_, C, F) = align.num_pairs, w2_ECF.shape
    T = dy_TC.shape[0]
    dgu = _alloc((N, 2 * F), dy_TC.dtype, dy_TC.device)
    hw = _alloc((N, F), dy_TC.dtype, dy_TC.device)
    n_tiles = triton.cdiv(F, cfg.block_n)
    dtw_part = _alloc((N, n_tiles), torch.float32, dy_TC.device)
    _down_bwd_kernel[(align.expert_ids.numel(), n_tiles)](
        dy_TC, w2_ECF, gu_NF2, topk_weights_TK, dgu, hw, dtw_part, align.sorted_token_ids, align.expert_ids,
        N, F, C, dy_TC.stride(0), *w2_ECF.stride(), gu_NF2.stride(0), hw.stride(0), dtw_part.stride(0),
        TOPK=N // T, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **_launch_opts(cfg, dy_TC.dtype))
    return dgu, hw, dtw_part.sum(1).view(T, N // T)


def weight_grad(a, b, align: MoEAlignment, cfg: MoEConfig, *, a_by_token: bool, b_by_token: bool,
                num_experts: int, topk: int, transpose_out: bool = False):
    """dW[e] = A_e^T B_e over expert e's rows: [E, P, Q] (or [E, Q, P] stored transposed when
    transpose_out) in a's dtype, where A rows are [P] and B rows are [Q]."""
    P, Q = a.shape[1], b.shape[1]
    shape = (num_experts, Q, P) if transpose_out else (num_experts, P, Q)
    out = _alloc(shape, a.dtype, a.device)
    s_op, s_oq = (out.stride(2), out.stride(1)) if transpose_out else (out.stride(1), out.stride(2))
    bw = cfg.wgrad_block
    grid = (triton.cdiv(P, bw), triton.cdiv(Q, bw), num_experts)
    _weight_grad_kernel[grid](a, b, out, align.sorted_token_ids, align.expert_offsets, align.num_pairs, P, Q,
                              a.stride(0), b.stride(0), out.stride(0), s_op, s_oq, TOPK=topk,
                              A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, BLOCK_P=bw, BLOCK_Q=bw,
                              BLOCK_R=cfg.wgrad_block_r, **_launch_opts(cfg, a.dtype))
    return out


def _forward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, *, save_preact: bool):
    T, C = x_TC.shape
    E, F2, _ = w13_EFC.shape
    K = topk_ids_TK.shape[1]
    cfg = select_config(T * K, E, C, F2 // 2)
    align = moe_align(topk_ids_TK, E, cfg.block_m)
    h, gu = gate_up(x_TC, w13_EFC, align, cfg, save_preact=save_preact)
    y_NC = pair_gemm(h, w2_ECF, align, cfg, reduce_dim=2, scale_N=topk_weights_TK)
    return y_NC.view(T, K, C).sum(1), (cfg, align, gu)


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd.
# ----------------------------------------------------------------------------------------------

class FusedMoEFunction(torch.autograd.Function):
    """Fused MoE with backward for x, w13, w2 and topk_weights (topk_ids: no gradient).

    Saved: inputs, the sort (int32, O(N)) and the pre-activations gu [N, 2F]. Backward
    recomputes h = silu(gate) * up elementwise from gu (no GEMM is recomputed) and runs four
    Triton launches: dh/SwiGLU-backward/d topk_weights, dx per pair (then a [T, K, C] sum),
    dW13 and dW2 (one program per expert tile, deterministic).
    """

    @staticmethod
    def forward(ctx, x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK):
        y_TC, (cfg, align, gu) = _forward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, save_preact=True)
        ctx.save_for_backward(x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu)
        ctx.cfg, ctx.align = cfg, align
        return y_TC

    @staticmethod
    def backward(ctx, dy_TC):
        x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu = ctx.saved_tensors
        grads = _backward(dy_TC.contiguous(), x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, ctx.cfg, ctx.align,
                          need=ctx.needs_input_grad[:3])
        return *grads, None


def _backward(dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu_NF2, cfg: MoEConfig, align: MoEAlignment, *,
              need=(True, True, True)):
    """The four backward launches: (dx [T, C] | None, dW13 | None, dW2 | None, d topk_weights [T, K])
    for `need` = which of x, w13, w2 want a gradient."""
    T, C = x_TC.shape
    E, K = w13_EFC.shape[0], topk_weights_TK.shape[1]
    dgu, hw, dtw_TK = down_backward(dy_TC, w2_ECF, gu_NF2, topk_weights_TK, align, cfg)
    dx = dw13 = dw2 = None
    if need[0]:
        dx = pair_gemm(dgu, w13_EFC, align, cfg, reduce_dim=1).view(T, K, C).sum(1)
    if need[1]:
        dw13 = weight_grad(dgu, x_TC, align, cfg, a_by_token=False, b_by_token=True, num_experts=E, topk=K)
    if need[2]:
        dw2 = weight_grad(dy_TC, hw, align, cfg, a_by_token=True, b_by_token=False, num_experts=E, topk=K)
    return dx, dw13, dw2, dtw_TK.to(topk_weights_TK.dtype)


# ----------------------------------------------------------------------------------------------
# Public entry and plain-torch reference.
# ----------------------------------------------------------------------------------------------

def fused_moe(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK) -> torch.Tensor:
    """y_TC = sum_k topk_weights[t, k] * (silu(x W_gate^T) * (x W_up^T)) W_down^T of expert topk_ids[t, k].

    x_TC [T, C]; w13_EFC [E, 2F, C] (gate rows, then up rows); w2_ECF [E, C, F];
    topk_weights_TK [T, K] in x's dtype; topk_ids_TK [T, K] int64/int32. All contiguous, one
    device (CUDA, or CPU under TRITON_INTERPRET=1). Returns y_TC [T, C] in x's dtype, fp32
    accumulation. No host sync; allocates O(N*(C + 2F)) scratch. Autograd-aware: without
    grad, pre-activations are not stored.
    """
    _check_inputs(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK)
    if x_TC.shape[0] == 0:
        return x_TC * 0  # empty [0, C]; no kernel launches on an empty grid
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_TC, w13_EFC, w2_ECF, topk_weights_TK)):
        return FusedMoEFunction.apply(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK)
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
