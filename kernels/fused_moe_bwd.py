"""Fused MoE backward: the down projection and SwiGLU backward, dx, dW13, dW2 and d topk_weights.

Called by FusedMoEFunction (fused_moe.py) with what the forward saved: the inputs, the sort and the
gate/up pre-activations gu. Two variants, chosen by fused_moe's `backward` argument:
- "v1" (the default): intermediates in pair order. dgu [N, 2F] and hw = w*h [N, F] are written by
  pair; dx per pair [N, C] then a [T, K, C] sum; dW13 and dW2 in two launches, one program per
  (expert, tile) reducing 32 rows a step with both operands gathered. Deterministic.
- "sorted": gu was saved in expert-sorted order (one row per sorted position, [N_pad, 2F]), and
  dgu is written in that order, so every weight-gradient tile reads one operand contiguously and
  gathers only x or dy. h is recomputed from gu inside the dW2 tiles (no hw buffer); dx sums the K
  slots in the GEMM's epilogue (fp32 atomics into [T, C], no [N, C] buffer; the add order of a
  token's K rows varies, so the last bits of dx do too); dW13 and dW2 are ONE persistent launch
  walking (expert, tile) in expert order with 64-row reduction steps.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k, N = T*K routed pairs,
N_pad = len(sorted_token_ids) (N plus per-expert padding to BLOCK_M).
"""

from __future__ import annotations

import torch

from rlengine.kernels._triton import tl, triton

from . import moe_gemm as gemm
from .moe_align import MoEAlignment
from .moe_gemm import _block_rows, _expert_matmul, _sorted_rows
from .moe_tuning import tuned_launch

BACKWARDS = ("v1", "sorted")

