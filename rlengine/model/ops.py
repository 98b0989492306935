"""Op dispatch of the no-grad fast path: which kernels run the engine's forward on each device.

The model (qwen3.py) calls fused_ops_for(device) once per forward and runs its fused layer path
with the returned FusedOps, or its plain torch path when there is none; the learner's forward is
always the torch path. logits_fp32 / linear_nograd are the LM head and projection helpers the two
sides share. One table per device, chosen here and nowhere else:
- CPU: the C++ ops of csrc/fused_ops.cpp; projections and the LM head through whichever of
  torch's linear, the C++ skinny linear (csrc/skinny_linear.cpp, a weight stream for <= 8 rows),
  the blocked linear of the batch-invariant mode (csrc/batch_invariant.cpp, any rows, "blocked"),
  torch's GEMM over 2 MiB blocks of the weight's rows (>= 16 rows, "chunked")
  and, for bf16, an fp32 GEMM over V-chunks of the upcast weight is fastest on this machine for
  the shape (KERNELS, rlengine/model/kernel_choice.py: timed at first use on weights streamed from
  memory, as in a decode step, or pinned); LoRA's block-diagonal B product likewise (lora_expand_nograd:
  the chosen linear + add, or csrc/lora_expand.cpp).
- GPU: the Triton kernels of kernels/fused_norm.py (capturable in the decode CUDA graphs).
- Neither built: None, the torch ops.
Fused kernels replace the elementwise chains of each layer (residual add + RMSNorm, q/k norm +
RoPE, SiLU * up), which dominate a small model's decode step through per-op dispatch (CPU) or
per-kernel launch (GPU) cost. Same math as the torch path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from rlengine.model import ext as _ext
from rlengine.model.kernel_choice import KernelChoices, projection_shapes, rows_class, shape_key

FUSED = all(_ext.has_op(op) for op in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul"))
SKINNY = _ext.has_op("skinny_linear") and _ext.has_op("skinny_logits")
BLOCKED = _ext.has_op("inv_linear")
LORA_EXPAND = _ext.has_op("lora_expand")
SKINNY_MAX_ROWS = 8  # csrc/skinny_linear.cpp's kMaxRows
UPCAST_CHUNK_BYTES = 4 << 20  # fp32 weight rows per chunk of the "upcast" GEMM: cache-sized, not [V, C]

KERNELS = KernelChoices("measure")
"""The process's CPU kernel choices (LLM(cpu_kernels=...) configures it); see kernel_choice.py."""


