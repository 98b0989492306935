"""Batch-invariant attention in Triton: one kernel body for the packed causal pass (prefill, the
learner) and for paged decode, the GPU twin of csrc/batch_invariant.cpp's inv_attention_varlen and
inv_paged_decode (rlengine/model/batch_invariant.py and engine/attention/invariant_triton_backend.py
call it).

One program per (query token, KV head) scores the G query heads of its GQA group. The query's keys
0..ctx-1 are read in chunks of CHUNK = 32 keys aligned to absolute positions ([0, 32), [32, 64), ...),
each chunk's scores, softmax statistics and P @ V taken at one fixed tile shape, and the chunks merged
into the running (max, sum, accumulator) in position order. The token's chunk sequence depends on its
position alone, not on the batch, the packing or the page layout, and the two entry points differ
only in where a key row is read from (PAGED: through kv_indices; else the packed rows of the token's
sequence); so decode over pages gives the packed causal pass's bits. There is no split-KV, no query
tiling and no shared-prefix pass: each query reads its own prefix, which costs speed (one query row
per program) and is what batch invariance asks.
Precision: scores and the softmax in fp32 (base 2); for 16-bit K/V the probabilities enter P @ V as
a hi + lo pair of 16-bit values, as in paged_decode.py. Key rows are addressed with int64 offsets.

Dimension legend: T packed tokens, B sequences, H query heads, Hkv KV heads, G = H // Hkv, D head
dim, P page size. BLOCK_G / BLOCK_D are tile sizes (BLOCK_G >= 16: tl.dot's smallest tile).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlengine.kernels._triton import tl, triton

CHUNK = 32  # keys per chunk: the grid every query's keys are read in, aligned to absolute positions
_LOG2E = 1.4426950408889634


@triton.jit
def _inv_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_start_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qt, stride_qh, stride_kn, stride_kp, stride_kh, stride_vn, stride_vp, stride_vh,
    stride_ot, stride_oh,
    PAGED: tl.constexpr, G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_P: tl.constexpr,
):
    t = tl.program_id(0)
    hkv = tl.program_id(1)
    if PAGED:  # t is a sequence of the decode batch; its keys are its pages' rows
        page_begin = tl.load(kv_indptr_ptr + t)
        ctx = (tl.load(kv_indptr_ptr + t + 1) - page_begin - 1) * P + tl.load(kv_last_page_len_ptr + t)
    else:      # t is a packed token; its keys are its sequence's rows up to itself
        page_begin = tl.load(seq_start_ptr + t)
        ctx = t - page_begin + 1

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = hkv * G + offs_g
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)                # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, ctx, CHUNK):  # the absolute-position chunk grid, in position order
        keys = start + offs_n
        mask_n = keys < ctx
        if PAGED:
            page = tl.load(kv_indices_ptr + page_begin + keys // P, mask=mask_n, other=0).to(tl.int64)
            k_rows = page * stride_kn + (keys % P) * stride_kp
            v_rows = page * stride_vn + (keys % P) * stride_vp
        else:
            rows = (page_begin + keys).to(tl.int64)
            k_rows = rows * stride_kn
            v_rows = rows * stride_vn
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + (k_rows + hkv * stride_kh)[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_G, CHUNK]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a chunk holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (v_rows + hkv * stride_vh)[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        p_hi = p.to(v.dtype)
        pv = tl.dot(p_hi, v, input_precision=DOT_PRECISION)
        if SPLIT_P:  # the rounding residual of p: ~2^-17 relative instead of 2^-9
            pv += tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def _launch(q, k, v, out, seq_start, tables, strides_k, strides_v, scale, paged: bool, P: int) -> None:
    rows, H, D = q.shape
    Hkv = strides_k[3]
    G = H // Hkv
    _inv_attention_kernel[(rows, Hkv)](
        q, k, v, out, seq_start, *tables, scale * _LOG2E,
        q.stride(0), q.stride(1), *strides_k[:3], *strides_v, out.stride(0), out.stride(1),
        PAGED=paged, G=G, P=P, D=D, CHUNK=CHUNK, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), DOT_PRECISION="ieee", SPLIT_P=q.dtype != torch.float32,
        num_warps=4)


def _check_qkv(op: str, q, k, v) -> None:
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{op}: q, k and v must share one dtype of float32, bfloat16, float16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: q is on {q.device} but k on {k.device} and v on {v.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs a contiguous last (head) dimension, strides {x.stride()}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] < 1 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{op}: q [.., H, D] and k [.., Hkv, D] need one D and H a multiple of Hkv, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")


def invariant_attention_varlen(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                               cu_seqlens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Causal attention of sequences packed along T -> o [T, H, D] in q's dtype (a new tensor).

    q [T, H, D], k / v [T, Hkv, D] with a contiguous head dim (other strides taken as they are);
    cu_seqlens int [B+1] from 0 to T, on any device (copied to q's; a host cu_seqlens is read there).
    """
    _check_qkv("invariant_attention_varlen", q_THD, k_TKD, v_TKD)
    T = q_THD.shape[0]
    if q_THD.dim() != 3 or k_TKD.dim() != 3 or v_TKD.shape != k_TKD.shape or k_TKD.shape[0] != T:
        raise ValueError(f"invariant_attention_varlen: q must be [T, H, D] and k, v [T, Hkv, D], got "
                         f"{tuple(q_THD.shape)}, {tuple(k_TKD.shape)}, {tuple(v_TKD.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.shape[0] < 1:
        raise ValueError(f"invariant_attention_varlen: cu_seqlens must be int32/int64 [B+1], got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type == "cpu" and (cu_seqlens[0] != 0 or cu_seqlens[-1] != T
                                            or (cu_seqlens.diff() < 0).any()):
        raise ValueError(f"invariant_attention_varlen: cu_seqlens must rise from 0 to T = {T}, got "
                         f"{cu_seqlens.tolist()}")
    out = torch.empty(q_THD.shape, dtype=q_THD.dtype, device=q_THD.device)
    if T == 0:
        return out
    cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    # each token's first key row: cu[b] for the sequence b whose range [cu[b], cu[b+1]) holds it
    tokens = torch.arange(T, device=q_THD.device, dtype=torch.int32)
    seq_start = cu[torch.searchsorted(cu[1:], tokens, right=True)].contiguous()
    Hkv = k_TKD.shape[1]
    strides_k = (k_TKD.stride(0), 0, k_TKD.stride(1), Hkv)
    strides_v = (v_TKD.stride(0), 0, v_TKD.stride(1))
    _launch(q_THD, k_TKD, v_TKD, out, seq_start, (seq_start, seq_start, seq_start), strides_k, strides_v,
            sm_scale, paged=False, P=1)
    return out


def invariant_paged_decode(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                           sm_scale: float, out: torch.Tensor) -> torch.Tensor:
    """One query token per sequence against its paged K/V, written to out [B, H, D] (no allocation, no sync).

    q [B, H, D] (contiguous head dim); k_cache / v_cache [num_blocks, P, Hkv, D]; FlashInfer CSR page
    tables, int32 contiguous: kv_indptr [B+1], kv_indices [pages], kv_last_page_len [B] in 1..P. The
    tables are not range-checked (no device assert): the engine builds them from its block tables.
    """
    _check_qkv("invariant_paged_decode", q_BHD, k_cache, v_cache)
    B = q_BHD.shape[0]
    if q_BHD.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"invariant_paged_decode: q must be [B, H, D] and k_cache, v_cache [num_blocks, P, Hkv, D],"
                         f" got {tuple(q_BHD.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    for name, t, n in (("kv_indptr", kv_indptr, B + 1), ("kv_indices", kv_indices, None),
                       ("kv_last_page_len", kv_last_page_len, B)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or (n is not None and t.shape[0] != n) \
                or t.device != q_BHD.device:
            raise ValueError(f"invariant_paged_decode: {name} must be contiguous int32 [{n or 'pages'}] on "
                             f"{q_BHD.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if out.shape != q_BHD.shape or out.dtype != q_BHD.dtype or out.stride(-1) != 1 or out.device != q_BHD.device:
        raise ValueError(f"invariant_paged_decode: out must be {q_BHD.dtype} {tuple(q_BHD.shape)} with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    if B:
        strides_k = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2])
        strides_v = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        _launch(q_BHD, k_cache, v_cache, out, kv_indptr, (kv_indptr, kv_indices, kv_last_page_len), strides_k,
                strides_v, sm_scale, paged=True, P=k_cache.shape[1])
    return out


def invariant_attention_ref(q_THD, k_TKD, v_TKD, cu_seqlens, sm_scale: float) -> torch.Tensor:
    """Plain-torch reference: causal SDPA per sequence in float64, returned in float64."""
    out = torch.empty(q_THD.shape, dtype=torch.float64, device=q_THD.device)
    G = q_THD.shape[1] // k_TKD.shape[1]
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        q, k, v = (x[a:b].double().transpose(0, 1) for x in (q_THD, k_TKD, v_TKD))
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
        out[a:b] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale).transpose(0, 1)
    return out
