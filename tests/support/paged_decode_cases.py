"""Paged decode test cases shared by the Triton kernel's tests (tests/kernels), the C++ kernel's
(tests/csrc), the planted-bug controls and the GPU tier.

make_batch builds ragged sequences with contiguous K/V and scatters them into pages of a shared cache
through a shuffled (fragmented) block table; cache slots outside every context hold NaN, so stray reads
show. check_against_references compares a kernel's output with paged_decode_ref (gather + SDPA) and
with plain SDPA in fp64 on the contiguous sequences, so the paged reference is itself checked.
needle_case() puts almost all attention mass on one token (the last one, or one at a split boundary),
so a kernel that drops that token fails by a wide margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlengine.kernels.paged_decode import paged_decode, paged_decode_ref

from tests.support.kernel_checks import plant_needle
from tests.support.tolerances import tol


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


def needle_case(where: str, dtype, device="cpu", D=64, P=16, ctx=2049, decode=paged_decode):
    """(batch, out) with the needle of sequence 0 (ctx tokens, 4 splits) at its last token or at the
    first token of split 1, and a second, short sequence with its needle last. `decode` is
    paged_decode or a planted-bug copy of it (tests/kernels/test_planted_bugs.py)."""
    num_splits = 4
    pages = -(-ctx // P)
    pos = ctx - 1 if where == "last" else -(-pages // num_splits) * P
    batch = make_batch([ctx, 37], 4, 2, D, P, dtype, seed=9, needles=[(0, pos), (1, 36)]).to(device)
    out = torch.full_like(batch.q, float("nan"))
    decode(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5,
           max_num_pages=batch.max_num_pages, out=out, num_splits=num_splits)
    return batch, out


# Bad input: each mutation names the tensor at fault in the error.
def bad_inputs():
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
