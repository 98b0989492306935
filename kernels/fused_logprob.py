"""Fused LM-head log-prob and entropy: hidden states -> per-token log p(target), H(p).

The learner's last step before the RL loss: h_TC (final-norm hidden states of the packed
batch) and the LM head W_VC give, per token t with target y_t,
    logp[t] = log_softmax(h[t] @ W^T / temperature)[y_t]          (full vocabulary)
    H[t]    = -sum_v p[t, v] log p[t, v]
which is THE log-prob definition across rlengine (the sampler uses the same one). The
[T, V] logits are never materialised: the forward walks the vocabulary in BLOCK_N chunks
keeping an online max / sum-exp per token; the backward recomputes the logits chunk by chunk.
Dims: T tokens (packed), C hidden, V vocab. Tiles: BLOCK_M tokens x BLOCK_N vocab x BLOCK_K hidden.

Layers: @triton.jit kernels; launchers (shape/dtype checks, config); FusedLogProbFunction;
fused_logprob (public) and fused_logprob_ref (plain torch, the oracle). All accumulation is
fp32 and outputs are fp32. Ideas from Liger-Kernel's fused linear cross entropy and Apple's
Cut Cross-Entropy; the code is this project's own.
Backward: a Triton kernel writes d(logits) of a [T_c, V_c] chunk in the input dtype, and two
dense cuBLAS matmuls turn it into grad_h and grad_W (vocab chunks outside, so each grad_W row
is written once and only the [T, C] fp32 grad_h accumulator is revisited; Liger's token-outer
order re-reads and re-writes all of grad_W [V, C] per token chunk). Deterministic: no atomics.
Simplifications: tokens with zero upstream gradient (the loss mask's prompt and padding tokens)
are skipped whole, at the cost of one host sync per backward; a vocab tile whose d(logits) is
negligible but not zero is still multiplied (cuBLAS cannot skip tiles of a dense operand, and in a
[T_c, V_c] chunk of a real LM some entry is always above bf16's resolution). Tile sizes are a
fixed heuristic per device and dtype, not autotuned (pin one with LogProbConfig).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlengine.kernels._triton import tl, triton
from torch import Tensor

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, C, stride_ht, stride_hc, stride_wv, stride_wc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """z[BLOCK_M, BLOCK_N] = h[offs_m, :] @ W[offs_n, :]^T in fp32 (out-of-range rows/cols give 0)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < C
        h = tl.load(h_ptr + offs_m[:, None] * stride_ht + offs_k[None, :] * stride_hc,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_t = tl.load(w_ptr + offs_n[None, :] * stride_wv + offs_k[:, None] * stride_wc,
                      mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(h, w_t, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _logprob_fwd_kernel(h_ptr, w_ptr, tgt_ptr, part_ptr, T, V, C, stride_ht, stride_hc, stride_wv, stride_wc,
                        inv_temp, chunks_per_split, num_splits,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr):
    """Grid (token blocks, vocab splits). Writes part[4, S, T]: running max m, sum exp(z - m),
    sum exp(z - m) * (z - m) (the entropy numerator, kept relative to m to avoid cancelling
    large terms), and the target logit (0 when the target is outside this split)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # T*C, V*C may pass 2^31
    row_ok = offs_m < T
    tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
    # Finite start value: exp(m0 - m) is 0 and s * (m0 - m) is 0 * finite, never 0 * inf.
    m_i = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    e_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    n_begin = pid_s * chunks_per_split
    n_end = tl.minimum(n_begin + chunks_per_split, tl.cdiv(V, BLOCK_N))
    for n in range(n_begin, n_end):
        offs_n = (n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = offs_n < V
        z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, C, stride_ht, stride_hc, stride_wv, stride_wc,
                         BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION) * inv_temp
        t_i += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)
        zc = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)  # 0, not -inf: p * zc must not be 0 * inf
        p = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        e_i = alpha * (e_i + s_i * (m_i - m_new)) + tl.sum(p * zc, axis=1)
        s_i = alpha * s_i + tl.sum(p, axis=1)
        m_i = m_new
    out = part_ptr + pid_s * T + offs_m
    stride_q = num_splits * T
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + stride_q, s_i, mask=row_ok)
    tl.store(out + 2 * stride_q, e_i, mask=row_ok)
    tl.store(out + 3 * stride_q, t_i, mask=row_ok)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, g_logp_ptr, g_ent_ptr, dz_ptr,
                    T, V, C, v_begin, stride_ht, stride_hc, stride_wv, stride_wc, stride_dz, inv_temp,
                    HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr, GROUP_M: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    """d(loss)/d(logits) of one [T, V] chunk (h, W, targets and the per-token vectors all point at
    the chunk; v_begin is the chunk's first vocab id). One program per (token block, vocab block)
    tile, swizzled in groups of GROUP_M token blocks so the W tiles they share stay in L2.
    Recomputes z and writes, rounded once to dz's dtype,
        dz = (g_logp * (onehot(y) - p) - g_ent * p * (log p + H)) / temperature
    (d logp_y / dz_v = [v = y] - p_v;  dH / dz_v = -p_v (z_v - E_p[z]) = -p_v (log p_v + H))."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(T, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    first_m = (pid // group_width) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_size
    pid_n = (pid % group_width) // group_size

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = offs_m < T
    col_ok = offs_n < V
    valid = row_ok[:, None] & col_ok[None, :]
    z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, C, stride_ht, stride_hc, stride_wv, stride_wc,
                     BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION) * inv_temp
    logp = z - tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)[:, None]
    p = tl.where(valid, tl.exp(logp), 0.0)
    dz = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_G_LOGP:
        g = tl.load(g_logp_ptr + offs_m, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1) - v_begin
        onehot = tl.where(offs_n[None, :] == tgt[:, None], 1.0, 0.0)
        dz += g[:, None] * (onehot - p)
    if HAS_G_ENT:
        g_e = tl.load(g_ent_ptr + offs_m, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_m, mask=row_ok, other=0.0)
        dz -= g_e[:, None] * p * tl.where(valid, logp + ent[:, None], 0.0)
    tl.store(dz_ptr + offs_m[:, None] * stride_dz + offs_n[None, :], (dz * inv_temp).to(dz_ptr.dtype.element_ty),
             mask=valid)


# ----------------------------------------------------------------------------- launchers


@dataclass(frozen=True, slots=True, kw_only=True)
class LogProbConfig:
    """Tile sizes and launch settings. None in fused_logprob picks one per device and dtype; tests pin one."""

    block_m: int = 128     # tokens per tile
    block_n: int = 128     # vocab entries per tile (one step of the online log-sum-exp)
    block_k: int = 64      # hidden slice per tl.dot
    num_splits: int = 0    # forward: vocab splits per token block (flash-decoding style); 0 = fill the GPU
    group_m: int = 8       # backward d(logits) kernel: token blocks per swizzle group
    num_warps: int = 8
    num_stages: int = 3
    chunk_elems: int = 2**26      # backward: d(logits) chunk [T_c, V_c] holds at most this many elements
    max_chunk_tokens: int = 16384  # backward: T_c cap; more tokens are walked in token chunks
    skip_zero_rows: bool = True    # backward: drop tokens whose upstream gradients are all 0 (one host sync)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LogProbConfig.{name} must be a power of two >= 16 (tl.dot), got {value}")
        for name, low in (("num_splits", 0), ("group_m", 1), ("num_warps", 1), ("num_stages", 1),
                          ("max_chunk_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"LogProbConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.chunk_elems < self.block_n:
            raise ValueError(f"LogProbConfig.chunk_elems must be >= block_n={self.block_n}, got {self.chunk_elems}")


# bf16/fp16 on a GPU: tensor-core tiles, (128*64 + 64*128) * 2 B * 3 stages = 96 KiB of shared memory.
_CUDA_CONFIG = LogProbConfig()
# fp32 on a GPU: the dots run as exact fp32 FMAs (no TF32). The 16-bit tiles would need 192 KiB of
# shared memory and a 128x128 fp32 accumulator per 256 threads: smaller tiles, fewer stages.
_CUDA_FP32_CONFIG = LogProbConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
# CPU tensors only run under the Triton interpreter (tests): small tiles keep it fast, and small
# backward chunks make the token and vocab chunk loops run more than once.
_INTERPRETER_CONFIG = LogProbConfig(block_m=16, block_n=32, block_k=16, num_splits=1, group_m=2,
                                    num_warps=4, num_stages=1, chunk_elems=16 * 64, max_chunk_tokens=16)


def default_config(device: torch.device, dtype: torch.dtype) -> LogProbConfig:
    """The config fused_logprob uses when none is given."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    return _CUDA_FP32_CONFIG if dtype == torch.float32 else _CUDA_CONFIG


def _check_inputs(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, temperature: float) -> None:
    if h_TC.dim() != 2 or w_VC.dim() != 2:
        raise ValueError(f"fused_logprob: h_TC must be [T, C] and w_VC [V, C], got {tuple(h_TC.shape)}, "
                         f"{tuple(w_VC.shape)}")
    if h_TC.shape[1] != w_VC.shape[1]:
        raise ValueError(f"fused_logprob: hidden size differs: h_TC has C={h_TC.shape[1]}, w_VC has C={w_VC.shape[1]}")
    if h_TC.dtype != w_VC.dtype or h_TC.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fused_logprob: h_TC ({h_TC.dtype}) and w_VC ({w_VC.dtype}) must share one dtype "
                         "out of float16, bfloat16, float32")
    if targets_T.shape != (h_TC.shape[0],) or targets_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_logprob: targets_T must be int32/int64 of shape [T]=({h_TC.shape[0]},), "
                         f"got {targets_T.dtype} {tuple(targets_T.shape)}")
    if not (h_TC.device == w_VC.device == targets_T.device):
        raise ValueError(f"fused_logprob: h_TC, w_VC, targets_T on different devices: "
                         f"{h_TC.device}, {w_VC.device}, {targets_T.device}")
    if not temperature > 0:
        raise ValueError(f"fused_logprob: temperature must be > 0, got {temperature}")


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to TF32: the fp32 path is the accurate one.
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_splits(cfg: LogProbConfig, num_m: int, num_chunks: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, chunks_per_split) with no empty split."""
    splits = cfg.num_splits
    if splits == 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        splits = triton.cdiv(2 * sms, num_m)
    splits = max(1, min(splits, num_chunks))
    per_split = triton.cdiv(num_chunks, splits)
    return triton.cdiv(num_chunks, per_split), per_split


def logprob_forward(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, temperature: float, cfg: LogProbConfig
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the forward; returns (logp_T, entropy_T, lse_T), fp32. Allocates [4, S, T] partials
    and combines the S vocab splits in torch (log-sum-exp of partials). No host sync."""
    (T, C), V = h_TC.shape, w_VC.shape[0]
    if T == 0:  # a zero-size grid is not launchable
        return tuple(torch.zeros(0, device=h_TC.device, dtype=torch.float32) for _ in range(3))
    num_m, num_chunks = triton.cdiv(T, cfg.block_m), triton.cdiv(V, cfg.block_n)
    splits, per_split = _num_splits(cfg, num_m, num_chunks, h_TC.device)
    part = torch.empty(4, splits, T, device=h_TC.device, dtype=torch.float32)
    _logprob_fwd_kernel[(num_m, splits)](
        h_TC, w_VC, targets_T, part, T, V, C, h_TC.stride(0), h_TC.stride(1), w_VC.stride(0), w_VC.stride(1),
        1.0 / temperature, per_split, splits,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INPUT_PRECISION=_precision(h_TC.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    m_S, s_S, e_S, t_S = part.unbind(0)
    m = m_S.amax(dim=0)
    scale = torch.exp(m_S - m)
    s = (scale * s_S).sum(dim=0)
    e = (scale * (e_S + s_S * (m_S - m))).sum(dim=0)
    log_s = torch.log(s)
    lse = m + log_s
    return t_S.sum(dim=0) - lse, log_s - e / s, lse


def chunk_shape(T: int, V: int, cfg: LogProbConfig) -> tuple[int, int]:
    """(T_c, V_c) of the backward's d(logits) chunks: T_c = min(T, max_chunk_tokens), V_c a multiple
    of block_n with T_c * V_c <= chunk_elems (at least one tile)."""
    t_c = max(1, min(T, cfg.max_chunk_tokens))
    v_c = max(cfg.block_n, cfg.chunk_elems // t_c // cfg.block_n * cfg.block_n)
    return t_c, min(v_c, triton.cdiv(V, cfg.block_n) * cfg.block_n)


def _add_matmul(acc32: Tensor, a: Tensor, b: Tensor) -> None:
    """acc32 += a @ b (cuBLAS): in place for fp32 operands, else through one rounded temporary."""
    if a.dtype == torch.float32:
        acc32.addmm_(a, b)
    else:
        acc32.add_(a @ b)


def _launch_dlogits(dz: Tensor, h: Tensor, w: Tensor, v_begin: int, tgt: Tensor, lse: Tensor, ent: Tensor,
                    g_logp: Tensor | None, g_ent: Tensor | None, inv_temp: float, cfg: LogProbConfig) -> None:
    (T, C), V = h.shape, w.shape[0]
    grid = (triton.cdiv(T, cfg.block_m) * triton.cdiv(V, cfg.block_n),)
    _dlogits_kernel[grid](
        h, w, tgt, lse, ent, g_logp if g_logp is not None else lse, g_ent if g_ent is not None else lse, dz,
        T, V, C, v_begin, h.stride(0), h.stride(1), w.stride(0), w.stride(1), dz.stride(0), inv_temp,
        HAS_G_LOGP=g_logp is not None, HAS_G_ENT=g_ent is not None, GROUP_M=cfg.group_m,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INPUT_PRECISION=_precision(h.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _rows_with_gradient(g_logp_T: Tensor | None, g_ent_T: Tensor | None) -> Tensor:
    """Indices of tokens whose upstream gradients are not all zero (masked prompt and padding
    tokens have none). Host sync: nonzero() must know how many there are."""
    live = torch.zeros_like(g_logp_T if g_logp_T is not None else g_ent_T, dtype=torch.bool)
    for g in (g_logp_T, g_ent_T):
        if g is not None:
            live |= g != 0
    return live.nonzero().squeeze(1)


def logprob_backward(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, lse_T: Tensor, entropy_T: Tensor,
                     g_logp_T: Tensor | None, g_ent_T: Tensor | None, temperature: float, cfg: LogProbConfig,
                     need_dh: bool, need_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    """Backward; returns (grad_h [T, C], grad_w [V, C]) in the input dtype (None where not needed).

    Vocab chunks outside, token chunks inside: per [T_c, V_c] chunk the Triton kernel writes
    d(logits) in the input dtype, then cuBLAS does grad_h[Tc] += dz @ W[Vc] (into an fp32 [T, C]
    accumulator) and grad_W[Vc] = dz^T @ h[Tc] (written once per vocab chunk when one token chunk
    covers T; summed over token chunks in an fp32 [V_c, C] buffer otherwise). No atomics: bitwise
    reproducible. Extra memory: the dz chunk, grad_h in fp32, one [T_c, C] product. With
    cfg.skip_zero_rows, tokens with zero upstream gradient are dropped first (one host sync).
    """
    (T, C), V = h_TC.shape, w_VC.shape[0]

    def zeros_h():
        return torch.zeros(T, C, device=h_TC.device, dtype=h_TC.dtype) if need_dh else None

    grad_w = torch.zeros(V, C, device=w_VC.device, dtype=w_VC.dtype) if need_dw else None
    if T == 0 or (g_logp_T is None and g_ent_T is None) or not (need_dh or need_dw):
        return zeros_h(), grad_w
    rows = _rows_with_gradient(g_logp_T, g_ent_T) if cfg.skip_zero_rows else None
    if rows is not None and rows.numel() == T:
        rows = None  # every token is live: no gather
    pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    h, tgt, lse, ent = pick(h_TC), pick(targets_T), pick(lse_T), pick(entropy_T)
    g_logp = pick(g_logp_T.float()).contiguous() if g_logp_T is not None else None
    g_ent = pick(g_ent_T.float()).contiguous() if g_ent_T is not None else None
    n = h.shape[0]
    if n == 0:
        return zeros_h(), grad_w
    t_c, v_c = chunk_shape(n, V, cfg)
    dz_buf = torch.empty(t_c, v_c, device=h.device, dtype=h.dtype)
    gh32 = torch.zeros(n, C, device=h.device, dtype=torch.float32) if need_dh else None
    one_token_chunk = t_c == n
    inv_temp = 1.0 / temperature
    for v0 in range(0, V, v_c):
        w_c = w_VC[v0:v0 + v_c]
        gw32 = None if one_token_chunk or not need_dw else torch.zeros(w_c.shape, device=h.device,
                                                                         dtype=torch.float32)
        for t0 in range(0, n, t_c):
            t1 = min(n, t0 + t_c)
            dz = dz_buf[:t1 - t0, :w_c.shape[0]]
            _launch_dlogits(dz, h[t0:t1], w_c, v0, tgt[t0:t1], lse[t0:t1], ent[t0:t1],
                            None if g_logp is None else g_logp[t0:t1], None if g_ent is None else g_ent[t0:t1],
                            inv_temp, cfg)
            if need_dh:
                _add_matmul(gh32[t0:t1], dz, w_c)
            if need_dw and one_token_chunk:
                torch.mm(dz.T, h, out=grad_w[v0:v0 + v_c])
            elif need_dw:
                _add_matmul(gw32, dz.T, h[t0:t1])
        if gw32 is not None:
            grad_w[v0:v0 + v_c] = gw32
    if not need_dh:
        return None, grad_w
    if rows is None:
        return gh32.to(h_TC.dtype), grad_w
    return zeros_h().index_copy_(0, rows, gh32.to(h_TC.dtype)), grad_w


# ----------------------------------------------------------------------------- autograd + public API


class FusedLogProbFunction(torch.autograd.Function):
    """(h_TC, w_VC, targets_T) -> (logp_T, entropy_T). Saves h, W, targets and the per-token
    lse and entropy ([T] fp32 each); backward recomputes the logits chunk by chunk from h and W."""

    @staticmethod
    def forward(ctx, h_TC, w_VC, targets_T, temperature, cfg):
        logp, ent, lse = logprob_forward(h_TC, w_VC, targets_T, temperature, cfg)
        ctx.save_for_backward(h_TC, w_VC, targets_T, lse, ent)
        ctx.temperature, ctx.cfg = temperature, cfg
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        h_TC, w_VC, targets_T, lse, ent = ctx.saved_tensors
        gh, gw = logprob_backward(h_TC, w_VC, targets_T, lse, ent, g_logp_T, g_ent_T, ctx.temperature, ctx.cfg,
                                  ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return gh, gw, None, None, None


def fused_logprob(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, *, temperature: float = 1.0,
                  return_entropy: bool = False, config: LogProbConfig | None = None
                  ) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log_softmax(h @ W^T / temperature)[target] over the full vocabulary, fused.

    h_TC: [T, C] fp16/bf16/fp32 (any strides); w_VC: [V, C] same dtype; targets_T: [T] int32/int64,
    each in [0, V) (not checked: that would sync; an out-of-range target gives logp = -lse).
    Returns logp_T [T] fp32, and entropy_T [T] fp32 (nats) when return_entropy. Differentiable
    w.r.t. h_TC and w_VC. Forward: no host sync, O(T) extra memory. Backward: one [T_c, V_c]
    d(logits) chunk (config.chunk_elems elements) plus an fp32 [T, C] accumulator, never [T, V];
    one host sync unless config.skip_zero_rows=False. CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1.
    """
    _check_inputs(h_TC, w_VC, targets_T, temperature)
    cfg = config or default_config(h_TC.device, h_TC.dtype)
    logp, ent = FusedLogProbFunction.apply(h_TC, w_VC, targets_T, float(temperature), cfg)
    return (logp, ent) if return_entropy else logp


def fused_logprob_ref(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, *, temperature: float = 1.0,
                      return_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The oracle: full fp32 logits (float64 for float64 inputs), log_softmax, gather. Same signature
    and outputs as fused_logprob."""
    acc = torch.promote_types(h_TC.dtype, torch.float32)
    logp_TV = torch.log_softmax((h_TC.to(acc) @ w_VC.to(acc).T) / temperature, dim=-1)
    logp = logp_TV.gather(1, targets_T.long()[:, None]).squeeze(1)
    if not return_entropy:
        return logp
    return logp, -(logp_TV.exp() * logp_TV).sum(dim=-1)
