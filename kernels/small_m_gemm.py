"""Small-M GEMMs of the GPU decode step (M <= 64 rows), with the layer's elementwise work folded in.

A decode step at B_act <= 64 multiplies a few rows by every weight of a layer: the time is the weight
stream, and on a small model the fixed cost of each dependent launch. These kernels fold the
elementwise ops around the four projections into them, so a dense layer is six launches
(norm+qkv, q/k-norm+RoPE+store, attention, o_proj+residual, norm+gate_up+SiLU, down+residual):
  norm_linear(x[M, K], g[K], eps, w[N, K], bias[N]?)   -> rms_norm(x) * g @ w.T (+ bias)       [M, N]
  norm_gate_up_silu(x[M, K], g[K], eps, w[2F, K])      -> silu(h @ w[:F].T) * (h @ w[F:].T)    [M, F],
                                                          h = rms_norm(x) * g
  linear_residual(x[M, K], w[N, K], residual[M, N])    -> residual += x @ w.T (in place)      [M, N]
The RMSNorm is a prologue by linearity: rms_norm(x) * g @ w.T = inv_rms(x) * ((x * g) @ w.T), so
each program multiplies its K-slice of x by g, accumulates the slice's sum of squares beside the dot
products, and the epilogue scales each row by inv_rms once the whole K is summed. Split-K fills the
SMs when N / BLOCK_N tiles are too few: each of SPLIT_K programs of an N-tile writes fp32 partials to
a preallocated workspace, and the last to arrive (an atomic counter per tile, reset by that program)
sums them and runs the epilogue, in the same launch (no second reduction kernel). Math in fp32, one
rounding to the output dtype; x * g is rounded to the weight dtype before the tensor-core dot (where
the torch path rounds rms_norm(x) * g). No host sync, no allocation on the decode path: the
workspace is passed in (SmallMWorkspace), so the kernels can be captured in CUDA graphs.
Tile configurations: a fixed candidate list (CANDIDATES); choose_config picks by a heuristic per
shape class until a GPU measurement (tune) has recorded a winner for the class. PDL=True launches
with programmatic dependent launch (sm_90+): the program waits on the previous grid
(griddepcontrol.wait) only before its first load of x, after computing its addresses.
Dimension legend: M rows (decode sequences), K reduction (hidden C or FFN F), N output columns.
"""

from __future__ import annotations

import dataclasses

import torch

from rlengine.kernels._triton import tl, triton
from rlengine.kernels.timing import cuda_seconds

MAX_M = 64
EPI_NONE, EPI_SILU, EPI_RESIDUAL = 0, 1, 2


