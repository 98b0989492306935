"""The grouped-GEMM core shared by the fused MoE forward (fused_moe.py) and backward (fused_moe_bwd.py).

Rows are routed pairs p = t*K + k sorted by expert into BLOCK_M-aligned segments (moe_align.py);
a row-block program takes BLOCK_M rows of one expert. Here: the tile loop (_expert_matmul), the
row-block GEMM (_pair_gemm_kernel, used as the forward down projection and the backward dx), the
tile configurations (MoEConfig: one BLOCK_M per call, per-kernel tiles on top; moe_tuning.py
picks them among candidates on a GPU for the sorted path) and the launch options every MoE launcher shares.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k, N = T*K routed pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlengine.kernels._triton import tl, triton

from .moe_align import MoEAlignment

# ----------------------------------------------------------------------------------------------
# Triton: the tile loop and the row-block GEMM.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M: tl.constexpr):
    """Pair indices of one sorted block, and which of them are real (padding = N)."""
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pair, pair < N


@triton.jit
def _sorted_rows(pid_m, BLOCK_M: tl.constexpr):
    """Positions of one block's rows in the expert-sorted order (rows of sorted-layout buffers)."""
    return pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)


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
def _pair_gemm_kernel(a_ptr, b_ptr, scale_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, N, NOUT, KDIM,
                      stride_am, stride_be, stride_bk, stride_bn, stride_om,
                      HAS_SCALE: tl.constexpr, A_SORTED: tl.constexpr, TOKEN_ATOMIC: tl.constexpr,
                      TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[p, n] = scale[p] * sum_k a[p, k] * B[e, k, n], one row per pair (B via strides).

    Forward down projection (a = h, B = w2 read transposed, scale = routing weight) and the
    backward dx per pair (a = dgu, B = w13). A_SORTED: a's rows are in sorted order (row of the
    block, not the pair). TOKEN_ATOMIC: the top-k sum in the epilogue, out[t] += (fp32 atomics
    into a zeroed [T, NOUT] buffer; the order of the K adds varies from run to run)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_rows(sorted_ids_ptr, pid_m, N, BLOCK_M)
    a_rows = _sorted_rows(pid_m, BLOCK_M) if A_SORTED else pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NOUT
    acc, _ = _expert_matmul(a_ptr, stride_am, a_rows, valid, b_ptr + e * stride_be, stride_bk, stride_bn,
                            offs_n, n_mask, 0, KDIM, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & n_mask[None, :]
    if TOKEN_ATOMIC:
        tl.atomic_add(out_ptr + (pair // TOPK)[:, None] * stride_om + offs_n[None, :], acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Tile configurations.
# ----------------------------------------------------------------------------------------------

def _pow2(owner: str, name: str, v: int, low: int = 16) -> None:
    if v < low or v & (v - 1):
        raise ValueError(f"{owner}.{name} must be a power of two >= {low} (tl.dot), got {v}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Tiles:
    """One kernel's tiles. Row-block kernels: BLOCK_N, BLOCK_K (BLOCK_M is the call's). The
    weight-gradient kernels: block_p x block_n output tiles, block_k rows reduced per step."""

    block_n: int
    block_k: int
    block_p: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k", "block_p"):
            _pow2("Tiles", name, getattr(self, name))
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiles.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"Tiles.num_stages must be in [1, 6], got {self.num_stages}")

    def clipped(self, small: int) -> "Tiles":
        """Tiles no wider than the smaller model dim (rounded up to a power of two, >= 16)."""
        return Tiles(block_n=min(self.block_n, small), block_k=min(self.block_k, small),
                     block_p=min(self.block_p, small), num_warps=self.num_warps, num_stages=self.num_stages)


# Kernels of a call that take their own tiles (the v1 backward uses the shared fields for all).
KERNELS = ("gate_up", "down", "down_bwd", "dx", "wgrad")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """Tile sizes of the grouped GEMMs (row-block kernels) and of the weight-gradient kernel;
    `kernel_tiles` overrides them per kernel (names in KERNELS)."""

    block_m: int  # sorted rows per program; also the padding unit of moe_align
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    wgrad_block: int = 64  # BLOCK_P = BLOCK_Q of the dW kernel
    wgrad_block_r: int = 32  # rows reduced per step in the dW kernel
    kernel_tiles: tuple = ()  # ((kernel name, Tiles), ...)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "wgrad_block", "wgrad_block_r"):
            _pow2("MoEConfig", name, getattr(self, name))
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MoEConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"MoEConfig.num_stages must be in [1, 6], got {self.num_stages}")
        for name, tiles in self.kernel_tiles:
            if name not in KERNELS or not isinstance(tiles, Tiles):
                raise ValueError(f"MoEConfig.kernel_tiles: want (name in {KERNELS}, Tiles), got ({name!r}, {tiles!r})")

    def tiles(self, kernel: str | None) -> Tiles:
        """The tiles `kernel` runs with: its override, else the shared fields (kernel None: the
        shared fields, what every launch of the v1 backward takes)."""
        for name, tiles in self.kernel_tiles:
            if name == kernel:
                return tiles
        if kernel == "wgrad":
            return Tiles(block_n=self.wgrad_block, block_k=self.wgrad_block_r, block_p=self.wgrad_block,
                         num_warps=self.num_warps, num_stages=self.num_stages)
        return Tiles(block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                     num_stages=self.num_stages)


# Shape classes by average rows per expert N/E: (name, largest N/E, BLOCK_M, shared tiles). Decode
# has ~K*T/E << 16 rows per expert, so small BLOCK_M wastes least padding; training has hundreds
# to thousands and wants big tiles.
SHAPE_CLASSES = (
    ("decode", 16, MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    ("small", 64, MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    ("medium", 512, MoEConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    ("large", float("inf"), MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3,
                                      wgrad_block=128)),
)


def shape_class(num_pairs: int, num_experts: int) -> str:
    """The autotune key's row part: decode, small, medium or large by average rows per expert."""
    rows = num_pairs / num_experts
    return next(name for name, limit, _ in SHAPE_CLASSES if rows <= limit)


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
    """Config of the shape class (average rows per expert), tiles clipped to the dims."""
    if pin_config._pinned is not None:
        return pin_config._pinned
    cls = shape_class(num_pairs, num_experts)
    cfg = next(c for name, _, c in SHAPE_CLASSES if name == cls)
    small = max(16, triton.next_power_of_2(min(hidden, ffn)))
    return MoEConfig(block_m=cfg.block_m, block_n=min(cfg.block_n, small), block_k=min(cfg.block_k, small),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     wgrad_block=min(cfg.wgrad_block, small), wgrad_block_r=cfg.wgrad_block_r)


# ----------------------------------------------------------------------------------------------
# Launch helpers and the row-block GEMM launcher.
# ----------------------------------------------------------------------------------------------

def check_align(align: MoEAlignment, cfg: MoEConfig) -> None:
    if align.block_m != cfg.block_m:
        raise ValueError(f"align.block_m={align.block_m} must equal cfg.block_m={cfg.block_m}: "
                         "kernels read sorted rows in blocks of BLOCK_M")


def alloc(shape, dtype, device) -> torch.Tensor:
    """Every kernel output buffer of the MoE launchers comes from here (tests poison it with nan)."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_opts(tiles: Tiles | MoEConfig, dtype: torch.dtype) -> dict:
    # fp32 tiles take twice the shared memory per stage; one stage fewer keeps them in budget.
    stages = tiles.num_stages if dtype != torch.float32 else max(1, tiles.num_stages - 1)
    return {"num_warps": tiles.num_warps, "num_stages": stages,
            # fp32 runs must match the reference at 1e-4: no TF32 inside tl.dot.
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def pair_gemm(a_NK, w_E, align: MoEAlignment, cfg: MoEConfig, *, reduce_dim: int, scale_N=None,
              kernel: str | None = None, a_sorted: bool = False, out_TN: torch.Tensor | None = None):
    """out[p, :] = scale[p] * a[p, :] @ B_e with B_e = w_E[e] reduced over dim `reduce_dim`
    (1 or 2) of the [E, *, *] weight; returns [N, NOUT] in a's dtype.

    a_sorted: a's rows are in sorted order ([N_pad, KDIM], the sorted backward's layout).
    out_TN: a zeroed fp32 [T, NOUT] buffer; the rows of each token are added into it (atomics)
    instead of written per pair, and it is returned."""
    check_align(align, cfg)
    N, KDIM, tiles = align.num_pairs, a_NK.shape[1], cfg.tiles(kernel)
    NOUT = w_E.shape[3 - reduce_dim]
    out = alloc((N, NOUT), a_NK.dtype, a_NK.device) if out_TN is None else out_TN
    topk = N // out_TN.shape[0] if out_TN is not None else 1
    stride_bk, stride_bn = (w_E.stride(1), w_E.stride(2)) if reduce_dim == 1 else (w_E.stride(2), w_E.stride(1))
    grid = (align.expert_ids.numel(), triton.cdiv(NOUT, tiles.block_n))
    _pair_gemm_kernel[grid](a_NK, w_E, scale_N if scale_N is not None else a_NK, out, align.sorted_token_ids,
                            align.expert_ids, N, NOUT, KDIM, a_NK.stride(0), w_E.stride(0), stride_bk, stride_bn,
                            out.stride(0), HAS_SCALE=scale_N is not None, A_SORTED=a_sorted,
                            TOKEN_ATOMIC=out_TN is not None, TOPK=topk,
                            BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                            **launch_opts(tiles, a_NK.dtype))
    return out