# ----------------------------------------------------------------------------------------------
# Triton kernels.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _down_bwd_kernel(dy_ptr, w2_ptr, gu_ptr, topk_w_ptr, dgu_ptr, hw_ptr, dtw_part_ptr,
                     sorted_ids_ptr, expert_ids_ptr, N, F, C,
                     stride_dy, stride_we, stride_wc, stride_wf, stride_gu, stride_hw, stride_part,
                     TOPK: tl.constexpr, SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Per pair p (token t, weight w, expert e), with dh = dy[t] . w2[e] (an [F] row):
    dtw_part[p, pid_n] = sum_f dh * h over this F tile, dgu = SwiGLU backward of w * dh,
    and (not SORTED) hw = w * h, the B operand of v1's dW2. h = silu(g) * u is recomputed from
    saved gu. SORTED: gu and dgu rows are sorted positions, else pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M)
    rows = _sorted_rows(pid_m, BLOCK_M) if SORTED else pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    dh, _ = _expert_matmul(dy_ptr, stride_dy, pair // TOPK, valid, w2_ptr + e * stride_we, stride_wc,
                           stride_wf, offs_n, n_mask, 0, C, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    mask = valid[:, None] & n_mask[None, :]
    gu_ptrs = gu_ptr + rows[:, None] * stride_gu + offs_n[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    tl.store(dtw_part_ptr + pair * stride_part + pid_n, tl.sum(dh * h, axis=1), mask=valid)
    dh = dh * w
    dgu_ptrs = dgu_ptr + rows[:, None] * stride_gu + offs_n[None, :]
    tl.store(dgu_ptrs, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptrs + F, (dh * silu).to(dgu_ptr.dtype.element_ty), mask=mask)
    if not SORTED:
        tl.store(hw_ptr + pair[:, None] * stride_hw + offs_n[None, :], (h * w).to(hw_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, sorted_ids_ptr, expert_offsets_ptr, N, P, Q,
                        stride_a, stride_b, stride_oe, stride_op, stride_oq,
                        TOPK: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """v1: out[e, p, q] = sum over the rows r of expert e of A[r, p] * B[r, q].

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


@triton.jit
def _sorted_wgrad_tile(a_ptr, stride_a, tw_ptr, b_ptr, stride_b, sorted_ids_ptr, start, end, N, F,
                       offs_p, p_mask, offs_q, q_mask, TOPK: tl.constexpr, RECOMPUTE_H: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """acc[p, q] = sum over sorted rows r in [start, end) of A[r, p] * B[token(r), q].

    A is a sorted-layout buffer read contiguously (dgu), or with RECOMPUTE_H the SwiGLU output
    w * silu(g) * u rebuilt from the sorted pre-activations gu; B (x or dy) is gathered by token."""
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(start, end, BLOCK_R):
        rows = (r0 + offs_r).to(tl.int64)
        pair = tl.load(sorted_ids_ptr + rows, mask=rows < end, other=N).to(tl.int64)
        valid = pair < N
        a_ptrs = a_ptr + rows[:, None] * stride_a + offs_p[None, :]
        a_mask = valid[:, None] & p_mask[None, :]
        if RECOMPUTE_H:
            g = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(a_ptrs + F, mask=a_mask, other=0.0).to(tl.float32)
            w = tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            a = (g * tl.sigmoid(g) * u * w[:, None]).to(b_ptr.dtype.element_ty)
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + (pair // TOPK)[:, None] * stride_b + offs_q[None, :], mask=valid[:, None] & q_mask[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _sorted_wgrad_kernel(dgu_ptr, gu_ptr, tw_ptr, x_ptr, dy_ptr, dw13_ptr, dw2_ptr, sorted_ids_ptr,
                         expert_offsets_ptr, N, F, C, E, stride_dgu, stride_gu, stride_x, stride_dy,
                         stride_13e, stride_13f, stride_13c, stride_2e, stride_2c, stride_2f,
                         DO_W13: tl.constexpr, DO_W2: tl.constexpr, TOPK: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """dW13[e] = dgu_e^T x_e ([2F, C]) and dW2[e] = (dy_e^T (w h)_e) ([C, F], built as its [F, C]
    transpose), one persistent launch: program i takes tiles i, i + grid, ... of the list ordered by
    expert (expert 0's dW13 tiles, its dW2 tiles, expert 1's, ...), so programs running together
    share one expert's rows of x and dy in L2. Every tile is written (zeros for an empty expert)."""
    n_q = tl.cdiv(C, BLOCK_Q)
    n13 = tl.cdiv(2 * F, BLOCK_P) * n_q if DO_W13 else 0
    n2 = tl.cdiv(F, BLOCK_P) * n_q if DO_W2 else 0
    per_e = n13 + n2
    offs = tl.arange(0, BLOCK_P)
    for tile in range(tl.program_id(0), E * per_e, tl.num_programs(0)):
        e = (tile // per_e).to(tl.int64)
        i = tile % per_e
        start = tl.load(expert_offsets_ptr + e)
        end = tl.load(expert_offsets_ptr + e + 1)
        if i < n13:
            offs_p = (i // n_q) * BLOCK_P + offs
            offs_q = (i % n_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
            p_mask, q_mask = offs_p < 2 * F, offs_q < C
            acc = _sorted_wgrad_tile(dgu_ptr, stride_dgu, tw_ptr, x_ptr, stride_x, sorted_ids_ptr, start, end, N, F,
                                     offs_p, p_mask, offs_q, q_mask, TOPK, False, BLOCK_P, BLOCK_Q, BLOCK_R,
                                     DOT_PRECISION)
            tl.store(dw13_ptr + e * stride_13e + offs_p[:, None] * stride_13f + offs_q[None, :] * stride_13c,
                     acc.to(dw13_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])
        else:
            j = i - n13
            offs_p = (j // n_q) * BLOCK_P + offs
            offs_q = (j % n_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
            p_mask, q_mask = offs_p < F, offs_q < C
            acc = _sorted_wgrad_tile(gu_ptr, stride_gu, tw_ptr, dy_ptr, stride_dy, sorted_ids_ptr, start, end, N, F,
                                     offs_p, p_mask, offs_q, q_mask, TOPK, True, BLOCK_P, BLOCK_Q, BLOCK_R,
                                     DOT_PRECISION)
            tl.store(dw2_ptr + e * stride_2e + offs_p[:, None] * stride_2f + offs_q[None, :] * stride_2c,
                     acc.to(dw2_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers.
# ----------------------------------------------------------------------------------------------

def down_backward(dy_TC, w2_ECF, gu, topk_weights_TK, align: MoEAlignment, cfg: gemm.MoEConfig, *,
                  sorted_rows: bool = False):
    """Backward through the down projection and SwiGLU. Returns dgu (x dtype, [N, 2F] or with
    sorted_rows [N_pad, 2F] in gu's sorted layout), hw = w*h [N, F] (None with sorted_rows) and
    d topk_weights [T, K] (fp32 partial sums over F tiles, summed here)."""
    gemm.check_align(align, cfg)
    N, (_, C, F) = align.num_pairs, w2_ECF.shape
    T, tiles = dy_TC.shape[0], cfg.tiles("down_bwd" if sorted_rows else None)
    dgu = gemm.alloc((gu.shape[0], 2 * F), dy_TC.dtype, dy_TC.device)
    hw = None if sorted_rows else gemm.alloc((N, F), dy_TC.dtype, dy_TC.device)
    n_tiles = triton.cdiv(F, tiles.block_n)
    dtw_part = gemm.alloc((N, n_tiles), torch.float32, dy_TC.device)
    _down_bwd_kernel[(align.expert_ids.numel(), n_tiles)](
        dy_TC, w2_ECF, gu, topk_weights_TK, dgu, dgu if hw is None else hw, dtw_part, align.sorted_token_ids,
        align.expert_ids, N, F, C, dy_TC.stride(0), *w2_ECF.stride(), gu.stride(0),
        dgu.stride(0) if hw is None else hw.stride(0), dtw_part.stride(0), TOPK=N // T, SORTED=sorted_rows,
        BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **gemm.launch_opts(tiles, dy_TC.dtype))
    return dgu, hw, dtw_part.sum(1).view(T, N // T)


def weight_grad(a, b, align: MoEAlignment, cfg: gemm.MoEConfig, *, a_by_token: bool, b_by_token: bool,
                num_experts: int, topk: int, transpose_out: bool = False):
    """v1: dW[e] = A_e^T B_e over expert e's rows: [E, P, Q] (or [E, Q, P] stored transposed when
    transpose_out) in a's dtype, where A rows are [P] and B rows are [Q]."""
    P, Q = a.shape[1], b.shape[1]
    shape = (num_experts, Q, P) if transpose_out else (num_experts, P, Q)
    out = gemm.alloc(shape, a.dtype, a.device)
    s_op, s_oq = (out.stride(2), out.stride(1)) if transpose_out else (out.stride(1), out.stride(2))
    bw = cfg.wgrad_block
    grid = (triton.cdiv(P, bw), triton.cdiv(Q, bw), num_experts)
    _weight_grad_kernel[grid](a, b, out, align.sorted_token_ids, align.expert_offsets, align.num_pairs, P, Q,
                              a.stride(0), b.stride(0), out.stride(0), s_op, s_oq, TOPK=topk,
                              A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, BLOCK_P=bw, BLOCK_Q=bw,
                              BLOCK_R=cfg.wgrad_block_r, **gemm.launch_opts(cfg, a.dtype))
    return out


def persistent_programs(device: torch.device, tiles: int) -> int:
    """Grid of the persistent weight-gradient launch: 2 programs per SM on a GPU, capped by the
    tile count; 3 under the interpreter (so the tests walk the tile loop with a stride)."""
    if device.type != "cuda":
        return max(1, min(tiles, 3))
    return max(1, min(tiles, 2 * torch.cuda.get_device_properties(device).multi_processor_count))


def sorted_weight_grads(dgu_SF2, gu_SF2, topk_weights_TK, x_TC, dy_TC, align: MoEAlignment, cfg: gemm.MoEConfig,
                        *, need_w13: bool = True, need_w2: bool = True):
    """dW13 [E, 2F, C] and dW2 [E, C, F] (x dtype; None where not needed) from the sorted-layout dgu
    and gu ([N_pad, 2F]) in one persistent launch."""
    E = align.expert_offsets.numel() - 1
    F, C = gu_SF2.shape[1] // 2, x_TC.shape[1]
    tiles = cfg.tiles("wgrad")
    dw13 = gemm.alloc((E, 2 * F, C), x_TC.dtype, x_TC.device) if need_w13 else None
    dw2 = gemm.alloc((E, C, F), x_TC.dtype, x_TC.device) if need_w2 else None
    n_q = triton.cdiv(C, tiles.block_n)
    total = E * n_q * ((triton.cdiv(2 * F, tiles.block_p) if need_w13 else 0) +
                       (triton.cdiv(F, tiles.block_p) if need_w2 else 0))
    if total == 0:
        return dw13, dw2
    d13, d2 = (dw13 if dw13 is not None else x_TC), (dw2 if dw2 is not None else x_TC)
    s13 = dw13.stride() if dw13 is not None else (0, 0, 0)
    s2 = dw2.stride() if dw2 is not None else (0, 0, 0)
    _sorted_wgrad_kernel[(persistent_programs(x_TC.device, total),)](
        dgu_SF2, gu_SF2, topk_weights_TK, x_TC, dy_TC, d13, d2, align.sorted_token_ids, align.expert_offsets,
        align.num_pairs, F, C, E, dgu_SF2.stride(0), gu_SF2.stride(0), x_TC.stride(0), dy_TC.stride(0), *s13, *s2,
        DO_W13=need_w13, DO_W2=need_w2, TOPK=align.num_pairs // x_TC.shape[0], BLOCK_P=tiles.block_p,
        BLOCK_Q=tiles.block_n, BLOCK_R=tiles.block_k, **gemm.launch_opts(tiles, x_TC.dtype))
    return dw13, dw2


# ----------------------------------------------------------------------------------------------
# The two backward variants.
# ----------------------------------------------------------------------------------------------

def backward_v1(dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu_NF2, cfg, align, need):
    """Four launches: dh/SwiGLU-backward/d topk_weights, dx per pair (then a [T, K, C] sum), dW13, dW2."""
    T, C = x_TC.shape
    E, K = w13_EFC.shape[0], topk_weights_TK.shape[1]
    dgu, hw, dtw_TK = down_backward(dy_TC, w2_ECF, gu_NF2, topk_weights_TK, align, cfg)
    dx = dw13 = dw2 = None
    if need[0]:
        dx = gemm.pair_gemm(dgu, w13_EFC, align, cfg, reduce_dim=1).view(T, K, C).sum(1)
    if need[1]:
        dw13 = weight_grad(dgu, x_TC, align, cfg, a_by_token=False, b_by_token=True, num_experts=E, topk=K)
    if need[2]:
        dw2 = weight_grad(dy_TC, hw, align, cfg, a_by_token=True, b_by_token=False, num_experts=E, topk=K)
    return dx, dw13, dw2, dtw_TK.to(topk_weights_TK.dtype)


def backward_sorted(dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu_SF2, cfg, align, need):
    """Three launches on the sorted layout: dh/SwiGLU-backward/d topk_weights (dgu sorted), dx with
    the top-k sum in its epilogue, and dW13 + dW2 in one persistent launch."""
    T, C = x_TC.shape
    dims = (align.num_pairs, w13_EFC.shape[0], C, w2_ECF.shape[2])

    def launch(kernel, run):
        return tuned_launch(kernel, cfg, dims, x_TC.device, x_TC.dtype, run)

    dgu, _, dtw_TK = launch("down_bwd", lambda c: down_backward(dy_TC, w2_ECF, gu_SF2, topk_weights_TK, align, c,
                                                                sorted_rows=True))
    dx = dw13 = dw2 = None
    if need[0]:
        # fp32 accumulator (16-bit atomics would round after every add), zeroed by each run
        dx = launch("dx", lambda c: gemm.pair_gemm(dgu, w13_EFC, align, c, reduce_dim=1, kernel="dx", a_sorted=True,
                                                   out_TN=torch.zeros(T, C, dtype=torch.float32, device=x_TC.device)))
        dx = dx.to(x_TC.dtype)
    if need[1] or need[2]:
        dw13, dw2 = launch("wgrad", lambda c: sorted_weight_grads(dgu, gu_SF2, topk_weights_TK, x_TC, dy_TC, align, c,
                                                                  need_w13=need[1], need_w2=need[2]))
    return dx, dw13, dw2, dtw_TK.to(topk_weights_TK.dtype)


def moe_backward(variant, dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, cfg, align, *, need=(True, True, True)):
    """(dx [T, C] | None, dW13 | None, dW2 | None, d topk_weights [T, K]) for `need` = which of x,
    w13, w2 want a gradient; gu in the layout the forward saved for `variant`."""
    if variant not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {variant!r}")
    fn = backward_v1 if variant == "v1" else backward_sorted
    return fn(dy_TC, x_TC, w13_EFC, w2_ECF, topk_weights_TK, gu, cfg, align, need)