@triton.jit
def _small_m_gemm_kernel(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, part_ptr, sq_ptr, cnt_ptr,
                         M, N, K, stride_xm, stride_wn, stride_om, k_per_split, eps,
                         NORM: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)   # EPI_SILU: the up half's columns
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)                # NORM: sum of x^2 over this program's K
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k0 = pid_k * k_per_split
    if PDL:  # everything above overlaps the previous kernel's tail; x is its output
        tl.extra.cuda.gdc_wait()
    for kk in range(0, k_per_split, BLOCK_K):
        ks = k0 + kk + offs_k
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
            g = tl.load(g_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(w_ptr.dtype.element_ty)
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if EPI == 1:
            wu = tl.load(w_rows + N * stride_wn + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(x, tl.trans(wu), acc_up)
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, sq, b_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, K, stride_om, eps,
                  NORM, EPI, HAS_BIAS)
    else:
        # partials [n_tiles, SPLIT_K, 2 (gate, up), BLOCK_M, BLOCK_N] fp32, sums of squares [n_tiles, SPLIT_K, BLOCK_M]
        tile = pid_n.to(tl.int64) * SPLIT_K
        mn = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + ((tile + pid_k) * 2) * BLOCK_M * BLOCK_N + mn, acc)
        if EPI == 1:
            tl.store(part_ptr + ((tile + pid_k) * 2 + 1) * BLOCK_M * BLOCK_N + mn, acc_up)
        if NORM:
            tl.store(sq_ptr + (tile + pid_k) * BLOCK_M + offs_m, sq)
        tl.debug_barrier()  # every thread's partials are written before the counter is released
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of this tile reduces and finishes it
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            sq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: the same bits whichever program arrives last
                acc += tl.load(part_ptr + ((tile + s) * 2) * BLOCK_M * BLOCK_N + mn, cache_modifier=".cg")
                if EPI == 1:
                    acc_up += tl.load(part_ptr + ((tile + s) * 2 + 1) * BLOCK_M * BLOCK_N + mn,
                                      cache_modifier=".cg")
                if NORM:
                    sq += tl.load(sq_ptr + (tile + s) * BLOCK_M + offs_m, cache_modifier=".cg")
            _epilogue(acc, acc_up, sq, b_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, K, stride_om, eps,
                      NORM, EPI, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _epilogue(acc, acc_up, sq, b_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, K, stride_om, eps,
              NORM: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr):
    if NORM:
        inv = 1.0 / tl.sqrt(sq / K + eps)
        acc = acc * inv[:, None]
        if EPI == 1:
            acc_up = acc_up * inv[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if EPI == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if EPI == 2:  # residual += x @ w.T: the residual stream is the output, in place
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True, slots=True)
class SmallMConfig:
    """One tile configuration: BLOCK_N output columns by BLOCK_K per step, split_k programs per tile."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


# The fixed candidates (compile-checked for sm_90 on the CPU; timed per shape class on a GPU by tune()).
# Every config choose_config's heuristic can return is one of them.
CANDIDATES = tuple(SmallMConfig(bn, bk, s) for bn, bk in ((32, 64), (32, 128), (64, 64), (64, 128))
                   for s in (1, 2, 4, 8, 16))
MEASURED: dict[tuple, SmallMConfig] = {}
"""Winners tune() measured, by shape_class; choose_config reads it before its heuristic."""


def shape_class(M: int, N: int, K: int, dtype: torch.dtype, epi: int) -> tuple:
    """M rounded up to a power of two (1, 2, 4, ... 64), N and K exact (a model has a handful)."""
    return (1 << max(0, (M - 1).bit_length()), N, K, str(dtype).removeprefix("torch."), epi)


def choose_config(M: int, N: int, K: int, dtype: torch.dtype, epi: int, num_sms: int = 132) -> SmallMConfig:
    """The measured winner of this shape class, else the heuristic: BLOCK_N 64 (32 when fewer than
    num_sms tiles at 64), and split-K to about one program per SM, keeping >= 2 K-steps per split."""
    hit = MEASURED.get(shape_class(M, N, K, dtype, epi))
    if hit is not None:
        return hit
    block_n = 64 if triton.cdiv(N, 64) >= num_sms else 32
    block_k = 128 if M <= 16 else 64
    tiles = triton.cdiv(N, block_n)
    split = 1
    while split < 16 and tiles * split * 2 <= num_sms and K >= 2 * block_k * split * 2:
        split *= 2
    return SmallMConfig(block_n, block_k, split, 4)


class SmallMWorkspace:
    """Split-K scratch: fp32 partials [programs, 2, MAX_M, max_block_n], per-program sums of squares and
    the per-tile counters (int32, zero between launches: the last program of a tile resets its own). One
    per engine device; a launch raises if its tiles x split_k programs do not fit (never grown)."""

    def __init__(self, max_tiles: int, max_programs: int, device, *, max_block_n: int = 64):
        self.max_tiles, self.max_programs, self.max_block_n = max_tiles, max_programs, max_block_n
        self.partials = torch.empty(max_programs * 2 * MAX_M * max_block_n, dtype=torch.float32, device=device)
        self.sumsq = torch.empty(max_programs * MAX_M, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_tiles, dtype=torch.int32, device=device)

    def fits(self, tiles: int, config: SmallMConfig) -> bool:
        return config.split_k == 1 or (tiles <= self.max_tiles and tiles * config.split_k <= self.max_programs
                                       and config.block_n <= self.max_block_n)

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], device, num_sms: int = 132) -> "SmallMWorkspace":
        """For (N, K) shapes (gate_up: N = F): every tile of BLOCK_N 32 gets a counter, and 4 x num_sms split
        programs fit (choose_config splits only up to num_sms / 2 programs; 17 MiB at 132 SMs)."""
        tiles = max(triton.cdiv(n, 32) for n, _ in shapes)
        return cls(max(tiles, 1), 4 * num_sms, device)


def _launch(x, g, w, bias, out, eps, epi, ws: SmallMWorkspace | None, config: SmallMConfig | None, pdl: bool):
    M, K = x.shape
    N = w.shape[0] // 2 if epi == EPI_SILU else w.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"small_m_gemm: x must have 1..{MAX_M} rows, got {M}")
    if w.dim() != 2 or w.shape[1] != K or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"small_m_gemm: need x [M, K] and w [N, K={K}] with contiguous rows, got "
                         f"{tuple(x.shape)} {tuple(w.shape)}")
    if w.dtype != x.dtype or out.dtype != x.dtype:
        raise ValueError(f"small_m_gemm: x, w and out must share a dtype, got {x.dtype}, {w.dtype}, {out.dtype}")
    if g is not None and g.shape != (K,):
        raise ValueError(f"small_m_gemm: the norm weight must be [K={K}], got {tuple(g.shape)}")
    if out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"small_m_gemm: out must be [{M}, {N}] with a contiguous last dim, got {tuple(out.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"small_m_gemm: bias must be [N={N}], got {tuple(bias.shape)}")
    cfg = config or choose_config(M, N, K, x.dtype, epi)
    block_m = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    if cfg.split_k > 1:
        if ws is None:
            raise ValueError("small_m_gemm: split_k > 1 needs a SmallMWorkspace (workspace=)")
        if not ws.fits(tiles, cfg):
            raise ValueError(f"small_m_gemm: the workspace holds {ws.max_tiles} tiles, {ws.max_programs} split "
                             f"programs, BLOCK_N <= {ws.max_block_n}; this launch needs {tiles} x {cfg.split_k} "
                             f"at BLOCK_N {cfg.block_n}")
        part, sq, cnt = ws.partials, ws.sumsq, ws.counters
    else:
        part = sq = cnt = out  # placeholders: not touched without split-K
    _small_m_gemm_kernel[(tiles, cfg.split_k)](
        x, g if g is not None else w, w, bias if bias is not None else w, out, part, sq, cnt,
        M, N, K, x.stride(0), w.stride(0), out.stride(0), k_per_split, eps,
        NORM=g is not None, EPI=epi, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}))
    return out


def norm_linear(x: torch.Tensor, g: torch.Tensor, eps: float, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, workspace: SmallMWorkspace | None = None,
                config: SmallMConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """rms_norm(x) * g @ w.T (+ bias): x [M <= 64, K], g [K], w [N, K], bias [N] -> [M, N] in x's dtype.
    out= a preallocated [M, N]; workspace= needed when the config splits K."""
    out = out if out is not None else torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, g, w, bias, out, eps, EPI_NONE, workspace, config, pdl)


def norm_gate_up_silu(x: torch.Tensor, g: torch.Tensor, eps: float, w: torch.Tensor, *,
                      out: torch.Tensor | None = None, workspace: SmallMWorkspace | None = None,
                      config: SmallMConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """silu(h @ w[:F].T) * (h @ w[F:].T), h = rms_norm(x) * g: x [M, K], w [2F, K] (gate rows, then up) -> [M, F]."""
    if w.shape[0] % 2:
        raise ValueError(f"norm_gate_up_silu: w must be [2F, K] (gate then up), got {tuple(w.shape)}")
    out = out if out is not None else torch.empty(x.shape[0], w.shape[0] // 2, dtype=x.dtype, device=x.device)
    return _launch(x, g, w, None, out, eps, EPI_SILU, workspace, config, pdl)


def linear_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, *,
                    workspace: SmallMWorkspace | None = None, config: SmallMConfig | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """residual += x @ w.T in place (fp32 sum, one rounding): x [M, K], w [N, K], residual [M, N]; returns residual."""
    return _launch(x, None, w, None, residual, 0.0, EPI_RESIDUAL, workspace, config, pdl)


# ---- plain-torch references (fp32 math, one rounding at the end)

def norm_linear_ref(x, g, eps, w, bias=None):
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
    y = h @ w.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def norm_gate_up_silu_ref(x, g, eps, w):
    y = norm_linear_ref(x.float(), g, eps, w.float())
    F_ = w.shape[0] // 2
    return (torch.nn.functional.silu(y[:, :F_]) * y[:, F_:]).to(x.dtype)


def linear_residual_ref(x, w, residual):
    return (residual.float() + x.float() @ w.float().t()).to(residual.dtype)


def tune(M: int, N: int, K: int, dtype: torch.dtype, epi: int, workspace: SmallMWorkspace, *, reps: int = 50,
         candidates=CANDIDATES) -> tuple[SmallMConfig, dict]:
    """Time every candidate on this GPU for one shape class (CUDA events, random inputs) and record the
    fastest in MEASURED -> (winner, {config: microseconds}). GPU only; not on a decode path."""
    dev = workspace.counters.device
    x = torch.randn(M, K, device=dev, dtype=dtype)
    g = torch.rand(K, device=dev, dtype=dtype) + 0.5
    w = torch.randn((2 * N if epi == EPI_SILU else N), K, device=dev, dtype=dtype) * K ** -0.5
    res = torch.randn(M, N, device=dev, dtype=dtype)
    times = {}
    for cfg in candidates:
        if not workspace.fits(triton.cdiv(N, cfg.block_n), cfg):
            continue
        run = {EPI_NONE: lambda: norm_linear(x, g, 1e-6, w, workspace=workspace, config=cfg),
               EPI_SILU: lambda: norm_gate_up_silu(x, g, 1e-6, w, workspace=workspace, config=cfg),
               EPI_RESIDUAL: lambda: linear_residual(x, w, res, workspace=workspace, config=cfg)}[epi]
        times[cfg] = 1e6 * cuda_seconds(run, reps, warmup=3)
    best = min(times, key=times.get)
    MEASURED[shape_class(M, N, K, dtype, epi)] = best
    return best, times
