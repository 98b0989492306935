"""Shared-prefix (cascade) decode cases shared by the C++ kernel's tests (tests/csrc) and the Triton
kernel's (tests/kernels).

make_group_batch builds GRPO-like batches: each group's members list the same prefix blocks (whole
pages of one prompt's K/V) and then their own pages, in a fragmented cache whose unused slots hold
NaN. The result is a PagedBatch over the full page tables, so paged_decode_ref and fp64 SDPA on the
contiguous sequences (check_against_references) are the references; cascade_tables runs the
engine's own planner (rlengine/engine/attention/cascade.py) on those tables to get the kernels'
inputs, so the planner is covered by every kernel case too.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention.cascade import CascadePlan, plan_cascade

from tests.support.paged_decode_cases import PagedBatch


def make_group_batch(groups, H, Hkv, D, P, dtype, seed=0, q_scale=1.0) -> PagedBatch:
    """groups: (prefix pages, [each member's own token count >= 1]) per group, rows in that order.
    q_scale > 1 sharpens the softmax until the log-sum-exps pass the fp32 exp range (~88)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    rows = [(g, n) for g, (_, own) in enumerate(groups) for n in own]
    num_blocks = sum(pre for pre, _ in groups) + sum(-(-n // P) for _, n in rows) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.full((num_blocks, P, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    prefix = []
    for pre, _ in groups:
        blocks = [free.pop() for _ in range(pre)]
        k, v = rand(pre * P, Hkv, D), rand(pre * P, Hkv, D)
        for i, blk in enumerate(blocks):
            k_cache[blk], v_cache[blk] = k[i * P:(i + 1) * P], v[i * P:(i + 1) * P]
        prefix.append((blocks, k, v))
    k_seqs, v_seqs, indptr, indices, last = [], [], [0], [], []
    for g, n in rows:
        blocks, k_pre, v_pre = prefix[g]
        own = [free.pop() for _ in range(-(-n // P))]
        k, v = rand(n, Hkv, D), rand(n, Hkv, D)
        for i, blk in enumerate(own):
            t = slice(i * P, min(n, (i + 1) * P))
            k_cache[blk, :t.stop - t.start], v_cache[blk, :t.stop - t.start] = k[t], v[t]
        k_seqs.append(torch.cat([k_pre, k]))
        v_seqs.append(torch.cat([v_pre, v]))
        indices += blocks + own
        indptr.append(len(indices))
        last.append(n - (len(own) - 1) * P)
    q = (torch.randn(len(rows), H, D, generator=gen) * q_scale).to(dtype)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return PagedBatch(q=q, k_seqs=k_seqs, v_seqs=v_seqs, k_cache=k_cache, v_cache=v_cache, kv_indptr=i32(indptr),
                      kv_indices=i32(indices), kv_last_page_len=i32(last),
                      max_num_pages=max(b - a for a, b in zip(indptr, indptr[1:])))


def cascade_tables(batch: PagedBatch, max_rows: int = 64) -> tuple[CascadePlan, tuple[torch.Tensor, ...]]:
    """The planner's view of the batch and the kernels' table arguments: chunk_indptr, prefix_indptr,
    prefix_indices, suffix kv_indptr, suffix kv_indices, kv_last_page_len."""
    plan = plan_cascade(batch.kv_indptr.numpy(), batch.kv_indices.numpy(), max_rows)
    assert plan is not None, "the case has no shared page"
    arrays = (plan.chunk_indptr, plan.prefix_indptr, plan.prefix_indices, plan.suffix_indptr, plan.suffix_indices)
    return plan, tuple(torch.from_numpy(a) for a in arrays) + (batch.kv_last_page_len,)


# (id naming the path, groups, H, Hkv, D, P, max_rows)
CASCADE_CASES = [
    ("one-group-g4-gqa2", [(3, [1, 5, 8, 2])], 4, 2, 64, 8, 64),
    ("groups-and-singletons", [(2, [3, 9]), (0, [7]), (4, [1, 1, 16, 4, 6])], 8, 2, 64, 8, 64),
    ("group-cut-into-chunks", [(2, [2, 3, 4, 5, 6])], 4, 1, 64, 16, 2),
    ("gqa1-d128-p16", [(5, [17, 1, 30])], 2, 2, 128, 16, 64),
    ("gqa8-long-prefix", [(16, [4, 12])], 8, 1, 64, 8, 64),
]
