"""Paged decode attention: Triton split-KV kernel and C++ CPU kernel against two references.

Every case builds ragged sequences with contiguous K/V, scatters them into pages of a shared
cache through a shuffled (fragmented) block table, and compares each kernel with
paged_decode_ref (gather + SDPA) and with plain SDPA in fp64 on the contiguous sequences, so
the paged reference is itself checked. Cache slots outside every context hold NaN, and outputs
and split buffers are NaN-poisoned before a kernel runs, so stray reads and unwritten elements
both show. Triton runs under TRITON_INTERPRET=1 here: tiny shapes, fp32/fp16 only; its output
must also meet the GPU tier's bound (tests/kernel_checks.py: 2^-8 |ref| + 1e-5 for 16-bit, fp64
reference). needle_case() puts almost all attention mass on one token (the last one, or one at a
split boundary), so a kernel that drops that token fails by a wide margin; it runs here through
tests/test_k13_injected_bugs.py (unchanged kernel passes, planted bugs fail) and on the GPU tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import tol
from kernel_checks import assert_decode_close, plant_needle

from rlengine import _ext
from rlengine.kernels import paged_decode as pd
from rlengine.kernels.paged_decode import alloc_workspace, paged_decode, paged_decode_ref

needs_cpp = pytest.mark.skipif(not _ext.has_op("paged_decode"), reason="C++ extension without paged_decode")


def paged_decode_cpp(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale, out=None):
    """The C++ CPU paged decode op (csrc/paged_decode.cpp) with an allocated output, as the cpp backend calls it."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.rlengine.paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, float(sm_scale), out)
    return out


@dataclass
class PagedBatch:
    """Ragged decode batch: contiguous K/V per sequence and the same K/V in a fragmented paged cache."""

    q: torch.Tensor                 # [B, H, D]
    k_seqs: list[torch.Tensor]      # B x [ctx_b, Hkv, D]
    v_seqs: list[torch.Tensor]      # B x [ctx_b, Hkv, D]
    k_cache: torch.Tensor           # [num_blocks, P, Hkv, D]; NaN outside every context
    v_cache: torch.Tensor           # [num_blocks, P, Hkv, D]
    kv_indptr: torch.Tensor         # [B+1] int32
    kv_indices: torch.Tensor        # [kv_indptr[-1]] int32, shuffled block ids
    kv_last_page_len: torch.Tensor  # [B] int32
    max_num_pages: int

    def tables(self):
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def to(self, device) -> "PagedBatch":
        move = lambda t: t.to(device)  # noqa: E731
        return PagedBatch(q=move(self.q), k_seqs=[move(k) for k in self.k_seqs],
                          v_seqs=[move(v) for v in self.v_seqs], k_cache=move(self.k_cache),
                          v_cache=move(self.v_cache), kv_indptr=move(self.kv_indptr),
                          kv_indices=move(self.kv_indices), kv_last_page_len=move(self.kv_last_page_len),
                          max_num_pages=self.max_num_pages)


def make_batch(ctx_lens, H, Hkv, D, P, dtype, seed=0, spare_blocks=3, needles=()) -> PagedBatch:
    """needles: (sequence, position) pairs whose token gets ~all the attention mass (plant_needle)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q = rand(len(ctx_lens), H, D)
    k_seqs = [rand(n, Hkv, D) for n in ctx_lens]
    v_seqs = [rand(n, Hkv, D) for n in ctx_lens]
    for b, pos in needles:
        plant_needle(q, k_seqs[b], v_seqs[b], b, pos)
    num_pages = [-(-n // P) for n in ctx_lens]
    num_blocks = sum(num_pages) + spare_blocks
    k_cache = torch.full((num_blocks, P, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, P, Hkv, D), float("nan"), dtype=dtype)
    block_ids = torch.randperm(num_blocks, generator=gen)[: sum(num_pages)]  # fragmented, any order
    indptr = [0]
    for n_pages in num_pages:
        indptr.append(indptr[-1] + n_pages)
    for b, n in enumerate(ctx_lens):
        for i, blk in enumerate(block_ids[indptr[b]:indptr[b + 1]].tolist()):
            rows = slice(i * P, min(n, (i + 1) * P))
            k_cache[blk, : rows.stop - rows.start] = k_seqs[b][rows]
            v_cache[blk, : rows.stop - rows.start] = v_seqs[b][rows]
    return PagedBatch(
        q=q, k_seqs=k_seqs, v_seqs=v_seqs, k_cache=k_cache, v_cache=v_cache,
        kv_indptr=torch.tensor(indptr, dtype=torch.int32),
        kv_indices=block_ids.to(torch.int32),
        kv_last_page_len=torch.tensor([n - (p - 1) * P for n, p in zip(ctx_lens, num_pages)], dtype=torch.int32),
        max_num_pages=max(num_pages),
    )


def contiguous_sdpa(batch: PagedBatch, sm_scale: float) -> torch.Tensor:
    """Plain SDPA in fp64 on each sequence's contiguous K/V: [B, H, D] fp64."""
    B, H, _ = batch.q.shape
    outs = []
    for b in range(B):
        k = batch.k_seqs[b].double().transpose(0, 1)                 # [Hkv, ctx, D]
        v = batch.v_seqs[b].double().transpose(0, 1)
        G = H // k.shape[0]
        q = batch.q[b].double().unsqueeze(1)                         # [H, 1, D]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 0), v.repeat_interleave(G, 0), scale=sm_scale)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


