"""Paged decode attention, the Triton split-KV kernel (kernels/paged_decode.py), against two references.

The cases (tests/support/paged_decode_cases.py) hold ragged sequences in a fragmented paged cache;
each output is compared with paged_decode_ref (gather + SDPA) and with plain SDPA in fp64 on the
contiguous sequences. Cache slots outside every context hold NaN, and outputs and split buffers are
NaN-poisoned before the kernel runs, so stray reads and unwritten elements both show. Triton runs
under TRITON_INTERPRET=1 here: tiny shapes, fp32/fp16 only; its output must also meet the GPU tier's
bound (tests/support/kernel_checks.py: 2^-8 |ref| + 1e-5 for 16-bit, fp64 reference). The needle
cases run through tests/kernels/test_planted_bugs.py (unchanged kernel passes, planted bugs fail)
and on the GPU tier. The C++ CPU kernel's tests are in tests/csrc/test_paged_decode_cpp.py.
"""

import pytest
import torch

from rlengine.kernels import paged_decode as pd
from rlengine.kernels.paged_decode import alloc_workspace, paged_decode

from tests.support.kernel_checks import assert_decode_close
from tests.support.paged_decode_cases import (TRITON_CASES, bad_inputs, check_against_references,
                                              contiguous_sdpa, make_batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_matches_references(case, dtype):
    _, ctx_lens, H, Hkv, D, P, num_splits = case
    batch = make_batch(ctx_lens, H, Hkv, D, P, dtype)
    sm_scale = D**-0.5
    out = torch.full_like(batch.q, float("nan"))
    paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=sm_scale,
                 max_num_pages=batch.max_num_pages, out=out, num_splits=num_splits)
    check_against_references(out, batch, sm_scale)
    assert_decode_close(out, contiguous_sdpa(batch, sm_scale), dtype)


def test_one_split_skips_the_merge_launch(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel must not launch with one split")

    monkeypatch.setattr(pd, "_merge_kernel", NoLaunch())
    batch = make_batch([33, 5], 4, 2, 64, 8, torch.float32, seed=8)
    out = paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.125,
                       max_num_pages=batch.max_num_pages, num_splits=1)
    check_against_references(out, batch, 0.125)


def test_workspace_sized_by_what_the_heuristic_can_pick(monkeypatch):
    """num_kv_heads= sizes the flat workspace for max over B of B * S(B) on 132 SMs, not max_batch * MAX_SPLITS."""
    monkeypatch.setattr(pd, "_num_sms", lambda device: 132)
    assert pd.choose_num_splits(1, 4, 4096, 16, "cpu") == pd.MAX_SPLITS == 64   # 2 * 132 / 4 = 66 -> capped
    assert pd.choose_num_splits(1, 8, 4096, 16, "cpu") == 33
    assert pd.choose_num_splits(1, 8, 16, 16, "cpu") == 1                        # 256 tokens: one split
    ws = alloc_workspace(256, 16, 128, pd.MAX_SPLITS, "cpu", num_kv_heads=8)
    assert ws.max_rows == 256 and ws.partial_out.numel() == 256 * 16 * 128
    assert ws.max_splits(1) == pd.MAX_SPLITS and ws.max_splits(8) == 32 and ws.max_splits(256) == 1
    assert alloc_workspace(1, 16, 128, pd.MAX_SPLITS, "cpu", num_kv_heads=8).max_rows == 33
    assert alloc_workspace(4, 16, 128, 8, "cpu").max_rows == 32                 # pinned-S sizing


def test_triton_preallocated_workspace_and_strided_q():
    """Decode hot path: out= and an oversized NaN-poisoned workspace; q a strided view of a fused qkv."""
    H, Hkv, D, P = 4, 2, 64, 8
    batch = make_batch([12, 29, 3], H, Hkv, D, P, torch.float32, seed=1)
    qkv = torch.randn(3, H + 2 * Hkv, D)
    qkv[:, :H] = batch.q
    batch.q = qkv[:, :H]                                             # non-contiguous [B, H, D]
    ws = alloc_workspace(max_batch=8, num_heads=H, head_dim=D, num_splits=4, device="cpu")
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    out = torch.full((3, H, D), float("nan"))
    result = paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.1,
                          max_num_pages=batch.max_num_pages, out=out, workspace=ws, num_splits=3)
    assert result is out
    check_against_references(out, batch, 0.1)


def test_triton_underestimated_max_num_pages_reads_whole_context():
    """max_num_pages only chooses S; each sequence splits its own pages, so a too-small value stays correct."""
    batch = make_batch([60, 7], 2, 1, 64, 8, torch.float32, seed=2)
    out = paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.125,
                       max_num_pages=2, num_splits=2)
    check_against_references(out, batch, 0.125)


@pytest.mark.parametrize("bad", bad_inputs(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_triton_rejects_bad_input(bad):
    _, args, msg = bad
    with pytest.raises(ValueError, match=msg):
        paged_decode(**args, sm_scale=0.1, max_num_pages=2)


def test_triton_rejects_small_workspace():
    """A pinned S the workspace cannot hold is an error; the heuristic S shrinks to fit (down to one
    split, which needs no workspace)."""
    batch = make_batch([5, 9], 4, 2, 64, 8, torch.float32, seed=6)
    ws = alloc_workspace(max_batch=1, num_heads=4, head_dim=64, num_splits=2, device="cpu")
    with pytest.raises(ValueError, match="workspace"):
        paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.1, max_num_pages=2,
                     workspace=ws, num_splits=2)
    out = paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.1, max_num_pages=2,
                       workspace=ws)
    check_against_references(out, batch, 0.1)
    wrong_heads = alloc_workspace(max_batch=4, num_heads=8, head_dim=64, num_splits=2, device="cpu")
    with pytest.raises(ValueError, match="workspace"):
        paged_decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.1, max_num_pages=2,
                     workspace=wrong_heads, num_splits=2)
