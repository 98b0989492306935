"""Paged-KV decode attention in Triton: one query token per sequence against its paged K/V.

Data flow: the engine's attention backend calls `paged_decode` once per layer per decode step
with the page tables built in plan() (FlashInfer CSR form: kv_indptr, kv_indices,
kv_last_page_len) and a DecodeWorkspace it preallocated, so the hot path neither allocates nor
syncs with the host. Split-KV ("flash-decoding"): each program owns one (sequence, KV head,
split), reads every K/V row of its share of pages once, and scores all G query heads of the
GQA group against it with an online softmax; a second kernel merges the S partial results. With
one split the first kernel writes the output itself and the merge launch is skipped.
Precision: scores and the softmax are fp32; for 16-bit K/V the probabilities enter the P @ V
product as a hi + lo pair of 16-bit values (two dots), so the output carries fp32-like error, not
the 2^-9 per-probability rounding of a single bf16 dot (the GPU tests compare at 2^-8 |ref|).
Simplification: K/V rows are gathered token by token through kv_indices (BLOCK_N tokens per
step), so one code path serves every page size P, power of two or not.

Dimension legend: B sequences, H query heads, Hkv KV heads, G = H // Hkv query heads per KV
head, D head dim, P page (block) size, S KV splits. BLOCK_G / BLOCK_N / BLOCK_D / BLOCK_S are
tile sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlengine.kernels._triton import tl, triton

MAX_SPLITS = 64             # B=1 long-context decode needs ~2 CTAs per SM: 132 SMs / Hkv=4 -> 64 splits
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, merge) outweighs the parallelism
_BLOCK_N = 32               # K/V tokens per inner step
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    part_out_ptr, part_lse_ptr, out_ptr,
    qk_scale,          # sm_scale * log2(e): scores are kept in base 2 so exp2 is used throughout
    stride_qb, stride_qh,
    stride_kn, stride_kp, stride_kh,
    stride_vn, stride_vp, stride_vh,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    G: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_P: tl.constexpr, DIRECT: tl.constexpr,
):
    """One (sequence, KV head, split). DIRECT (one split): write out in its dtype; else the
    split's normalised output and log2-sum-exp to the partial buffers."""
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    page_begin = tl.load(kv_indptr_ptr + b)
    num_pages = tl.load(kv_indptr_ptr + b + 1) - page_begin
    ctx = (num_pages - 1) * P + tl.load(kv_last_page_len_ptr + b)
    # Each sequence splits its own pages evenly, so the launch depends on no per-step host value
    # (one CUDA graph serves every context length) and ragged batches stay balanced. Splits that
    # start past ctx run no iterations (empty split).
    pages_per_split = tl.cdiv(num_pages, num_splits)
    tok_begin = split * pages_per_split * P
    tok_end = tl.minimum(tok_begin + pages_per_split * P, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = hkv * G + offs_g                                                     # [BLOCK_G]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)               # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)                         # running max (base 2)
    l_i = tl.zeros([BLOCK_G], tl.float32)                                        # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(tok_begin, tok_end, BLOCK_N):
        toks = start + offs_n                                                    # [BLOCK_N]
        mask_n = toks < tok_end
        mask_nd = mask_n[:, None] & mask_d[None, :]
        # int64: offsets into a large cache overflow int32.
        blocks = tl.load(kv_indices_ptr + page_begin + toks // P, mask=mask_n, other=0).to(tl.int64)
        slot = toks % P
        k = tl.load(k_ptr + (blocks * stride_kn + slot * stride_kp + hkv * stride_kh)[:, None] + offs_d[None, :],
                    mask=mask_nd, other=0.0)                                     # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))         # finite: every step holds at least one token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (blocks * stride_vn + slot * stride_vp + hkv * stride_vh)[:, None] + offs_d[None, :],
                    mask=mask_nd, other=0.0)                                     # [BLOCK_N, BLOCK_D]
        p_hi = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_hi, v, input_precision=DOT_PRECISION)
        if SPLIT_P:  # the rounding residual of p, itself rounded: ~2^-17 relative instead of 2^-9
            acc += tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # zeros for an empty split
    mask_gd = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_yb + heads[:, None] * stride_yh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        o_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(o_ptrs, o, mask=mask_gd)
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < D
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))                                           # [BLOCK_S]
    lse_max = tl.max(lse, 0)          # finite: split 0 always holds the first token
    w = tl.exp2(lse - lse_max)        # 0 for empty splits
    o = tl.load(part_out_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)               # [BLOCK_S, BLOCK_D]
    y = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)                                 # [BLOCK_D]
    tl.store(out_ptr + b * stride_yb + h * stride_yh + offs_d, y.to(out_ptr.dtype.element_ty), mask=mask_d)


# ----------------------------------------------------------------------------- launcher


