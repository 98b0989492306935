"""Paged decode attention, the C++ CPU kernel (csrc/paged_decode.cpp), against two references.

Every GQA ratio x head dim x page size on the cases of tests/support/paged_decode_cases.py (ragged
sequences in a fragmented paged cache, NaN outside every context, NaN-poisoned output), compared with
paged_decode_ref (gather + SDPA) and with plain SDPA in fp64 on the contiguous sequences; bad inputs
and bad page tables name the tensor at fault. The Triton kernel's tests are in
tests/kernels/test_paged_decode.py.
"""

import pytest
import torch

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)

from tests.support.paged_decode_cases import bad_inputs, check_against_references, make_batch


def paged_decode_cpp(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale, out=None):
    """The C++ CPU paged decode op (csrc/paged_decode.cpp) with an allocated output, as the cpp backend calls it."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.rlengine.paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, float(sm_scale), out)
    return out


# C++ kernel: every GQA ratio x head dim x page size, contexts 1, P, P+1, 2P-1, 97, 300.
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


# The two work layouts: one item per sequence (every KV head over whole pages) when the items outnumber
# the threads four to one or the step runs on one thread, else one per (sequence, KV head). Same result.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_per_sequence_and_per_head_items_agree(dtype):
    batch = make_batch([1, 16, 17, 97, 300, 64], 8, 2, 128, 16, dtype, seed=11)  # > 2^20 multiply-adds
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # 6 sequences: >= 4 per thread on one thread, < 4 per thread on two
            torch.set_num_threads(n)
            outs.append(paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=0.1))
            check_against_references(outs[-1], batch, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])  # every row: the same pages in the same order


# Head dims off the 16-lane tiles (40, 24): the portable loops, which AVX-512 builds keep for these.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [40, 24], ids=lambda d: f"D{d}")
def test_cpp_head_dim_off_the_vector_width(D, dtype):
    batch = make_batch([1, 16, 17, 97], 4, 2, D, 16, dtype, seed=D)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, *batch.tables(), sm_scale=D**-0.5, out=out)
    check_against_references(out, batch, D**-0.5)


def test_cpp_strided_q_and_allocated_out():
    H, Hkv, D, P = 8, 2, 64, 16
    batch = make_batch([5, 40, 16], H, Hkv, D, P, torch.bfloat16, seed=3)
    qkv = torch.randn(3, H + 2 * Hkv, D).to(torch.bfloat16)
    qkv[:, :H] = batch.q
    batch.q = qkv[:, :H]
    check_against_references(paged_decode_cpp(batch.q, batch.k_cache, batch.v_cache, *batch.tables(),
                                              sm_scale=0.2), batch, 0.2)


@pytest.mark.parametrize("bad", bad_inputs(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_cpp_rejects_bad_input(bad):
    _, args, msg = bad
    with pytest.raises(RuntimeError, match=msg):
        paged_decode_cpp(**args, sm_scale=0.1)


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
