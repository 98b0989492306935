"""Fused elementwise kernels of the GPU inference path, in Triton: the CUDA twins of csrc/fused_ops.cpp.

On a GPU, decoding a small model at low B_act is a long chain of tiny kernels: an RMSNorm alone
is five or six (square, mean, rsqrt, two multiplies, casts), q/k-norm + RoPE a dozen. These
kernels do each chain in one launch, with the same signatures as the C++ CPU ops, so the model's
no-grad fast path (qwen3.py) runs one code path on both devices:
  rms_norm(x[..., C], w[C], eps)                       -> rms_norm(x) * w
  fused_add_rms_norm(x, residual, w, eps)              -> residual += x (in place); rms_norm(residual) * w
  silu_and_mul(x[..., 2F])                             -> silu(x[..., :F]) * x[..., F:]
  qk_norm_rope(qkv[T, (H+2Hkv)D], q_w, k_w, cos_sin[2, max_pos, D] fp32, positions[T], H, Hkv, eps)
                                                       -> q [T, H, D], k [T, Hkv, D]: per-head RMSNorm, then
                                                          rotate-half RoPE (Hugging Face Qwen3's order);
                                                          q_w = k_w = None: RoPE only (Qwen2, Llama);
                                                          kv_cache=(k_cache, v_cache, slot_mapping) also
                                                          stores k and v in the paged cache (the decode
                                                          step's store_kvcache launch, folded in)
Math in fp32, one rounding to the input dtype at the end (the C++ ops round where the torch
expressions do; in fp32 the two agree to rounding). No host sync and no device assert, so they
can be captured in CUDA graphs. Row and token offsets are int64 (a [T, C] activation or a qkv
buffer may pass 2^31 elements). qk_norm_rope does not range-check positions (the C++ CPU op
does): on the decode path that would be a device assert or a sync; the engine bounds every
position by max_model_len <= max_position_embeddings on the host when it admits a request, and
the learner builds positions from sequence lengths. Under TRITON_INTERPRET=1 they run on the CPU
for tests.
Dimension legend: R rows, C hidden, F FFN, T tokens, H / Hkv query / KV heads, D head dim.
"""

from __future__ import annotations

import torch

from rlengine.kernels._triton import tl, triton


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, C, stride_x, stride_r, stride_o, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < C
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32) + x
        r = r.to(res_ptr.dtype.element_ty)  # the residual stream stays in the model dtype
        tl.store(res_ptr + row * stride_r + offs, r, mask=mask)
        x = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, F, stride_x, stride_o, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < F
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_t, max_pos, eps,
                         H: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr, NORM: tl.constexpr,
                         STORE_KV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)          # 0..H-1: q heads, H..H+Hkv-1: k heads (adjacent in qkv)
    half = D // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    src = qkv_ptr + t * stride_t + h * D
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    is_q = h < H
    if NORM:  # Qwen3's per-head RMSNorm; Qwen2 and Llama rotate the projection as is
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
        n1 = x1 * inv * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n2 = x2 * inv * tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        n1, n2 = x1, x2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos1 = tl.load(cs_ptr + pos * D + offs, mask=mask, other=0.0)
    cos2 = tl.load(cs_ptr + pos * D + half + offs, mask=mask, other=0.0)
    sin1 = tl.load(cs_ptr + max_pos * D + pos * D + offs, mask=mask, other=0.0)
    sin2 = tl.load(cs_ptr + max_pos * D + pos * D + half + offs, mask=mask, other=0.0)
    o1 = n1 * cos1 - n2 * sin1    # rotate_half(x) = cat(-x2, x1)
    o2 = n2 * cos2 + n1 * sin2
    # q rows are [T, H, D]; k rows [T, Hkv, D]
    Hkv = tl.num_programs(1) - H
    dst = tl.where(is_q, q_ptr + (t * H + h) * D, k_ptr + (t * Hkv + (h - H)) * D)
    tl.store(dst + offs, o1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + offs, o2.to(q_ptr.dtype.element_ty), mask=mask)
    if STORE_KV:  # k-head programs also write k and this head's v into the cache row of the token's slot
        hk = h - H
        slot = tl.load(slot_ptr + t)  # int64, -1 = padding token
        lanes = tl.zeros([HALF_BLOCK], tl.int64)  # full-shape masks: the interpreter rejects scalar & vector
        keep = mask & (lanes + slot >= 0) & (lanes + hk >= 0)
        row = slot * (Hkv * D) + hk * D  # contiguous [num_blocks, P, Hkv, D]: slot-major rows
        tl.store(kc_ptr + row + offs, o1.to(kc_ptr.dtype.element_ty), mask=keep)
        tl.store(kc_ptr + row + half + offs, o2.to(kc_ptr.dtype.element_ty), mask=keep)
        v_src = qkv_ptr + t * stride_t + (H + Hkv + hk) * D
        tl.store(vc_ptr + row + offs, tl.load(v_src + offs, mask=keep), mask=keep)
        tl.store(vc_ptr + row + half + offs, tl.load(v_src + half + offs, mask=keep), mask=keep)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, strides {x.stride()}")
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim times w; returns a new tensor shaped like x."""
    if w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: w must be [{x.shape[-1]}], got {tuple(w.shape)}")
    x2 = _rows(x, "rms_norm")
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, w, out, x2.shape[1], x2.stride(0), 0, out.stride(0), eps,
                                         ADD_RESIDUAL=False, BLOCK_C=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then returns rms_norm(residual) * w."""
    if residual.shape != x.shape or not residual.is_contiguous() or w.shape != (x.shape[-1],):
        raise ValueError(f"fused_add_rms_norm: need same-shape x and contiguous residual and w [C], got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)}, {tuple(w.shape)}")
    x2, r2 = _rows(x, "fused_add_rms_norm"), residual.view(-1, x.shape[-1])
    out = torch.empty_like(r2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, out, x2.shape[1], x2.stride(0), r2.stride(0), out.stride(0),
                                         eps, ADD_RESIDUAL=True, BLOCK_C=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :F]) * x[..., F:] for x [..., 2F]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even (gate then up), got {x.shape[-1]}")
    x2 = _rows(x, "silu_and_mul")
    F = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], F, dtype=x.dtype, device=x.device)
    if x2.shape[0] and F:
        block = min(1024, triton.next_power_of_2(F))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(F, block))](x2, out, F, x2.stride(0), out.stride(0),
                                                                   BLOCK_F=block)
    return out.view(*x.shape[:-1], F)


