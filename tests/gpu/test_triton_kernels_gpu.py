"""GPU tier for the Triton kernels: each against its oracle, compiled for the device, bf16 included.

Deselected without a CUDA device (tests/conftest.py); tools/gpu_check.sh runs it. The checks and their
tolerances live in tests/support/kernel_checks.py, where each bound is derived;
tests/kernels/test_planted_bugs.py shows under the interpreter that those same checks fail on planted
bugs. Sections: paged decode (the whole CPU case list, needles, long context with the engine's
workspace, > 2^31-element cache), fused log-prob (bf16 and fp32 configs, chunked backward,
determinism, > 2^31-element LM head), fused MoE (Qwen3-30B-A3B expert shape at T = 1, 64, 2048; bf16
with no host sync; alignment kernel, in a CUDA graph), fused norms (direct bf16 parity, the KV store
folded into q/k-norm+RoPE, > 2^31-element activations).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlengine.kernels import fused_moe as fm
from rlengine.kernels import fused_norm as fn
from rlengine.kernels import paged_decode as pd
from rlengine.kernels.fused_logprob import LogProbConfig, fused_logprob, fused_logprob_ref
from rlengine.kernels.moe_align import KERNEL_STATE, moe_align, moe_align_ref

from tests.support.kernel_checks import (MOE_REL_NORM, assert_decode_close, assert_logprob_close, assert_rel_norm,
                                         check_logprob, sdpa_fp64)
from tests.support.kv_cache_ref import store_kvcache_ref
from tests.support.moe_cases import ALIGN_CASES, make_inputs, make_routing
from tests.support.paged_decode_cases import TRITON_CASES, contiguous_sdpa, make_batch, needle_case
from tests.support.tolerances import tol

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BIG = 2**31 + 2**20  # elements: past every int32 offset


# ----------------------------------------------------------------------------- paged decode

# The interpreter's cases plus the C++ kernel's product (GQA 1-8 x D 64/128 x P 8/16/32, contexts
# 1, P, P+1, 2P-1, 97, 300), with the split count the heuristic picks on this GPU.
DECODE_CASES = TRITON_CASES + [
    (f"product-gqa{g}-D{d}-P{p}", [1, p, p + 1, 2 * p - 1, 97, 300], 2 * g, 2, d, p, None)
    for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 16, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_paged_decode_case_list(case, dtype):
    _, ctx_lens, H, Hkv, D, P, num_splits = case
    batch = make_batch(ctx_lens, H, Hkv, D, P, dtype, seed=len(ctx_lens) + D + P).to(DEVICE)
    out = torch.full_like(batch.q, float("nan"))
    pd.paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5,
                    max_num_pages=batch.max_num_pages, out=out, num_splits=num_splits)
    assert_decode_close(out, contiguous_sdpa(batch, D**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["last", "split-boundary"])
def test_paged_decode_needle(where, dtype):
    """ctx 2049, 4 splits: the needle token carries ~98% of the mass, so dropping it moves the output by ~4."""
    batch, out = needle_case(where, dtype, device=DEVICE, D=128)
    assert_decode_close(out, contiguous_sdpa(batch, 128**-0.5), dtype)


@pytest.mark.parametrize("ctx_lens", [[32768], [32768, 1, 5000, 17]], ids=["B1-32k", "ragged-32k"])
def test_paged_decode_long_context_engine_workspace(ctx_lens):
    """The engine's setup: a workspace sized by num_kv_heads, splits from the SM count (33 on 132 SMs)."""
    H, Hkv, D, P = 16, 8, 128, 16
    batch = make_batch(ctx_lens, H, Hkv, D, P, torch.bfloat16, seed=1, spare_blocks=0).to(DEVICE)
    ws = pd.alloc_workspace(8, H, D, pd.MAX_SPLITS, DEVICE, num_kv_heads=Hkv)
    splits = pd.choose_num_splits(len(ctx_lens), Hkv, batch.max_num_pages, P, DEVICE)
    assert 1 < min(splits, ws.max_splits(len(ctx_lens))) <= pd.MAX_SPLITS
    out = torch.full_like(batch.q, float("nan"))
    pd.paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5,
                    max_num_pages=batch.max_num_pages, out=out, workspace=ws)
    assert_decode_close(out, contiguous_sdpa(batch, D**-0.5), torch.bfloat16)


