"""Block-aligned sort of routed (token, slot) pairs by expert, on the device, with no host sync.

Sits between routing (topk_ids from the model) and the grouped GEMMs in fused_moe.py: every
GEMM there walks `sorted_token_ids` in blocks of `block_m` rows that all belong to one expert,
gathering activation rows by index instead of copying them into a padded buffer.
moe_align() is ONE Triton program (like vLLM's moe_align_block_size): it sorts the N keys
expert * N_BLOCK + pair in registers (so the order within an expert is the pair order), counts
pairs per expert with a histogram, prefix-sums the padded counts, and scatters; one launch and one
allocation per MoE layer, where the torch version (moe_align_ref, the oracle) is ~30 small ops
(~1,700 CUDA-graph nodes per decode step of Qwen3-30B-A3B). Above MAX_KERNEL_PAIRS pairs (training
batches) the whole key set no longer fits one program's registers and the torch version runs:
there its ops are noise next to the expert GEMMs.
Simplification: the buffers are sized for the worst case from shapes alone (no .item()), so a
few trailing blocks are unused; kernels skip them because their expert id is -1.

Dimensions: T tokens, K experts per token, E experts, N = T*K routed pairs. Pair p = t*K + k.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from rlengine.kernels._triton import tl, triton

MAX_KERNEL_PAIRS = 8192  # N_BLOCK keys per program: 32 int32 registers per thread at 8 warps


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, offsets_ptr, ntpp_ptr, shift_ptr,
                      N, E, block_m, n_pad, n_blocks,
                      N_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """Single program. Pair ids of sorted position j: dest = j + (padded_start[e] - start[e])."""
    # 1. every row is padding (sentinel N) and every block unused (-1) until written below
    for i in range(0, n_pad, FILL_BLOCK):
        offs = i + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_ids_ptr + offs, tl.zeros([FILL_BLOCK], tl.int32) + N, mask=offs < n_pad)
    for i in range(0, n_blocks, FILL_BLOCK):
        offs = i + tl.arange(0, FILL_BLOCK)
        tl.store(expert_ids_ptr + offs, tl.zeros([FILL_BLOCK], tl.int32) - 1, mask=offs < n_blocks)
    # 2. sort keys expert * N_BLOCK + pair; tile slots past N get expert E and sort last
    j = tl.arange(0, N_BLOCK)
    real = j < N
    e = tl.load(ids_ptr + j, mask=real, other=E).to(tl.int32)
    key = tl.sort(e * N_BLOCK + j)
    e_sorted = key // N_BLOCK
    pair_sorted = key % N_BLOCK
    # 3. counts, padded segment offsets, and the shift from unpadded to padded position
    bins = tl.arange(0, E_BLOCK)
    is_expert = bins < E
    counts = tl.where(is_expert, tl.histogram(e, E_BLOCK), 0)  # bin E holds the tile padding
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, 0)
    tl.store(offsets_ptr + 1 + bins, padded_end, mask=is_expert)
    tl.store(offsets_ptr + bins, tl.zeros([E_BLOCK], tl.int32), mask=bins == 0)
    tl.store(ntpp_ptr + bins, tl.zeros([E_BLOCK], tl.int32) + tl.sum(padded, 0), mask=bins == 0)
    tl.store(shift_ptr + bins, (padded_end - padded) - (tl.cumsum(counts, 0) - counts), mask=is_expert)
    # the fills of step 1 and the shifts must land before step 4 reads and overwrites them
    tl.debug_barrier()
    # 4. scatter: every used block holds >= 1 real pair, so each gets its expert id
    dest = j + tl.load(shift_ptr + e_sorted, mask=real, other=0)
    tl.store(sorted_ids_ptr + dest, pair_sorted, mask=real)
    tl.store(expert_ids_ptr + dest // block_m, e_sorted, mask=real)


# Under TRITON_INTERPRET=1 the kernel also runs on CPU tensors (tests).
_INTERPRETED = not isinstance(_moe_align_kernel, triton.runtime.JITFunction)


@dataclass(slots=True)
class _KernelState:
    """Whether the kernel compiled: the first failure is kept and reported once, then every call
    takes moe_align_ref (sync-free and graph-safe too). The GPU tests assert error is None."""

    error: str | None = None


KERNEL_STATE = _KernelState()


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


def _check(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids_TK must be 2-D [T, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids_TK must be int64 or int32, got {topk_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")


def moe_align(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the T*K routed pairs by expert into block_m-aligned segments, without host sync.

    topk_ids_TK: [T, K] integer expert ids in [0, num_experts), not checked (that would need a
    sync; the router's top-k guarantees it). One Triton launch and one int32 allocation on
    topk_ids' device when N <= MAX_KERNEL_PAIRS, else moe_align_ref. CUDA, or CPU under
    TRITON_INTERPRET=1; other CPU tensors take moe_align_ref, and so does every call after the
    kernel once failed to compile (KERNEL_STATE). Graph-safe: sizes depend on shapes only.
    """
    _check(topk_ids_TK, num_experts, block_m)
    N = topk_ids_TK.numel()
    if N == 0 or N > MAX_KERNEL_PAIRS or not (topk_ids_TK.is_cuda or _INTERPRETED) or KERNEL_STATE.error:
        return moe_align_ref(topk_ids_TK, num_experts, block_m)
    n_pad = max_padded_rows(N, num_experts, block_m)
    n_blocks = n_pad // block_m
    buf = torch.empty(n_pad + n_blocks + 1 + (num_experts + 1) + num_experts, dtype=torch.int32,
                      device=topk_ids_TK.device)
    sorted_ids, expert_ids, ntpp, offsets, shift = buf.split([n_pad, n_blocks, 1, num_experts + 1, num_experts])
    n_block = max(16, triton.next_power_of_2(N))
    try:
        _moe_align_kernel[(1,)](topk_ids_TK.reshape(-1), sorted_ids, expert_ids, offsets, ntpp, shift,
                                N, num_experts, block_m, n_pad, n_blocks,
                                N_BLOCK=n_block, E_BLOCK=triton.next_power_of_2(num_experts + 1), FILL_BLOCK=1024,
                                num_warps=4 if n_block <= 1024 else 8)
    except Exception as exc:  # noqa: BLE001 - a compiler failure must not take the MoE layer down
        KERNEL_STATE.error = f"{type(exc).__name__}: {exc}"
        print(f"rlengine: the moe_align kernel failed ({KERNEL_STATE.error[:300]}); using moe_align_ref "
              "from now on", file=sys.stderr)
        return moe_align_ref(topk_ids_TK, num_experts, block_m)
    return MoEAlignment(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=ntpp,
                        expert_offsets=offsets, block_m=block_m, num_pairs=N)


def moe_align_ref(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """The torch version (oracle, and the path above MAX_KERNEL_PAIRS): same result as moe_align.

    Ids out of range fail in the index ops below (CPU error, CUDA device assert). No host sync;
    allocates O(N + E) int tensors on topk_ids' device.
    """
    _check(topk_ids_TK, num_experts, block_m)
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