@dataclass(slots=True, kw_only=True)
class DecodeWorkspace:
    """Split-KV scratch for paged_decode, preallocated once by the attention backend.

    Flat buffers: a call with B sequences and S splits uses the first B*S*H rows, viewed as
    [B, H, S, D] and [B, H, S]; so S may grow as B shrinks (B*S <= max_rows)."""

    partial_out: torch.Tensor  # [max_rows * H * D] fp32: each split's normalised output
    partial_lse: torch.Tensor  # [max_rows * H] fp32: each split's log2-sum-exp of the scores, -inf if empty
    num_heads: int             # H
    head_dim: int              # D
    max_rows: int              # most (sequence, split) pairs one call may use

    def max_splits(self, batch: int) -> int:
        """The most splits a call with `batch` sequences fits in (0 when not even one)."""
        return min(MAX_SPLITS, self.max_rows // max(1, batch))

    def views(self, batch: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial_out [B, H, S, D], partial_lse [B, H, S]) for one call."""
        H, D = self.num_heads, self.head_dim
        n = batch * num_splits * H
        return (self.partial_out[: n * D].view(batch, H, num_splits, D),
                self.partial_lse[:n].view(batch, H, num_splits))


def alloc_workspace(max_batch: int, num_heads: int, head_dim: int, num_splits: int,
                    device: torch.device | str, *, num_kv_heads: int | None = None,
                    num_sms: int | None = None) -> DecodeWorkspace:
    """Partial buffers for calls of up to max_batch sequences with up to num_splits splits each.

    num_kv_heads=None: room for max_batch * num_splits (sequence, split) pairs, any pinned S.
    With num_kv_heads: only what choose_num_splits can pick for any B <= max_batch on this device
    (S shrinks as B grows), e.g. 256 rows instead of 16,384 for 256 sequences, Hkv=8, 132 SMs.
    num_sms: the SM count choose_num_splits plans for (None: the device's).
    """
    if max_batch < 1 or num_heads < 1 or head_dim < 1 or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"alloc_workspace: need max_batch, num_heads, head_dim >= 1 and 1 <= num_splits <= "
                         f"{MAX_SPLITS}, got {max_batch}, {num_heads}, {head_dim}, {num_splits}")
    if num_kv_heads is None:
        rows = max_batch * num_splits
    else:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"alloc_workspace: num_kv_heads must divide num_heads={num_heads}, got {num_kv_heads}")
        pages = 2**40  # no length cap: the most splits occupancy allows
        rows = max(b * min(num_splits, choose_num_splits(b, num_kv_heads, pages, 1, device, num_sms))
                   for b in range(1, max_batch + 1))
    return DecodeWorkspace(
        partial_out=torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device),
        partial_lse=torch.empty(rows * num_heads, dtype=torch.float32, device=device),
        num_heads=num_heads, head_dim=head_dim, max_rows=rows,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the Triton interpreter runs programs one after another


def choose_num_splits(batch: int, num_kv_heads: int, max_num_pages: int, page_size: int,
                      device: torch.device | str, num_sms: int | None = None) -> int:
    """Splits so that B*Hkv*S programs cover the SMs about twice, with >= MIN_TOKENS_PER_SPLIT tokens each.

    Depends only on host ints, so a CUDA-graph bucket (fixed B, and a page bound per context class,
    engine/cuda_graph.py) gets one value. 1 means no merge launch: the split kernel writes the output
    itself. num_sms: plan for this many SMs instead of the device's (the CPU launch counter simulates
    an H100/H200's 132 under the interpreter).
    """
    if num_sms is None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        num_sms = _num_sms(device)
    by_occupancy = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    by_length = max(1, max_num_pages * page_size // MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def _check_inputs(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out) -> None:
    if q.dim() != 3:
        raise ValueError(f"paged_decode: q must be [B, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode: k_cache and v_cache must both be [num_blocks, P, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"paged_decode: head dim of q ({D}) differs from k_cache's ({k_cache.shape[3]})")
    if H % Hkv != 0:
        raise ValueError(f"paged_decode: q heads H={H} must be a multiple of k_cache heads Hkv={Hkv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"paged_decode: q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"paged_decode: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
    for name, t, n in (("kv_indptr", kv_indptr, B + 1), ("kv_indices", kv_indices, None),
                       ("kv_last_page_len", kv_last_page_len, B)):
        if t.dtype != torch.int32 or t.dim() != 1 or (n is not None and t.shape[0] != n):
            want = f"[{n}]" if n is not None else "[num_pages]"
            raise ValueError(f"paged_decode: {name} must be int32 {want}, got {t.dtype} {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"paged_decode: {name} must be contiguous")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"paged_decode: out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)]
    for name, t in named:
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"paged_decode: {name} needs a contiguous last (head) dimension, strides {t.stride()}")
    for name, t in named[1:] + [("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                                ("kv_last_page_len", kv_last_page_len)]:
        if t is not None and t.device != q.device:
            raise ValueError(f"paged_decode: {name} is on {t.device} but q is on {q.device}")


def _check_workspace(ws: DecodeWorkspace, B: int, H: int, D: int, num_splits: int, device) -> None:
    if ws.partial_out.dtype != torch.float32 or ws.partial_lse.dtype != torch.float32 \
            or ws.partial_out.numel() < ws.max_rows * H * D or ws.partial_lse.numel() < ws.max_rows * H:
        raise ValueError("paged_decode: workspace buffers must be fp32 with max_rows * H * D and max_rows * H "
                         "elements (use alloc_workspace)")
    if ws.num_heads != H or ws.head_dim != D or num_splits > ws.max_splits(B):
        raise ValueError(f"paged_decode: workspace (max_rows={ws.max_rows}, H={ws.num_heads}, D={ws.head_dim}) "
                         f"cannot hold B={B}, H={H}, D={D} with num_splits={num_splits}")
    if ws.partial_out.device != device or ws.partial_lse.device != device:
        raise ValueError(f"paged_decode: workspace is on {ws.partial_out.device} but q is on {device}")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, sm_scale: float, max_num_pages: int,
                 out: torch.Tensor | None = None, workspace: DecodeWorkspace | None = None,
                 num_splits: int | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over paged K/V; returns out [B, H, D] in q.dtype.

    q [B, H, D] (any strides with a contiguous last dim); k_cache, v_cache [num_blocks, P, Hkv, D];
    kv_indptr int32 [B+1], kv_indices int32 [kv_indptr[-1]], kv_last_page_len int32 [B] in 1..P.
    max_num_pages: host int, about the most pages any sequence uses; it only chooses the number of
    splits S (each sequence then splits its own pages evenly), so any value is correct. num_splits
    pins S (tests, CUDA graphs); default choose_num_splits(), capped by what the workspace holds.
    S = 1 is one launch (no merge, no workspace use). With out= and workspace= given nothing is
    allocated and nothing syncs with the host; out is written in place.
    """
    _check_inputs(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out)
    B, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_num_pages, P, q.device)
        if workspace is not None:
            num_splits = max(1, min(num_splits, workspace.max_splits(B)))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode: num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    direct = num_splits == 1
    if direct:  # placeholders, never touched: the kernel writes out itself
        part_out, part_lse, out_strides, lse_strides = out, out, (0, 0, 0), (0, 0)
    else:
        if workspace is None:
            workspace = alloc_workspace(B, H, D, num_splits, q.device)
        _check_workspace(workspace, B, H, D, num_splits, q.device)
        part_out, part_lse = workspace.views(B, num_splits)
        out_strides, lse_strides = part_out.stride()[:3], part_lse.stride()[:2]

    G = H // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot needs every dim >= 16
    _split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, part_out, part_lse, out,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *out_strides, *lse_strides,
        out.stride(0), out.stride(1),
        G=G, P=P, D=D,
        BLOCK_G=max(16, triton.next_power_of_2(G)),  # tl.dot needs >= 16 rows; padded heads are masked
        BLOCK_N=_BLOCK_N, BLOCK_D=BLOCK_D,
        # fp32 inputs: full-precision dot, never TF32 (the fp32 path is the accuracy reference on GPU).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT_P=q.dtype != torch.float32, DIRECT=direct,
        num_warps=4,
    )
    if direct:
        return out
    BLOCK_S = triton.next_power_of_2(num_splits)
    _merge_kernel[(B, H)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        D=D, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
        num_warps=max(1, min(8, BLOCK_S * BLOCK_D // 1024)),  # <= 32 fp32 partials per thread
    )
    return out


# ----------------------------------------------------------------------------- reference


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, sm_scale: float) -> torch.Tensor:
    """Oracle: gather each sequence's pages into contiguous [ctx, Hkv, D] K/V and run SDPA in fp32.

    Same shapes as paged_decode; returns a new [B, H, D] tensor in q.dtype. Host-syncs (reads the
    page tables with .tolist()) and loops over sequences: for tests and baselines only.
    """
    B, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    indptr = kv_indptr.tolist()
    last_len = kv_last_page_len.tolist()
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        pages = kv_indices[indptr[b]:indptr[b + 1]].long()
        ctx = (len(pages) - 1) * P + last_len[b]
        k = k_cache[pages].reshape(-1, Hkv, D)[:ctx].float().transpose(0, 1)     # [Hkv, ctx, D]
        v = v_cache[pages].reshape(-1, Hkv, D)[:ctx].float().transpose(0, 1)     # [Hkv, ctx, D]
        k = k.repeat_interleave(H // Hkv, dim=0)                                 # [H, ctx, D]: head h reads h // G
        v = v.repeat_interleave(H // Hkv, dim=0)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=sm_scale)  # [H, 1, D]
        out[b] = o.squeeze(1).to(q.dtype)
    return out
