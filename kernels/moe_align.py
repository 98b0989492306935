"""Block-aligned sort of routed (token, slot) pairs by expert, on the device, with no host sync.

Sits between routing (topk_ids from the model) and the grouped GEMMs in fused_moe.py: every
GEMM there walks `sorted_token_ids` in blocks of `block_m` rows that all belong to one expert,
gathering activation rows by index instead of copying them into a padded buffer.
Simplification: the buffers are sized for the worst case from shapes alone (no .item()), so a
few trailing blocks are unused; kernels skip them because their expert id is -1.

Dimensions: T tokens, K experts per token, E experts, N = T*K routed pairs. Pair p = t*K + k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class MoEAlignment:
    """Pairs sorted by expert, each expert's segment padded to a multiple of block_m."""

    sorted_token_ids: torch.Tensor
    """[N_pad_max] int32: pair indices p = t*K + k grouped by expert (stable), padding = N."""
    expert_ids: torch.Tensor
    """[N_pad_max // block_m] int32: the expert of each block of rows, -1 for unused blocks."""
    num_tokens_post_padded: torch.Tensor
    """[1] int32 (device): rows in use, = expert_offsets[E]."""
    expert_offsets: torch.Tensor
    """[E + 1] int32: start of each expert's padded segment in sorted_token_ids."""
    block_m: int
    """Row block size the segments are padded to."""
    num_pairs: int
    """N = T*K, also the sentinel value of padding entries."""


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of sorted_token_ids: N + min(E, N) * (block_m - 1), rounded to block_m.

    At most min(E, N) experts receive pairs and each pads by at most block_m - 1 rows; using
    min(E, N) rather than E keeps decode (T=1, E=128) at a handful of blocks.
    """
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the T*K routed pairs by expert into block_m-aligned segments, without host sync.

    topk_ids_TK: [T, K] integer expert ids in [0, num_experts). Ids out of range are not
    checked (that would need a sync); they fail in the index ops below (CPU error, CUDA
    device assert), never silently. Allocates O(N + E) int tensors on topk_ids' device.
    """
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids_TK must be 2-D [T, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids_TK must be int64 or int32, got {topk_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    device = topk_ids_TK.device
    ids_N = topk_ids_TK.reshape(-1).long()
    N = ids_N.numel()
    # torch.bincount reads max() on the host under CUDA; scatter_add into E bins does not.
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))
    padded_end_E = torch.cumsum((counts_E + block_m - 1) // block_m * block_m, 0)
    offsets_E1 = torch.cat([padded_end_E.new_zeros(1), padded_end_E])
    start_E = torch.cumsum(counts_E, 0) - counts_E  # unpadded start of each expert

    order_N = torch.argsort(ids_N, stable=True)  # pairs grouped by expert, in pair order
    expert_sorted_N = ids_N[order_N]
    rank_N = torch.arange(N, device=device) - start_E[expert_sorted_N]
    dest_N = offsets_E1[expert_sorted_N] + rank_N

    n_pad = max_padded_rows(N, num_experts, block_m)
    sorted_ids = torch.full((n_pad,), N, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest_N, order_N.to(torch.int32))

    block_start = torch.arange(0, n_pad, block_m, device=device)
    # First expert whose padded segment ends after the block start; empty experts have
    # zero-length segments and are stepped over by right=True.
    expert_of_block = torch.searchsorted(padded_end_E, block_start, right=True)
    expert_ids = torch.where(block_start < padded_end_E[-1], expert_of_block, -1).to(torch.int32)
    return MoEAlignment(
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=padded_end_E[-1:].to(torch.int32),
        expert_offsets=offsets_E1.to(torch.int32),
        block_m=block_m,
        num_pairs=N,
    )


def moe_align_block_size(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int):
    """vLLM-style entry: (sorted_token_ids [N_pad_max], expert_ids [N_pad_max // block_m],
    num_tokens_post_padded [1]), all int32 on topk_ids' device, no host sync.
    See moe_align() for the full alignment including per-expert offsets."""
    a = moe_align(topk_ids_TK, num_experts, block_m)
    return a.sorted_token_ids, a.expert_ids, a.num_tokens_post_padded
