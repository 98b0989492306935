"""Cascade (shared-prefix) decode attention in Triton: a GRPO group reads its shared prompt pages once.

Data flow: the engine's attention backend builds a cascade plan per decode step (which batch rows
share which whole pages: rlengine/engine/attention/cascade.py) and calls `cascade_decode` per
layer. Three launches, all writing the split-KV partial buffers of paged_decode's DecodeWorkspace
viewed as [B, H, 1 + S, D]:
  1. `_prefix_kernel`, one program per (chunk, KV head): the chunk's rows * G query rows (G = H /
     Hkv) as one [BLOCK_M, D] tile against each shared K/V tile (a tensor-core dot with M rows, where
     plain decode runs G rows per program and reads the same pages once per sample); it writes slot 0
     (lse = -inf for rows of chunks without a prefix).
  2. paged_decode's `_split_kernel` over each row's own pages (the suffix), S splits into slots 1..S.
  3. paged_decode's `_merge_kernel` over the 1 + S slots: the max-subtracted log-sum-exp merge.
Precision as paged_decode (fp32 scores and softmax, hi + lo split of the 16-bit probabilities).
Not CUDA-graph safe: the chunk count is a per-step host value (the backend runs plain decode in graphs).

Dimension legend: B sequences, H query heads, Hkv KV heads, G = H // Hkv, D head dim, P page size,
C chunks, S suffix splits. BLOCK_M / BLOCK_N / BLOCK_D are tile sizes.
"""

from __future__ import annotations

import torch

from rlengine.kernels._triton import tl, triton
from rlengine.kernels.paged_decode import (_BLOCK_N, _LOG2E, DecodeWorkspace, _check_inputs, _merge_kernel,
                                           _split_kernel, choose_num_splits, paged_decode_ref)

MAX_ROWS_PER_PROGRAM = 64   # query rows (chunk rows * G) one prefix program holds: its BLOCK_M cap
MAX_ROWS_FP32 = 32          # fp32 tiles: 64 rows spill ~35 KB per thread on sm_90 (tools/sm90), 32 rows ~1.9 KB
MAX_SUFFIX_SPLITS = 4       # suffixes are a response long; a few splits keep B * Hkv * S programs busy


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, chunk_indptr_ptr, prefix_indptr_ptr, prefix_indices_ptr,
    part_out_ptr, part_lse_ptr,
    qk_scale,          # sm_scale * log2(e): base-2 scores, as in _split_kernel
    stride_qb, stride_qh,
    stride_kn, stride_kp, stride_kh,
    stride_vn, stride_vp, stride_vh,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    G: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_P: tl.constexpr,
):
    """One (chunk, KV head): all query rows of the chunk's sequences against the shared pages."""
    c = tl.program_id(0)
    hkv = tl.program_id(1)
    row_begin = tl.load(chunk_indptr_ptr + c)
    num_rows = (tl.load(chunk_indptr_ptr + c + 1) - row_begin) * G
    page_begin = tl.load(prefix_indptr_ptr + c)
    ctx = (tl.load(prefix_indptr_ptr + c + 1) - page_begin) * P  # whole pages only

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < num_rows
    mask_d = offs_d < D
    b = row_begin + offs_m // G                                                  # [BLOCK_M] sequence
    heads = hkv * G + offs_m % G                                                 # [BLOCK_M] query head
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_md, other=0.0)                                         # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        toks = start + offs_n
        mask_n = toks < ctx
        mask_nd = mask_n[:, None] & mask_d[None, :]
        blocks = tl.load(prefix_indices_ptr + page_begin + toks // P, mask=mask_n, other=0).to(tl.int64)
        slot = toks % P
        k = tl.load(k_ptr + (blocks * stride_kn + slot * stride_kp + hkv * stride_kh)[:, None] + offs_d[None, :],
                    mask=mask_nd, other=0.0)                                     # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_M, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (blocks * stride_vn + slot * stride_vp + hkv * stride_vh)[:, None] + offs_d[None, :],
                    mask=mask_nd, other=0.0)
        p_hi = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_hi, v, input_precision=DOT_PRECISION)
        if SPLIT_P:
            acc += tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + b[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o, mask=mask_md)
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh, lse, mask=mask_m)


def max_rows_per_program(dtype: torch.dtype) -> int:
    """The most query rows (chunk rows * G) one prefix program takes for this dtype."""
    return MAX_ROWS_FP32 if dtype == torch.float32 else MAX_ROWS_PER_PROGRAM