def test_paged_decode_cache_past_int32_offsets():
    """K/V caches of > 2^31 elements each; the sequence's pages sit at the top block ids."""
    P, Hkv, D, H, ctx = 16, 8, 128, 16, 300
    num_blocks = -(-BIG // (P * Hkv * D))
    k_cache = torch.empty(num_blocks, P, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    pages = -(-ctx // P)
    ids = torch.arange(num_blocks - pages, num_blocks, device=DEVICE, dtype=torch.int32).flip(0)
    k_cache[ids.long()] = torch.randn(pages, P, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache[ids.long()] = torch.randn(pages, P, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(1, H, D, device=DEVICE, dtype=torch.bfloat16)
    indptr = torch.tensor([0, pages], device=DEVICE, dtype=torch.int32)
    last = torch.tensor([ctx - (pages - 1) * P], device=DEVICE, dtype=torch.int32)
    for splits in (1, 3):
        out = pd.paged_decode(q, k_cache, v_cache, indptr, ids, last, sm_scale=D**-0.5, max_num_pages=pages,
                              num_splits=splits)
        k_seq = k_cache[ids.long()].reshape(-1, Hkv, D)[:ctx]
        v_seq = v_cache[ids.long()].reshape(-1, Hkv, D)[:ctx]
        assert_decode_close(out[0], sdpa_fp64(q[0], k_seq, v_seq, D**-0.5), torch.bfloat16, f"splits={splits}")


# ----------------------------------------------------------------------------- fused log-prob


def _logprob_inputs(T, C, V, dtype, scale=2.0, seed=0, requires_grad_w=True):
    """Logits of std ~scale (neither flat nor one-hot), random targets and upstream gradients."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(T, C, device=DEVICE, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, C, device=DEVICE, generator=g) * (scale / math.sqrt(C))).to(dtype)
    targets = torch.randint(0, V, (T,), device=DEVICE, generator=g)
    return (h, w.requires_grad_(requires_grad_w), targets, torch.randn(T, device=DEVICE, generator=g),
            torch.randn(T, device=DEVICE, generator=g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-own-config"])
def test_fused_logprob(dtype):
    """T=257 and V=4099: partial token and vocab tiles with the default (per-dtype) GPU config."""
    check_logprob(fused_logprob, fused_logprob_ref, *_logprob_inputs(257, 256, 4099, dtype))


def test_fused_logprob_chunked_backward_with_masked_rows():
    """Several token and vocab chunks of d(logits); half the tokens masked (their rows are skipped)."""
    cfg = LogProbConfig(chunk_elems=96 * 512, max_chunk_tokens=96)
    h, w, targets, g_logp, g_ent = _logprob_inputs(300, 128, 3000, torch.bfloat16, seed=1)
    mask = torch.rand(300, device=DEVICE) < 0.5
    fused = lambda *a, **k: fused_logprob(*a, **k, config=cfg)  # noqa: E731
    check_logprob(fused, fused_logprob_ref, h, w, targets, g_logp * mask, g_ent * mask)


def test_fused_logprob_backward_is_deterministic():
    h, w, targets, g_logp, g_ent = _logprob_inputs(1000, 512, 32000, torch.bfloat16, seed=2)
    grads = []
    for _ in range(2):
        lp, ent = fused_logprob(h, w, targets, return_entropy=True)
        grads.append(torch.autograd.grad((lp * g_logp).sum() + (ent * g_ent).sum(), (h, w)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_fused_logprob_lm_head_past_int32_offsets():
    """W [V, C] with V*C > 2^31, targets in the top rows; frozen head (grad_h only). The oracle is
    computed in vocab chunks (a full fp32 copy of W would be 9 GiB) from the same formulas."""
    T, C = 64, 16384
    V = -(-BIG // C)
    h, w, _, g_logp, g_ent = _logprob_inputs(T, C, V, torch.bfloat16, seed=3, requires_grad_w=False)
    targets = torch.randint(V - 1000, V, (T,), device=DEVICE)
    lp, ent = fused_logprob(h, w, targets, return_entropy=True)
    (gh,) = torch.autograd.grad((lp * g_logp).sum() + (ent * g_ent).sum(), (h,))
    chunks = range(0, V, 16384)
    z = torch.cat([h.detach().float() @ w[v:v + 16384].float().T for v in chunks], dim=1)
    logp_TV = torch.log_softmax(z, dim=-1)
    p = logp_TV.exp()
    ent_r = -(p * logp_TV).sum(-1)
    lp_r = logp_TV.gather(1, targets[:, None]).squeeze(1)
    dz = -g_logp[:, None] * p - g_ent[:, None] * p * (logp_TV + ent_r[:, None])
    dz[torch.arange(T, device=DEVICE), targets] += g_logp
    gh_r = sum(dz[:, v:v + 16384] @ w[v:v + 16384].float() for v in chunks)
    assert_logprob_close(lp, lp_r, torch.bfloat16, "logp")
    assert_logprob_close(ent, ent_r, torch.bfloat16, "entropy")
    assert_rel_norm(gh.float(), gh_r, 1e-2, "grad_h")


# ----------------------------------------------------------------------------- fused MoE

QWEN3_30B_A3B = {"C": 2048, "F": 768, "E": 128, "K": 8}


@pytest.mark.parametrize("T,block_m", [(1, 16), (64, 16), (2048, 64)], ids=["T1", "T64", "T2048"])
def test_fused_moe_bf16_qwen3_30b_a3b_shape(T, block_m):
    """Forward and all four gradients against the loop over experts, with the config the table picks."""
    C, F_, E, K = QWEN3_30B_A3B.values()
    assert fm.select_config(T * K, E, C, F_).block_m == block_m
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    randn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    logits = randn(T, E)
    top, ids = logits.topk(K, dim=1)
    leaves = [randn(T, C), randn(E, 2 * F_, C) / C**0.5, randn(E, C, F_) / F_**0.5, torch.softmax(top, dim=1)]
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
    dy = randn(T, C).to(torch.bfloat16)
    y = fm.fused_moe(*leaves, ids)
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref = fm.fused_moe_ref(*leaves, ids)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    assert_rel_norm(y.float(), y_ref.float(), MOE_REL_NORM, "y")
    for name, g, g_ref in zip(("x", "w13", "w2", "topk_weights"), grads, grads_ref):
        assert_rel_norm(g.float(), g_ref.float(), MOE_REL_NORM, f"grad {name}")


@pytest.mark.parametrize("T", [64, 2048], ids=["T64_shared_tiles", "T2048_tuned_tiles"])
def test_fused_moe_sorted_backward_bf16_qwen3_30b_a3b_shape(T):
    """The "sorted" backward (fused_moe_bwd.py) at the model shape in bf16, tuned tiles at T=2048, against the
    loop over experts; after its first call (tuning) a second call makes no host sync."""
    C, F_, E, K = QWEN3_30B_A3B.values()
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    randn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    top, ids = randn(T, E).topk(K, dim=1)
    leaves = [randn(T, C), randn(E, 2 * F_, C) / C**0.5, randn(E, C, F_) / F_**0.5, torch.softmax(top, dim=1)]
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
    dy = randn(T, C).to(torch.bfloat16)
    torch.autograd.grad(fm.fused_moe(*leaves, ids, backward="sorted"), leaves, dy)  # compile and tune
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fm.fused_moe(*leaves, ids, backward="sorted")
        grads = torch.autograd.grad(y, leaves, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_ref = fm.fused_moe_ref(*leaves, ids)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    assert_rel_norm(y.float(), y_ref.float(), MOE_REL_NORM, "y")
    for name, g, g_ref in zip(("x", "w13", "w2", "topk_weights"), grads, grads_ref):
        assert_rel_norm(g.float(), g_ref.float(), MOE_REL_NORM, f"grad {name}")


def test_gpu_bf16_no_host_sync():
    """bf16 on the GPU vs the reference, with CUDA sync debug mode making any sync an error."""
    (x, w13, w2, tw), ids, dy = make_inputs(T=300, C=256, F=128, E=16, K=4, dtype=torch.bfloat16, seed=4)
    leaves = [t.detach().cuda().requires_grad_() for t in (x, w13, w2, tw)]
    ids, dy = ids.cuda(), dy.cuda()
    fm.fused_moe(*leaves, ids)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fm.fused_moe(*leaves, ids)
        grads = torch.autograd.grad(y, leaves, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_ref = fm.fused_moe_ref(*leaves, ids)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    torch.testing.assert_close(y, y_ref, **tol(torch.bfloat16))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **tol(torch.bfloat16))


GPU_ALIGN_CASES = ALIGN_CASES + [("largest_kernel_tile_N8192", 1024, 128, 8, 16, None)]


@pytest.mark.parametrize("case", GPU_ALIGN_CASES, ids=[c[0] for c in GPU_ALIGN_CASES])
def test_moe_align_kernel_equals_torch_version(case):
    _, T, E, K, block_m, experts = case
    _, ids = make_routing(T, E, K, torch.Generator().manual_seed(T + E), experts)
    got, want = moe_align(ids.to(DEVICE), E, block_m), moe_align_ref(ids.to(DEVICE), E, block_m)
    assert KERNEL_STATE.error is None, f"the kernel did not run: {KERNEL_STATE.error}"
    for field in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded", "expert_offsets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_moe_align_replays_in_a_cuda_graph():
    """Graph-safe: captured once on a static ids buffer, replayed for new routings."""
    T, E, K, block_m = 64, 128, 8, 16
    ids = torch.zeros(T, K, dtype=torch.int64, device=DEVICE)
    moe_align(ids, E, block_m)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_align(ids, E, block_m)
    assert KERNEL_STATE.error is None, f"the kernel did not run: {KERNEL_STATE.error}"
    for seed in range(3):
        _, new_ids = make_routing(T, E, K, torch.Generator().manual_seed(seed))
        ids.copy_(new_ids)
        graph.replay()
        want = moe_align_ref(ids, E, block_m)
        assert torch.equal(captured.sorted_token_ids, want.sorted_token_ids)
        assert torch.equal(captured.expert_ids, want.expert_ids)


# ----------------------------------------------------------------------------- fused norms

def _assert_rounded_once(got: torch.Tensor, want32: torch.Tensor, name: str) -> None:
    """bf16 output of fp32 math: one rounding (2^-9 relative) plus fp32 reassociation."""
    assert_decode_close(got, want32.double(), torch.bfloat16, name)


def test_fused_norms_bf16_parity():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    randn = lambda *s: torch.randn(*s, device=DEVICE, generator=g).to(torch.bfloat16)  # noqa: E731
    eps = 1e-6
    x, res, w = randn(37, 1000) * 3, randn(37, 1000), randn(1000)

    def norm32(t):
        t = t.float()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    _assert_rounded_once(fn.rms_norm(x, w, eps), norm32(x), "rms_norm")
    want_res = (x.float() + res.float()).to(torch.bfloat16)
    out = fn.fused_add_rms_norm(x, res, w, eps)
    assert torch.equal(res, want_res), "residual += x must round once, like the torch model"
    _assert_rounded_once(out, norm32(want_res), "fused_add_rms_norm")
    gu = randn(29, 2 * 1100)
    _assert_rounded_once(fn.silu_and_mul(gu), F.silu(gu[:, :1100].float()) * gu[:, 1100:].float(), "silu_and_mul")
    T, H, Hkv, D = 23, 16, 8, 128
    qkv, qw, kw = randn(T, (H + 2 * Hkv) * D), randn(D), randn(D)
    cs = _rope_table(4096, D)
    pos = torch.randint(0, 4096, (T,), device=DEVICE, generator=g)
    q, k = fn.qk_norm_rope(qkv, qw, kw, cs, pos, H, Hkv, eps)
    for name, got, part, wt in (("q", q, qkv[:, :H * D].view(T, H, D), qw),
                                ("k", k, qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), kw)):
        _assert_rounded_once(got, _norm_rope32(part, wt, cs, pos, eps), f"qk_norm_rope {name}")
    k_cache, v_cache = randn(7, 16, Hkv, D), randn(7, 16, Hkv, D)
    slots = torch.randperm(7 * 16, device=DEVICE, generator=g)[:T]
    slots[3] = -1
    ref_k, ref_v = store_kvcache_ref(k, qkv[:, (H + Hkv) * D:].view(T, Hkv, D), k_cache, v_cache, slots)
    q2, k2 = fn.qk_norm_rope(qkv, qw, kw, cs, pos, H, Hkv, eps, kv_cache=(k_cache, v_cache, slots))
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _rope_table(max_pos, D, theta=1e6):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    emb = torch.outer(torch.arange(max_pos, device=DEVICE).float(), inv).repeat(1, 2)
    return torch.stack([emb.cos(), emb.sin()]).contiguous()


def _norm_rope32(x_THD, w, cs, pos, eps):
    x = x_THD.float()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    cos, sin = cs[0, pos][:, None], cs[1, pos][:, None]
    half = n.shape[-1] // 2
    rot = torch.cat([-n[..., half:], n[..., :half]], dim=-1)
    return n * cos + rot * sin


def test_fused_norms_past_int32_offsets():
    """Activations of > 2^31 elements: the last rows (offsets past 2^31) against fp32 math."""
    eps, C = 1e-6, 4096
    rows = -(-BIG // C)
    x = torch.zeros(rows, C, device=DEVICE, dtype=torch.bfloat16)
    x[-8:] = torch.randn(8, C, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(C, device=DEVICE).to(torch.bfloat16)
    ref = lambda t: t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()  # noqa: E731
    _assert_rounded_once(fn.rms_norm(x, w, eps)[-8:], ref(x[-8:]), "rms_norm")
    _assert_rounded_once(fn.silu_and_mul(x)[-8:], F.silu(x[-8:, :C // 2].float()) * x[-8:, C // 2:].float(),
                         "silu_and_mul")
    res = x.clone()
    out = fn.fused_add_rms_norm(x, res, w, eps)
    assert torch.equal(res[-8:], (2 * x[-8:].float()).to(torch.bfloat16))
    _assert_rounded_once(out[-8:], ref(res[-8:]), "fused_add_rms_norm")
    del out, res
    H, Hkv, D = 16, 8, 128
    T = -(-BIG // ((H + 2 * Hkv) * D))
    qkv = x.view(-1)[: T * (H + 2 * Hkv) * D].view(T, (H + 2 * Hkv) * D)
    qkv[-8:] = torch.randn(8, qkv.shape[1], device=DEVICE).to(torch.bfloat16)
    cs = _rope_table(4096, D)
    pos = torch.arange(T, device=DEVICE) % 4096
    q, k = fn.qk_norm_rope(qkv, w[:D], w[D:2 * D], cs, pos, H, Hkv, eps)
    tail = qkv[-8:]
    _assert_rounded_once(q[-8:], _norm_rope32(tail[:, :H * D].view(8, H, D), w[:D], cs, pos[-8:], eps), "q")
    _assert_rounded_once(k[-8:], _norm_rope32(tail[:, H * D:(H + Hkv) * D].view(8, Hkv, D), w[D:2 * D], cs,
                                              pos[-8:], eps), "k")