def check_against_references(out: torch.Tensor, batch: PagedBatch, sm_scale: float) -> None:
    dtype = batch.q.dtype
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert not out.isnan().any(), "unwritten or NaN-contaminated output elements"
    ref = paged_decode_ref(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=sm_scale)
    torch.testing.assert_close(out, ref, **tol(dtype))
    # The paged reference and the kernels must both match attention over the contiguous sequences.
    truth = contiguous_sdpa(batch, sm_scale).to(dtype)
    torch.testing.assert_close(ref, truth, **tol(dtype))
    torch.testing.assert_close(out, truth, **tol(dtype))


# (id naming the path, ctx_lens, H, Hkv, D, P, num_splits); tiny for the Triton interpreter.
# num_splits=1 is the one-launch path (no merge kernel).
TRITON_CASES = [
    ("ctx1-single-token-gqa1", [1], 2, 2, 64, 8, 1),
    ("ragged-one-split-direct-gqa4", [3, 40, 17], 8, 2, 64, 16, 1),
    ("head-dim-8-padded-to-block-d-16", [19, 40], 4, 2, 8, 8, 2),
    ("ctx-exactly-one-block-gqa2", [16, 16], 4, 2, 64, 16, 1),
    ("crossing-block-boundaries-gqa4-d128", [17, 33, 5], 4, 1, 128, 16, 2),
    ("odd-lengths-gqa8-p8-3splits", [47, 9, 1, 23], 8, 1, 64, 8, 3),
    ("more-splits-than-pages-p32", [40, 3], 4, 2, 64, 32, 5),
    ("uneven-splits-last-empty", [70], 2, 1, 64, 8, 4),
    ("heuristic-splits-gqa2-d128-p32", [65, 30], 4, 2, 128, 32, None),
]


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


def needle_case(where: str, dtype, device="cpu", D=64, P=16, ctx=2049, decode=paged_decode):
    """(batch, out) with the needle of sequence 0 (ctx tokens, 4 splits) at its last token or at the
    first token of split 1, and a second, short sequence with its needle last. `decode` is
    paged_decode or a planted-bug copy of it (tests/test_k13_injected_bugs.py)."""
    num_splits = 4
    pages = -(-ctx // P)
    pos = ctx - 1 if where == "last" else -(-pages // num_splits) * P
    batch = make_batch([ctx, 37], 4, 2, D, P, dtype, seed=9, needles=[(0, pos), (1, 36)]).to(device)
    out = torch.full_like(batch.q, float("nan"))
    decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5,
           max_num_pages=batch.max_num_pages, out=out, num_splits=num_splits)
    return batch, out


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


# C++ kernel: every GQA ratio x head dim x page size, contexts 1, P, P+1, 2P-1, 97, 300.
@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("P", [8, 16, 32], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("gqa", [1, 2, 4, 8], ids=lambda g: f"gqa{g}")
def test_cpp_matches_references(gqa, D, P, dtype):
    Hkv = 2
    batch = make_batch([1, P, P + 1, 2 * P - 1, 97, 300], gqa * Hkv, Hkv, D, P, dtype, seed=gqa * 1000 + D + P)
    out = torch.full_like(batch.q, float("nan"))
    result = paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5, out=out)
    assert result is out
    check_against_references(out, batch, D**-0.5)


@needs_cpp
def test_cpp_strided_q_and_allocated_out():
    H, Hkv, D, P = 8, 2, 64, 16
    batch = make_batch([5, 40, 16], H, Hkv, D, P, torch.bfloat16, seed=3)
    qkv = torch.randn(3, H + 2 * Hkv, D).to(torch.bfloat16)
    qkv[:, :H] = batch.q
    batch.q = qkv[:, :H]
    check_against_references(paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, *batch.tables(),
                                              sm_scale=0.2), batch, 0.2)


# Bad input: each mutation names the tensor at fault in the error.
def _bad_inputs():
    base = make_batch([5, 9], 4, 2, 64, 8, torch.float32, seed=4)
    args = {"q": base.q, "k_cache": base.k_cache, "v_cache": base.v_cache, "kv_indptr": base.kv_indptr,
            "kv_indices": base.kv_indices, "kv_last_page_len": base.kv_last_page_len}
    return [
        ("indptr-int64", {**args, "kv_indptr": base.kv_indptr.long()}, "kv_indptr"),
        ("indptr-wrong-length", {**args, "kv_indptr": base.kv_indptr[:-1].contiguous()}, "kv_indptr"),
        ("last-len-wrong-length", {**args, "kv_last_page_len": base.kv_last_page_len[:1].contiguous()},
         "kv_last_page_len"),
        ("head-dim-mismatch", {**args, "q": torch.randn(2, 4, 32)}, "head dim"),
        ("heads-not-multiple", {**args, "q": torch.randn(2, 3, 64)}, "multiple"),
        ("cache-dtype", {**args, "v_cache": base.v_cache.half()}, "v_cache"),
    ]


@pytest.mark.parametrize("bad", _bad_inputs(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_triton_rejects_bad_input(bad):
    _, args, msg = bad
    with pytest.raises(ValueError, match=msg):
        paged_decode(**args, sm_scale=0.1, max_num_pages=2)


@needs_cpp
@pytest.mark.parametrize("bad", _bad_inputs(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_cpp_rejects_bad_input(bad):
    _, args, msg = bad
    with pytest.raises(RuntimeError, match=msg):
        paged_decode_cpp(**args, sm_scale=0.1)


@needs_cpp
def test_cpp_rejects_bad_page_tables():
    batch = make_batch([5, 9], 4, 2, 64, 8, torch.float32, seed=5)
    indices = batch.kv_indices.clone()
    indices[1] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"kv_indices\[1\]"):
        paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, batch.kv_indptr, indices, batch.kv_last_page_len,
                         sm_scale=0.1)
    with pytest.raises(RuntimeError, match="kv_last_page_len"):
        paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, batch.kv_indptr, batch.kv_indices,
                         torch.zeros(2, dtype=torch.int32), sm_scale=0.1)


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
