"""The launches of the sm_90 compile tier: every Triton kernel of rlengine, through its own launchers,
at the shapes of three real models and every config the launchers can pick.

Each Case calls public launchers (paged_decode, rms_norm, fused_moe, fused_logprob, ...) on fake
CUDA tensors; the stand-in driver (standin.py) compiles what they launch. Models: Qwen3-0.6B
(dense, q/k norm), Qwen3-30B-A3B (MoE, E=128, K=8) and Llama-3-8B (dense, RoPE only, V=128,256).
Dtypes: bf16 and fp16 for every kernel, fp32 too for paged decode and the log-prob kernels.
Configs: paged decode with S = 1 (one launch) and every merge width S can round to (2..64); cascade
(shared-prefix) decode at each prefix tile height BLOCK_M (16, 32, 64 query rows; 32 at most in fp32) and each suffix split count;
the fused MoE at token counts that select each row of its config table (rows per expert <= 16,
<= 64, <= 512, more), forward and backward; moe_align at every power-of-two N_BLOCK up to its
8,192-pair limit; the log-prob forward and each gradient combination of its backward.
A kernel added to rlengine joins the tier by adding its launches here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from rlengine.model.config import ModelConfig, preset

MODELS = ("qwen3-0.6b", "qwen3-30b-a3b", "llama-3-8b")
HALF = (torch.bfloat16, torch.float16)
ALL = (torch.bfloat16, torch.float16, torch.float32)
PAGE_SIZE = 16             # the engine's default block_size
DECODE_TOKENS = 8          # rows of a decode step (any count compiles the same kernel)
SPLITS = (1, 2, 4, 8, 16, 32, 64)  # S = 1 is the direct path; S > 1 rounds to these merge widths
MOE_TOKENS = (64, 512, 4096, 16384)  # T*K/E = 4, 32, 256, 1024 rows per expert: the four config rows
MOE_SORTED_CANDIDATES = (2, 3)  # tile candidates per kernel of kernels/moe_tuning.py at T = 4096, 16384 (at most)
LOGPROB_TOKENS = 4096

# The kernels whose spills fail the tier outright (see test_sm90_compile): what every decode step
# and every learner forward runs. Variants are "hot" when their kernel is listed for their dtype.
HOT = {
    "_split_kernel": HALF, "_merge_kernel": HALF, "_prefix_kernel": HALF,
    "_rms_norm_kernel": HALF, "_silu_and_mul_kernel": HALF, "_qk_norm_rope_kernel": HALF,
    "_gate_up_kernel": HALF, "_pair_gemm_kernel": HALF, "_small_m_gemm_kernel": HALF, "_sorted_wgrad_kernel": HALF,
    "_logprob_fwd_kernel": ALL,
    "_inv_matmul_kernel": HALF, "_inv_attention_kernel": HALF, "_inv_logsumexp_kernel": (torch.float32,),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One group of launches: `run()` launches them on fake CUDA tensors."""

    name: str                 # model/op/dtype[/detail]
    dtype: torch.dtype
    run: Callable[[], None]


