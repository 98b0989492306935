"""Fused MoE test inputs shared by the kernel tests under the interpreter (tests/kernels/test_fused_moe.py)
and the GPU tier: random routings, leaves with one upstream gradient, and the alignment cases."""

import math

import torch


def make_routing(T, E, K, gen, experts=None):
    """Distinct top-K ids per token drawn from `experts` (default all E), softmax weights."""
    pool = torch.tensor(experts if experts is not None else range(E))
    ids = pool[torch.rand(T, len(pool), generator=gen).argsort(dim=1)[:, :K]].contiguous()
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    return weights, ids


def make_inputs(T, C, F, E, K, dtype, seed, experts=None, ids=None):
    """([x, w13, w2, topk_weights] as dtype leaves that require grad, ids, upstream gradient dy)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen)
    w13 = torch.randn(E, 2 * F, C, generator=gen) / math.sqrt(C)
    w2 = torch.randn(E, C, F, generator=gen) / math.sqrt(F)
    tw, rand_ids = make_routing(T, E, K, gen, experts)
    ids = rand_ids if ids is None else ids
    leaves = [t.to(dtype).requires_grad_() for t in (x, w13, w2, tw)]
    dy = torch.randn(T, C, generator=gen).to(dtype)
    return leaves, ids, dy


ALIGN_CASES = [
    # (id, T, E, K, block_m, experts routed to or None): the path each one covers
    ("decode_T1_E128_K8", 1, 128, 8, 16, None),
    ("decode_T64_E128_K8_bm16", 64, 128, 8, 16, None),
    ("train_T2048_E128_K8_bm64_N16384_torch_path", 2048, 128, 8, 64, None),
    ("N_exactly_pow2_tile_full", 32, 8, 2, 16, None),
    ("single_pair", 1, 1, 1, 16, None),
    ("prime_E_K_eq_E", 9, 7, 7, 4, None),
    ("empty_experts_bm32", 50, 11, 2, 32, [2, 3, 10]),
    ("tile_N1024_bm64", 128, 64, 8, 64, None),  # N_BLOCK 8192 runs on the GPU tier (slow to interpret)
]