def _upcast_matmul(x_BK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T in fp32 over chunks of w's rows, each upcast into one reused cache-sized buffer:
    fp32 accumulation with no fp32 copy of the whole weight. Output in out_dtype."""
    (B, K), N = x_BK.shape, w_NK.shape[0]
    rows = max(16, UPCAST_CHUNK_BYTES // (4 * K))
    buf = _upcast_buffer(rows, K)
    out = torch.empty(B, N, dtype=out_dtype)
    xf = x_BK.float()
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        chunk = buf[: n1 - n0].copy_(w_NK[n0:n1])
        out[:, n0:n1] = torch.mm(xf, chunk.t())
    return out


@functools.lru_cache(maxsize=8)
def _upcast_buffer(rows: int, K: int) -> torch.Tensor:
    """The chunk buffer of _upcast_matmul, one per (rows, K): allocated once, not per decode step
    (a fresh 4 MiB allocation each call costs page faults). Single-threaded use: the engine's step.
    A normal tensor even when first made inside inference mode (the engine's step): an inference
    tensor could not be written later outside it (a no_grad caller)."""
    with torch.inference_mode(False):
        return torch.empty(rows, K, dtype=torch.float32)


CHUNK_BYTES = 2 << 20  # weight rows per GEMM of the "chunked" linear: an L2/L3-slice-sized block
CHUNKED_MIN_ROWS = 16  # token rows from which it is a candidate (prefill and big batches, not decode GEMVs)


def _chunk_rows(w_NK: torch.Tensor) -> int:
    return max(256, CHUNK_BYTES // (w_NK.shape[1] * w_NK.element_size()))


def _chunked_ok(x_BK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    return (x_BK.dim() == 2 and x_BK.shape[0] >= CHUNKED_MIN_ROWS and x_BK.dtype == w_NK.dtype
            and x_BK.dtype in (torch.float32, torch.bfloat16) and w_NK.shape[0] >= 2 * _chunk_rows(w_NK))


def _chunked_linear(x_BK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w.T as one GEMM per block of w's rows (CHUNK_BYTES of weight each), written into column slices of
    one output. On a 2-core EPYC, fp32 at 64-256 rows, MKL runs a [4096-6144, 1024] weight 15-40% slower in
    one call than in 512-row blocks (the fused q/k/v and gate/up projections of a 0.6B model)."""
    N, rows = w_NK.shape[0], _chunk_rows(w_NK)
    out = torch.empty(x_BK.shape[0], N, dtype=x_BK.dtype, device=x_BK.device)
    for a in range(0, N, rows):
        torch.mm(x_BK, w_NK[a:a + rows].t(), out=out[:, a:a + rows])
    return out


def _skinny_ok(x_BK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    return (SKINNY and x_BK.dim() == 2 and 1 <= x_BK.shape[0] <= SKINNY_MAX_ROWS and w_NK.is_contiguous()
            and x_BK.dtype == w_NK.dtype and x_BK.dtype in (torch.float32, torch.bfloat16))


def _blocked_ok(x_BK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    """csrc/batch_invariant.cpp's blocked linear (any rows; the batch-invariant mode's kernel) applies."""
    return (BLOCKED and x_BK.dim() == 2 and x_BK.dtype == w_NK.dtype and x_BK.dtype in (torch.float32, torch.bfloat16)
            and x_BK.shape[1] > 0)


def _choose(op: str, x_BK: torch.Tensor, w_NK: torch.Tensor, candidates: Callable[[], dict], *,
            rule: str | None = None, unpinned: str | None = None) -> str:
    """The implementation KERNELS chose for (op, x's dtype and rows, w's shape), deciding it at first use.
    rule: the "skinny" mode's choice (default: skinny where it is a candidate, else torch); unpinned: what
    a pinned table without this shape class runs (default: none, KERNELS raises)."""
    memo_key = (op, x_BK.dtype, x_BK.shape[0], w_NK.shape)
    impl = KERNELS.memo.get(memo_key)
    if impl is None:
        key = shape_key(op, x_BK.dtype, x_BK.shape[0], tuple(w_NK.shape))
        if unpinned is not None and KERNELS.mode == "pinned" and key not in KERNELS.table:
            impl = unpinned
        else:
            cands = candidates()
            impl = KERNELS.choose(key, cands, rule=rule or ("skinny" if "skinny" in cands else "torch"))
        KERNELS.memo[memo_key] = impl
    return impl


def _llc_bytes() -> int:
    """The largest CPU cache on this machine (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            pass
    return max(sizes, default=32 << 20)


COLD_BYTES = 2 * _llc_bytes()  # weights the candidates rotate over while timed: twice the last-level cache
COLD_MAX_COPIES = 32


class _ColdWeights:
    """The weight and, made at the first timed call, enough copies of it to fill COLD_BYTES: each call
    takes the next one, so every candidate is timed streaming its weight from memory, as a decode step
    streams each layer's weights. Timed on one hot weight, a kernel that wins from cache can lose the
    real step: on a 2-core EPYC the skinny GEMV beat torch's linear at 8 rows by 15% from L3 and made
    the qwen3-30m decode step 2x slower (rlengine/benchmarks/micro/decode_profile.py)."""

    def __init__(self, w_NK: torch.Tensor):
        self.w_NK, self.copies, self.i = w_NK, None, 0

    def next(self) -> torch.Tensor:
        if self.copies is None:
            n = min(COLD_MAX_COPIES, -(-COLD_BYTES // max(1, self.w_NK.numel() * self.w_NK.element_size())))
            self.copies = [self.w_NK] + [self.w_NK.clone() for _ in range(n - 1)]
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


def _linear_candidates(x_BK, w_NK) -> dict:
    cold = _ColdWeights(w_NK)
    cands = {"torch": lambda: F.linear(x_BK, cold.next())}
    if _skinny_ok(x_BK, w_NK):
        cands["skinny"] = lambda: torch.ops.rlengine.skinny_linear(x_BK, cold.next())
    if x_BK.dtype == torch.bfloat16 and w_NK.dtype == torch.bfloat16:
        cands["upcast"] = lambda: _upcast_matmul(x_BK, cold.next(), torch.bfloat16)
    if _blocked_ok(x_BK, w_NK):
        cands["blocked"] = lambda: torch.ops.rlengine.inv_linear(x_BK, cold.next(), None, False)
    if _chunked_ok(x_BK, w_NK):
        cands["chunked"] = lambda: _chunked_linear(x_BK, cold.next())
    return cands


def linear_nograd(x_TC: torch.Tensor, w: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T on the CPU inference path (no bias, no autograd), by the implementation KERNELS
    chose for this (dtype, rows, weight shape); elsewhere torch's linear. like: decide by that weight's
    shape class instead (LoRA's [W; A] runs as W does: the same stream plus n*r rows; timed on its own,
    a choice within the noise of W's could put the two on different kernels)."""
    if x_TC.device.type != "cpu" or x_TC.dim() != 2 or x_TC.shape[0] == 0 or w.dtype != x_TC.dtype:
        return F.linear(x_TC, w)
    key_w = w if like is None or like.dtype != w.dtype or like.shape[1] != w.shape[1] else like
    impl = _choose("linear", x_TC, key_w, lambda: _linear_candidates(x_TC, key_w))
    if impl == "skinny":
        return torch.ops.rlengine.skinny_linear(x_TC, w)
    if impl == "upcast":
        return _upcast_matmul(x_TC, w, x_TC.dtype)
    if impl == "blocked":
        return torch.ops.rlengine.inv_linear(x_TC, w, None, False)
    if impl == "chunked":
        return _chunked_linear(x_TC, w)
    return F.linear(x_TC, w)


def lora_expand_nograd(y_TO: torch.Tensor, t_TJ: torch.Tensor | None, B_OJ: torch.Tensor, scale: float, r: int,
                       blocks: tuple[int, ...]) -> torch.Tensor:
    """LoRA's second GEMM on the CPU inference path: y + scale * t B^T [T, O], a new tensor; t None: y is
    the [T, O + J] output of the GEMM on [W; A], its first O columns y and the rest t. B is block-diagonal
    (model/lora.py): `blocks` flattens (row0, col0, rows) per targeted slice, each reading r columns of t.
    By the implementation KERNELS chose for (dtype, rows, B's shape): "torch" (the chosen linear on the
    dense B, then the add) or "expand" (csrc/lora_expand.cpp: only the blocks, one rounding)."""
    if not LORA_EXPAND or y_TO.device.type != "cpu" or y_TO.dim() != 2 or y_TO.shape[0] == 0:
        return _lora_dense(y_TO, t_TJ, B_OJ, scale, linear_nograd)

    def candidates() -> dict:
        cold = _ColdWeights(B_OJ)
        return {"torch": lambda: _lora_dense(y_TO, t_TJ, cold.next(), scale, linear_nograd),
                "expand": lambda: torch.ops.rlengine.lora_expand(y_TO, t_TJ, cold.next(), scale, r, blocks)}
    # a pinned table saved before this choice existed: the fixed rule it was saved with (torch)
    impl = _choose("lora_expand", y_TO, B_OJ, candidates, rule="expand", unpinned="torch")
    if impl == "expand":
        return torch.ops.rlengine.lora_expand(y_TO, t_TJ, B_OJ, scale, r, blocks)
    return _lora_dense(y_TO, t_TJ, B_OJ, scale, linear_nograd)


def _lora_dense(y_TO, t_TJ, B_OJ, scale, linear) -> torch.Tensor:
    """y + scale * t B^T with one GEMM on the dense B (t None: y holds [y | t], as lora_expand_nograd)."""
    if t_TJ is None:
        O = B_OJ.shape[0]
        y_TO, t_TJ = y_TO[:, :O], y_TO[:, O:]
    d_TO = linear(t_TJ, B_OJ)
    return torch.add(y_TO, d_TO, alpha=scale, out=d_TO)


def _logits_candidates(h_BC, w_VC) -> dict:
    cold = _ColdWeights(w_VC)
    if h_BC.dtype == torch.float32:
        cands = {"torch": lambda: F.linear(h_BC, cold.next())}
    else:  # torch's own way to fp32 logits from bf16 weights is the full upcast ([V, C] fp32 copy)
        cands = {"torch": lambda: F.linear(h_BC.float(), cold.next().float()),
                 "upcast": lambda: _upcast_matmul(h_BC, cold.next(), torch.float32)}
    if _skinny_ok(h_BC, w_VC):
        cands["skinny"] = lambda: torch.ops.rlengine.skinny_logits(h_BC, cold.next())
    if _blocked_ok(h_BC, w_VC):
        cands["blocked"] = lambda: torch.ops.rlengine.inv_linear(h_BC, cold.next(), None, True)
    return cands


def logits_fp32(h_BC: torch.Tensor, w_VC: torch.Tensor, *, engine: bool = False) -> torch.Tensor:
    """h @ W^T with fp32 accumulation and fp32 output: [B, C] x [V, C] -> [B, V] fp32.

    CUDA: one GEMM with out_dtype=float32 (cuBLAS accumulates in fp32; no fp32 copy of W).
    CPU with engine=True (the engine's sampled rows, no autograd): the implementation KERNELS
    chose (the skinny kernel reading bf16 rows, the chunked upcast, or torch on a full fp32 copy).
    CPU otherwise (the learner): the full upcast, which autograd differentiates. A float64 model
    (the test-only dtype of the exact multi-rank comparisons) keeps float64 logits.
    """
    if h_BC.dtype == torch.float64:
        return F.linear(h_BC, w_VC.double())
    if h_BC.device.type == "cuda" and _MM_OUT_DTYPE:
        return torch.mm(h_BC, w_VC.t(), out_dtype=torch.float32)
    if (not engine or h_BC.device.type != "cpu" or h_BC.dim() != 2 or h_BC.shape[0] == 0 or w_VC.dtype != h_BC.dtype
            or h_BC.dtype not in (torch.float32, torch.bfloat16)
            or (torch.is_grad_enabled() and (h_BC.requires_grad or w_VC.requires_grad))):
        return F.linear(h_BC.float(), w_VC.float())
    impl = _choose("logits", h_BC, w_VC, lambda: _logits_candidates(h_BC, w_VC))
    if impl == "skinny":
        return torch.ops.rlengine.skinny_logits(h_BC, w_VC)
    if impl == "upcast":
        return _upcast_matmul(h_BC, w_VC, torch.float32)
    if impl == "blocked":
        return torch.ops.rlengine.inv_linear(h_BC, w_VC, None, True)
    return F.linear(h_BC.float(), w_VC.float())


def decide_for_model(cfg, dtype: torch.dtype, rows: list[int], *, logits_rows: list[int] | None = None) -> dict:
    """Decide every (shape, rows class) a CPU engine on model config `cfg` meets, now, with random
    weights of those shapes: rows for the projections (decode batches and prefill chunks),
    logits_rows (default: rows <= 512) for the LM head. Uses and fills KERNELS;
    returns its table. A multi-rank job runs this on rank 0 and pins the result on every rank."""
    g = torch.Generator().manual_seed(0)
    logits_rows = logits_rows if logits_rows is not None else [r for r in rows if r <= 512]
    classes = sorted({int(rows_class(r)) for r in rows})
    for name, (N, K) in projection_shapes(cfg).items():
        w = torch.randn(N, K, generator=g).to(dtype)
        wanted = sorted({int(rows_class(r)) for r in logits_rows}) if name == "lm_head" else classes
        for r in wanted:
            x = torch.randn(r, K, generator=g).to(dtype)
            with torch.no_grad():
                logits_fp32(x, w, engine=True) if name == "lm_head" else linear_nograd(x, w)
    return KERNELS.to_dict()


def _mm_has_out_dtype() -> bool:
    try:
        return "out_dtype" in str(torch.ops.aten.mm.dtype._schema)
    except (AttributeError, RuntimeError):
        return False


_MM_OUT_DTYPE = _mm_has_out_dtype()


@dataclass(frozen=True, slots=True)
class LoraOps:
    """A projection with its adapter on the no-grad path (model/lora.py LoraAdapter.project)."""

    joint: Callable  # (x, [W; A], W) -> x [W; A]^T, under W's kernel choice
    expand: Callable  # (y, t | None, B, scale, r, blocks) -> y + scale t B^T (lora_expand_nograd)


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The kernels of the no-grad fast path, one set per device with the same signatures:
    the C++ ops on the CPU, kernels/fused_norm.py (Triton) on a GPU."""

    rms_norm: Callable
    fused_add_rms_norm: Callable
    qk_norm_rope: Callable
    silu_and_mul: Callable
    linear: Callable  # x @ w.T without bias
    lora: LoraOps | None = None  # LoRA's projection kernels (model/lora.py LoraAdapter.project); None: torch
    stores_kv: bool = False  # qk_norm_rope takes kv_cache= (the Triton set): gen.decode_kernels = "fused" applies


CPU_OPS = FusedOps(torch.ops.rlengine.rms_norm, torch.ops.rlengine.fused_add_rms_norm,
                   torch.ops.rlengine.qk_norm_rope, torch.ops.rlengine.silu_and_mul,
                   linear_nograd, LoraOps(linear_nograd, lora_expand_nograd)) if FUSED else None


@functools.cache
def triton_ops() -> FusedOps | None:
    """The Triton set (None without triton); also usable on the CPU under TRITON_INTERPRET=1 (tests)."""
    try:
        from rlengine.kernels import _triton, fused_norm
    except ImportError:
        return None
    if not _triton.AVAILABLE:  # the kernel module imports without triton, its kernels do not launch
        return None
    return FusedOps(fused_norm.rms_norm, fused_norm.fused_add_rms_norm, fused_norm.qk_norm_rope,
                    fused_norm.silu_and_mul, F.linear, stores_kv=True)


def fused_ops_for(device: torch.device) -> FusedOps | None:
    """The fast path's kernels for `device`, or None to run the plain torch path."""
    if device.type == "cpu":
        return CPU_OPS
    if device.type == "cuda":
        return triton_ops()
    return None