def _empty(*shape, dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _decode(cfg: ModelConfig, dtype: torch.dtype, num_splits: int) -> None:
    from rlengine.kernels.paged_decode import alloc_workspace, paged_decode

    B, H, Hkv, D = DECODE_TOKENS, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages = 64 * B
    q = _empty(B, H, D, dtype=dtype)
    k_cache, v_cache = _empty(pages, PAGE_SIZE, Hkv, D, dtype=dtype), _empty(pages, PAGE_SIZE, Hkv, D, dtype=dtype)
    indptr, indices = _empty(B + 1, dtype=torch.int32), _empty(pages, dtype=torch.int32)
    last = _empty(B, dtype=torch.int32)
    ws = alloc_workspace(B, H, D, num_splits, "cuda")
    paged_decode(q, k_cache, v_cache, indptr, indices, last, sm_scale=D ** -0.5, max_num_pages=64,
                 out=_empty(B, H, D, dtype=dtype), workspace=ws, num_splits=num_splits)


def _cascade(cfg: ModelConfig, dtype: torch.dtype, rows: int, num_splits: int) -> None:
    from rlengine.kernels.cascade_decode import alloc_cascade_workspace, cascade_decode

    B, H, Hkv, D = 16, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G = H // Hkv
    max_rows = max(1, rows // G)  # chunk rows whose G query heads fill a BLOCK_M = rows tile
    pages = 64 * B
    q = _empty(B, H, D, dtype=dtype)
    k_cache, v_cache = _empty(pages, PAGE_SIZE, Hkv, D, dtype=dtype), _empty(pages, PAGE_SIZE, Hkv, D, dtype=dtype)
    C = -(-B // max_rows)
    i32 = lambda n: _empty(n, dtype=torch.int32)  # noqa: E731
    cascade_decode(q, k_cache, v_cache, i32(C + 1), i32(C + 1), i32(pages), i32(B + 1), i32(pages), i32(B),
                   sm_scale=D ** -0.5, max_rows=max_rows, max_suffix_pages=8,
                   workspace=alloc_cascade_workspace(B, H, D, "cuda"), out=_empty(B, H, D, dtype=dtype),
                   num_splits=num_splits)


def _norms(cfg: ModelConfig, dtype: torch.dtype) -> None:
    from rlengine.kernels import fused_norm as fn

    T, C, H, Hkv, D = DECODE_TOKENS, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x, w = _empty(T, C, dtype=dtype), _empty(C, dtype=dtype)
    fn.rms_norm(x, w, 1e-6)
    fn.fused_add_rms_norm(x, _empty(T, C, dtype=dtype), w, 1e-6)
    ffn = [cfg.intermediate_size] + ([cfg.moe_intermediate_size] if cfg.num_experts else [])
    for F in ffn:
        fn.silu_and_mul(_empty(T, 2 * F, dtype=dtype))
    qkv = _empty(T, (H + 2 * Hkv) * D, dtype=dtype)
    cos_sin = _empty(2, 4096, D, dtype=torch.float32)
    pos = _empty(T, dtype=torch.int64)
    qk_w = (_empty(D, dtype=dtype), _empty(D, dtype=dtype)) if cfg.model_type == "qwen3" else (None, None)
    cache = (_empty(64, PAGE_SIZE, Hkv, D, dtype=dtype), _empty(64, PAGE_SIZE, Hkv, D, dtype=dtype),
             _empty(T, dtype=torch.int64))
    fn.qk_norm_rope(qkv, *qk_w, cos_sin, pos, H, Hkv, 1e-6)                   # the learner's prefill path
    fn.qk_norm_rope(qkv, *qk_w, cos_sin, pos, H, Hkv, 1e-6, kv_cache=cache)   # the decode step: also stores K/V


def _small_m(cfg: ModelConfig, dtype: torch.dtype, rows: int, candidates: bool) -> None:
    # The fused decode layer's four projections (norm+qkv, o_proj+residual, norm+gate_up+SiLU, down+residual)
    # with the config choose_config gives each at `rows`, one of them with programmatic dependent launch;
    # candidates=True: every tile config tune() may pick on a GPU, on gate_up (the two-accumulator kernel).
    from rlengine.kernels import small_m_gemm as sm

    C, H, Hkv, D, F = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.intermediate_size
    ws = sm.SmallMWorkspace.for_shapes([((H + 2 * Hkv) * D, C), (C, H * D), (F, C), (C, F)], "cuda")
    x, g = _empty(rows, C, dtype=dtype), _empty(C, dtype=dtype)
    if candidates:  # a workspace for every split of every candidate (fake tensors: no memory)
        ws = sm.SmallMWorkspace(F // 32, 16 * F // 32, "cuda")
        for config in sm.CANDIDATES:
            sm.norm_gate_up_silu(x, g, 1e-6, _empty(2 * F, C, dtype=dtype), workspace=ws, config=config)
        return
    w_qkv = _empty((H + 2 * Hkv) * D, C, dtype=dtype)
    sm.norm_linear(x, g, 1e-6, w_qkv, workspace=ws)
    sm.norm_linear(x, g, 1e-6, w_qkv, _empty((H + 2 * Hkv) * D, dtype=dtype), workspace=ws)  # Qwen2's q/k/v bias
    sm.linear_residual(_empty(rows, H * D, dtype=dtype), _empty(C, H * D, dtype=dtype), x, workspace=ws)
    sm.norm_gate_up_silu(x, g, 1e-6, _empty(2 * F, C, dtype=dtype), workspace=ws, pdl=True)
    sm.linear_residual(_empty(rows, F, dtype=dtype), _empty(C, F, dtype=dtype), x, workspace=ws)


def _moe(cfg: ModelConfig, dtype: torch.dtype, T: int, backward: str = "v1", candidate: int = 0) -> None:
    # Autograd cannot run on fake CUDA tensors in a CPU build of torch (its graph nodes take a CUDA
    # device guard), so the training step calls the forward and backward launchers FusedMoEFunction
    # calls, in the same order.
    from rlengine.kernels import fused_moe as fm

    E, K, C, F = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    x, w13, w2 = _empty(T, C, dtype=dtype), _empty(E, 2 * F, C, dtype=dtype), _empty(E, C, F, dtype=dtype)
    tw, ids = _empty(T, K, dtype=dtype), _empty(T, K, dtype=torch.int64)
    if backward == "v1":
        fm.fused_moe(x, w13, w2, tw, ids)                              # inference: no pre-activations saved
        _, (moe_cfg, align, gu) = fm._forward(x, w13, w2, tw, ids, save_preact=True)  # training forward
        fm._backward(_empty(T, C, dtype=dtype), x, w13, w2, tw, gu, moe_cfg, align)
        return
    # the sorted path with every kernel's tiles pinned to candidate `candidate` of the shape class (its
    # last one where a kernel has fewer): no timing on a fake device
    from rlengine.kernels import moe_tuning as mt
    from rlengine.kernels.moe_gemm import shape_class

    pinned = fm.select_config(T * K, E, C, F)
    for kernel in mt.CANDIDATES:
        cands = mt.candidates(kernel, shape_class(T * K, E), C, F)
        pinned = mt.with_tiles(pinned, kernel, cands[min(candidate, len(cands) - 1)]) if cands else pinned
    with fm.pin_config(pinned):
        _, (moe_cfg, align, gu) = fm._forward(x, w13, w2, tw, ids, save_preact=True, gu_sorted=True)
        fm._backward(_empty(T, C, dtype=dtype), x, w13, w2, tw, gu, moe_cfg, align, variant="sorted")


def _moe_align(cfg: ModelConfig, num_pairs: int) -> None:
    from rlengine.kernels import moe_align as ma
    from rlengine.kernels.fused_moe import select_config

    K = cfg.num_experts_per_tok
    block_m = select_config(num_pairs, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size).block_m
    ma.moe_align(_empty(num_pairs // K, K, dtype=torch.int64), cfg.num_experts, block_m)
    if ma.KERNEL_STATE.error:  # moe_align falls back to torch on a compile error: surface it here
        raise RuntimeError(f"moe_align did not compile: {ma.KERNEL_STATE.error}")


def _logprob(cfg: ModelConfig, dtype: torch.dtype) -> None:
    # As in _moe: FusedLogProbFunction's forward and backward launchers, called without autograd.
    from rlengine.kernels.fused_logprob import default_config, logprob_backward, logprob_forward

    T, C, V = LOGPROB_TOKENS, cfg.hidden_size, cfg.vocab_size
    # skip_zero_rows only adds a host-side gather (a sync a fake tensor cannot answer); same kernels
    config = dataclasses.replace(default_config(torch.device("cuda"), dtype), skip_zero_rows=False)
    h, w, targets = _empty(T, C, dtype=dtype), _empty(V, C, dtype=dtype), _empty(T, dtype=torch.int64)
    _, ent, lse = logprob_forward(h, w, targets, 1.0, config)
    for g_logp, g_ent in ((True, False), (False, True), (True, True)):  # each HAS_G_* combination
        grads = [_empty(T, dtype=torch.float32) if on else None for on in (g_logp, g_ent)]
        logprob_backward(h, w, targets, lse, ent, *grads, 1.0, config, True, True)


def _invariant(cfg: ModelConfig, dtype: torch.dtype) -> None:
    # The batch-invariant mode's kernels at the model's shapes: every linear (one config per (N, K)),
    # the fp32-output LM head, the packed causal pass and paged decode (the logsumexp: its own fp32 case).
    from rlengine.kernels.invariant_attention import invariant_attention_varlen, invariant_paged_decode
    from rlengine.kernels.invariant_matmul import invariant_matmul

    T, C, H, Hkv, D = DECODE_TOKENS, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = _empty(T, C, dtype=dtype)
    for N, K in (((H + 2 * Hkv) * D, C), (C, H * D), (2 * cfg.intermediate_size, C), (C, cfg.intermediate_size)):
        invariant_matmul(_empty(T, K, dtype=dtype), _empty(N, K, dtype=dtype))
    invariant_matmul(x, _empty(cfg.vocab_size, C, dtype=dtype), fp32_out=True)
    q, k = _empty(T, H, D, dtype=dtype), _empty(T, Hkv, D, dtype=dtype)
    invariant_attention_varlen(q, k, k, _empty(3, dtype=torch.int64), D ** -0.5)
    pages = 64 * T
    cache = _empty(pages, PAGE_SIZE, Hkv, D, dtype=dtype)
    invariant_paged_decode(q, cache, cache, _empty(T + 1, dtype=torch.int32), _empty(pages, dtype=torch.int32),
                           _empty(T, dtype=torch.int32), D ** -0.5, _empty(T, H, D, dtype=dtype))


def _invariant_logsumexp(cfg: ModelConfig) -> None:
    # its input is the fp32 logits whatever the model's dtype, so it is its own fp32 case
    from rlengine.kernels.invariant_logsumexp import invariant_logsumexp

    invariant_logsumexp(_empty(DECODE_TOKENS, cfg.vocab_size, dtype=torch.float32))


def cases(models: tuple[str, ...] = MODELS) -> list[Case]:
    """Every launch group of the tier, in a fixed order."""
    out: list[Case] = []
    for name in models:
        cfg = preset(name)
        for dtype in ALL:
            for s in SPLITS:
                out.append(Case(f"{name}/paged_decode/{_dt(dtype)}/S={s}", dtype,
                                lambda c=cfg, d=dtype, s=s: _decode(c, d, s)))
            for rows in (16, 32) if dtype == torch.float32 else (16, 32, 64):  # fp32 caps the tile at 32 rows
                for s in (1, 2, 4):
                    out.append(Case(f"{name}/cascade_decode/{_dt(dtype)}/M={rows}/S={s}", dtype,
                                    lambda c=cfg, d=dtype, r=rows, s=s: _cascade(c, d, r, s)))
        for dtype in HALF:
            out.append(Case(f"{name}/norms/{_dt(dtype)}", dtype, lambda c=cfg, d=dtype: _norms(c, d)))
        if not cfg.num_experts:  # the fused decode layer (small-M GEMMs): dense models
            for dtype in HALF:
                for rows in (1, 64):
                    out.append(Case(f"{name}/small_m_gemm/{_dt(dtype)}/M={rows}", dtype,
                                    lambda c=cfg, d=dtype, r=rows: _small_m(c, d, r, False)))
            if name == MODELS[0]:
                out.append(Case(f"{name}/small_m_gemm/bfloat16/candidates", torch.bfloat16,
                                lambda c=cfg: _small_m(c, torch.bfloat16, 1, True)))
        if not cfg.num_experts:  # batch-invariant mode: dense models
            for dtype in ALL:
                out.append(Case(f"{name}/invariant/{_dt(dtype)}", dtype, lambda c=cfg, d=dtype: _invariant(c, d)))
            out.append(Case(f"{name}/invariant_logsumexp/float32", torch.float32,
                            lambda c=cfg: _invariant_logsumexp(c)))
        for dtype in ALL:
            out.append(Case(f"{name}/logprob/{_dt(dtype)}", dtype, lambda c=cfg, d=dtype: _logprob(c, d)))
        if cfg.num_experts:
            for dtype in HALF:
                for T in MOE_TOKENS:
                    out.append(Case(f"{name}/fused_moe/{_dt(dtype)}/T={T}", dtype,
                                    lambda c=cfg, d=dtype, T=T: _moe(c, d, T)))
                for T, n in zip(MOE_TOKENS[2:], MOE_SORTED_CANDIDATES):  # the sorted path: training shapes
                    for i in range(n if dtype == torch.bfloat16 else 1):  # every candidate in bf16, the first in fp16
                        out.append(Case(f"{name}/fused_moe_sorted/{_dt(dtype)}/T={T}/candidate={i}", dtype,
                                        lambda c=cfg, d=dtype, T=T, i=i: _moe(c, d, T, "sorted", i)))
            from rlengine.kernels.moe_align import MAX_KERNEL_PAIRS
            n = 16
            while n <= MAX_KERNEL_PAIRS:
                out.append(Case(f"{name}/moe_align/N={n}", torch.int64, lambda c=cfg, n=n: _moe_align(c, n)))
                n *= 2
    return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
