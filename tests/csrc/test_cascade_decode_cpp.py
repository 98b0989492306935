"""Shared-prefix (cascade) decode, the C++ CPU kernel (csrc/cascade_decode.cpp), against two references.

The cases (tests/support/cascade_cases.py) are GRPO-like batches whose groups list the same prefix
pages; the kernel gets the tables the engine's planner makes of them and is compared with
paged_decode_ref over the full page tables and with fp64 SDPA on the contiguous sequences. Cache
slots outside every context hold NaN and outputs are NaN-poisoned, so stray reads and unwritten
rows show. The "sharp" case pushes the log-sum-exps past fp32's exp range, where a merge that does
not subtract the max overflows; a kernel that drops the suffix level misses every member's own tokens.
"""

import pytest
import torch

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)

from tests.support.cascade_cases import CASCADE_CASES, cascade_tables, make_group_batch
from tests.support.paged_decode_cases import check_against_references


def cascade_cpp(batch, tables, sm_scale):
    B, H, D = batch.q.shape
    out = torch.full_like(batch.q, float("nan"))
    prefix_out = torch.full((B * H * D,), float("nan"))
    prefix_lse = torch.full((B * H,), float("nan"))
    torch.ops.rlengine.cascade_decode(batch.q, batch.k_cache, batch.v_cache, *tables, sm_scale, prefix_out,
                                      prefix_lse, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c[0] for c in CASCADE_CASES])
def test_cascade_cpp_matches_references(case, dtype):
    _, groups, H, Hkv, D, P, max_rows = case
    batch = make_group_batch(groups, H, Hkv, D, P, dtype, seed=len(groups) * 7 + D)
    _, tables = cascade_tables(batch, max_rows)
    check_against_references(cascade_cpp(batch, tables, D**-0.5), batch, D**-0.5)


# The prefix pass's register tiles (csrc/cascade_decode.cpp): query rows in 16-lane blocks (one or two
# per score block), keys in blocks of 8 with a tail, tiles of 64 prefix tokens with a partial last
# tile, output columns in blocks of 64 then 16; D not a multiple of 16 takes the one-row-at-a-time
# path. (id, groups, H, Hkv, D, P)
TILE_CASES = [
    ("rows-13-key-tail-p12", [(6, [3, 17, 1, 2, 5, 9, 4, 1, 8, 2, 3, 6, 7])], 2, 2, 96, 12),
    ("rows-40-two-lane-blocks", [(5, [2 + i % 7 for i in range(20)])], 4, 2, 64, 16),
    ("page-larger-than-tile", [(2, [1, 100, 37])], 8, 4, 32, 128),
    ("d72-row-path", [(3, [4, 9, 2])], 4, 2, 72, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", TILE_CASES, ids=[c[0] for c in TILE_CASES])
def test_cascade_cpp_prefix_tiles(case, dtype):
    _, groups, H, Hkv, D, P = case
    batch = make_group_batch(groups, H, Hkv, D, P, dtype, seed=D + P)
    _, tables = cascade_tables(batch)
    check_against_references(cascade_cpp(batch, tables, D**-0.5), batch, D**-0.5)


def test_cascade_cpp_sharp_softmax_needs_the_max_in_the_merge():
    """Scores ~ 50 sigma: both levels' log-sum-exps exceed 88, so exp(lse) alone overflows fp32."""
    batch = make_group_batch([(4, [3, 11, 6])], 4, 2, 64, 8, torch.float32, seed=1, q_scale=50.0)
    _, tables = cascade_tables(batch)
    check_against_references(cascade_cpp(batch, tables, 64**-0.5), batch, 64**-0.5)


def test_cascade_cpp_equals_plain_decode():
    """The same batch through paged_decode (full tables) and cascade_decode: equal to fp32 rounding."""
    batch = make_group_batch([(6, [5, 1, 9, 16]), (2, [3, 3])], 8, 2, 64, 16, torch.float32, seed=2)
    _, tables = cascade_tables(batch)
    plain = torch.empty_like(batch.q)
    torch.ops.rlengine.paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), 0.125, plain)
    torch.testing.assert_close(cascade_cpp(batch, tables, 0.125), plain, atol=1e-5, rtol=1e-5)


def test_cascade_cpp_rejects_bad_tables():
    batch = make_group_batch([(2, [3, 4])], 4, 2, 64, 8, torch.float32, seed=3)
    _, (chunks, pre_ptr, pre_idx, ptr, idx, last) = cascade_tables(batch)
    bad_prefix = pre_idx.clone()
    bad_prefix[0] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="prefix_indices"):
        cascade_cpp(batch, (chunks, pre_ptr, bad_prefix, ptr, idx, last), 0.1)
    with pytest.raises(RuntimeError, match="chunk_indptr"):
        cascade_cpp(batch, (torch.tensor([0, 1], dtype=torch.int32), pre_ptr[:2].contiguous(), pre_idx, ptr, idx,
                            last), 0.1)
    with pytest.raises(RuntimeError, match="kv_indptr"):
        cascade_cpp(batch, (chunks, pre_ptr, pre_idx, ptr.long(), idx, last), 0.1)