def qk_norm_rope(qkv: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, cos_sin: torch.Tensor,
                 positions: torch.Tensor, H: int, Hkv: int, eps: float, *,
                 kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (q_w / k_w) and rotate-half RoPE of the q and k parts of qkv -> (q [T,H,D], k [T,Hkv,D]).

    q_w = k_w = None skips the norm (Qwen2, Llama); D is cos_sin.shape[2].
    positions [T] int32/int64 must lie in [0, max_pos): not checked here (see the module docstring).
    kv_cache=(k_cache, v_cache, slot_mapping): contiguous [num_blocks, P, Hkv, D] caches in qkv's
    dtype and int64 slots [T] (-1 skips a token); the rotated k and the v part of qkv are also
    written in place to row slot of each cache, as store_kvcache would, in the same launch. Slots
    are not range-checked (no device assert, no sync): the engine builds them from its block tables."""
    if cos_sin.dim() != 3 or cos_sin.shape[0] != 2 or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError(f"qk_norm_rope: cos_sin must be contiguous fp32 [2, max_pos, D], got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    D = cos_sin.shape[2]
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * Hkv) * D or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: qkv must be [T, (H + 2Hkv) * D] = [T, {(H + 2 * Hkv) * D}] with a "
                         f"contiguous last dim, got {tuple(qkv.shape)}")
    if (q_w is None) != (k_w is None):
        raise ValueError("qk_norm_rope: q_w and k_w must both be given or both be None")
    norm = q_w is not None
    if D % 2 or (norm and (q_w.shape != (D,) or k_w.shape != (D,))):
        raise ValueError(f"qk_norm_rope: q_w and k_w must both be [D] with D = {D} even, got "
                         f"{None if q_w is None else tuple(q_w.shape)}, {None if k_w is None else tuple(k_w.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"qk_norm_rope: positions must be [T={T}], got {tuple(positions.shape)}")
    if kv_cache is not None:
        _check_kv_cache(kv_cache, qkv, Hkv, D)
    q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, Hkv, D, dtype=qkv.dtype, device=qkv.device)
    k_cache, v_cache, slots = kv_cache if kv_cache is not None else (q, q, positions)  # placeholders: unused
    q_w, k_w = (q_w, k_w) if norm else (qkv, qkv)  # placeholders: not read without NORM
    if T:
        _qk_norm_rope_kernel[(T, H + Hkv)](qkv, q_w, k_w, cos_sin, positions, q, k, k_cache, v_cache, slots,
                                           qkv.stride(0), cos_sin.shape[1], eps, H=H, D=D,
                                           HALF_BLOCK=triton.next_power_of_2(D // 2), NORM=norm,
                                           STORE_KV=kv_cache is not None)
    return q, k


def _check_kv_cache(kv_cache, qkv: torch.Tensor, Hkv: int, D: int) -> None:
    if len(kv_cache) != 3:
        raise ValueError("qk_norm_rope: kv_cache must be (k_cache, v_cache, slot_mapping)")
    k_cache, v_cache, slots = kv_cache
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (Hkv, D) or not c.is_contiguous() or c.dtype != qkv.dtype \
                or c.device != qkv.device:
            raise ValueError(f"qk_norm_rope: {name} must be a contiguous {qkv.dtype} [num_blocks, P, {Hkv}, {D}] "
                             f"on {qkv.device}, got {c.dtype} {tuple(c.shape)} on {c.device}")
    if slots.shape != (qkv.shape[0],) or slots.dtype != torch.int64 or not slots.is_contiguous() \
            or slots.device != qkv.device:
        raise ValueError(f"qk_norm_rope: slot_mapping must be contiguous int64 [T={qkv.shape[0]}], got "
                         f"{slots.dtype} {tuple(slots.shape)}")