def alloc_cascade_workspace(max_batch: int, num_heads: int, head_dim: int,
                            device: torch.device | str) -> DecodeWorkspace:
    """Partial buffers for cascade_decode calls of up to max_batch sequences (1 + MAX_SUFFIX_SPLITS slots)."""
    rows = max_batch * (1 + MAX_SUFFIX_SPLITS)
    return DecodeWorkspace(partial_out=torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device),
                           partial_lse=torch.empty(rows * num_heads, dtype=torch.float32, device=device),
                           num_heads=num_heads, head_dim=head_dim, max_rows=rows)


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk_indptr: torch.Tensor,
                   prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, sm_scale: float, max_rows: int,
                   max_suffix_pages: int, workspace: DecodeWorkspace, out: torch.Tensor | None = None,
                   num_splits: int | None = None) -> torch.Tensor:
    """Shared-prefix decode attention; returns out [B, H, D] in q.dtype.

    q [B, H, D]; k_cache, v_cache [num_blocks, P, Hkv, D]; chunk_indptr int32 [C+1] (batch rows of each
    chunk, covering 0..B), prefix_indptr int32 [C+1] into prefix_indices (whole shared pages; a chunk
    without any reads no prefix); kv_indptr / kv_indices / kv_last_page_len: each row's own pages
    (FlashInfer CSR). max_rows (host): most rows in a chunk, max_rows * G <= max_rows_per_program(dtype).
    max_suffix_pages (host) only picks the suffix splits S; num_splits pins S (1..MAX_SUFFIX_SPLITS).
    Nothing is allocated when out= is given; nothing syncs with the host.
    """
    _check_inputs(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out)
    B, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    C = chunk_indptr.shape[0] - 1
    for name, t in (("chunk_indptr", chunk_indptr), ("prefix_indptr", prefix_indptr),
                    ("prefix_indices", prefix_indices)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"cascade_decode: {name} must be a contiguous int32 vector on {q.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if prefix_indptr.shape[0] != C + 1 or C < 1:
        raise ValueError(f"cascade_decode: chunk_indptr [{C + 1}] and prefix_indptr [{prefix_indptr.shape[0]}] "
                         "must both be [C+1] with C >= 1")
    cap = max_rows_per_program(q.dtype)
    if not 1 <= max_rows * G <= cap:
        raise ValueError(f"cascade_decode: max_rows * G = {max_rows} * {G} must be in 1..{cap} for {q.dtype}")
    if num_splits is None:
        num_splits = min(MAX_SUFFIX_SPLITS, choose_num_splits(B, Hkv, max_suffix_pages, P, q.device))
    S1 = 1 + num_splits
    if not 1 <= num_splits <= MAX_SUFFIX_SPLITS or workspace.num_heads != H or workspace.head_dim != D \
            or workspace.max_rows < B * S1 or workspace.partial_out.device != q.device:
        raise ValueError(f"cascade_decode: num_splits={num_splits} must be in 1..{MAX_SUFFIX_SPLITS} and the "
                         f"workspace (H={workspace.num_heads}, D={workspace.head_dim}, max_rows={workspace.max_rows}) "
                         f"must hold B * (1 + S) = {B * S1} rows of H={H}, D={D} on {q.device}")
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    part_out, part_lse = workspace.views(B, S1)                                  # [B, H, 1+S, D], [B, H, 1+S]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    _prefix_kernel[(C, Hkv)](
        q, k_cache, v_cache, chunk_indptr, prefix_indptr, prefix_indices, part_out, part_lse,
        sm_scale * _LOG2E, q.stride(0), q.stride(1), *kv_strides,
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        G=G, P=P, D=D, BLOCK_M=max(16, triton.next_power_of_2(max_rows * G)), BLOCK_N=_BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION=precision, SPLIT_P=q.dtype != torch.float32, num_warps=4,
    )
    suffix_out, suffix_lse = part_out[:, :, 1:], part_lse[:, :, 1:]               # slots 1..S
    _split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, suffix_out, suffix_lse, out,
        sm_scale * _LOG2E, q.stride(0), q.stride(1), *kv_strides,
        *suffix_out.stride()[:3], *suffix_lse.stride()[:2], out.stride(0), out.stride(1),
        G=G, P=P, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=_BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION=precision, SPLIT_P=q.dtype != torch.float32, DIRECT=False, num_warps=4,
    )
    BLOCK_S = triton.next_power_of_2(S1)
    _merge_kernel[(B, H)](
        part_out, part_lse, out, S1,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), D=D, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
        num_warps=max(1, min(8, BLOCK_S * BLOCK_D // 1024)),
    )
    return out


def cascade_decode_ref(q, k_cache, v_cache, chunk_indptr, prefix_indptr, prefix_indices, kv_indptr, kv_indices,
                       kv_last_page_len, *, sm_scale: float) -> torch.Tensor:
    """Oracle: each row's full page table (its chunk's prefix pages, then its own) through paged_decode_ref.

    Same arguments as cascade_decode; host-syncs (reads the tables): tests and baselines only.
    """
    chunks, pre = chunk_indptr.tolist(), prefix_indptr.tolist()
    indptr, pages = [0], []
    for c in range(len(chunks) - 1):
        shared = prefix_indices[pre[c]:pre[c + 1]]
        for b in range(chunks[c], chunks[c + 1]):
            pages.append(torch.cat([shared, kv_indices[kv_indptr[b]:kv_indptr[b + 1]]]))
            indptr.append(indptr[-1] + pages[-1].numel())
    dev = q.device
    return paged_decode_ref(q, k_cache, v_cache, torch.tensor(indptr, dtype=torch.int32, device=dev),
                            torch.cat(pages).to(torch.int32), kv_last_page_len, sm_scale=sm_scale)
