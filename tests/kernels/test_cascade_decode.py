"""Shared-prefix (cascade) decode, the Triton kernels (kernels/cascade_decode.py), against two references.

Under TRITON_INTERPRET=1 (fp32/fp16): the GRPO-like cases of tests/support/cascade_cases.py through the
prefix kernel, paged_decode's split kernel over each row's own pages (1 and several splits) and the
log-sum-exp merge; compared with paged_decode_ref over the full page tables, fp64 SDPA on the contiguous
sequences, and cascade_decode_ref. Outputs and the partial buffers are NaN-poisoned first.
"""

import pytest
import torch

from rlengine.kernels.cascade_decode import alloc_cascade_workspace, cascade_decode, cascade_decode_ref

from tests.support.cascade_cases import CASCADE_CASES, cascade_tables, make_group_batch
from tests.support.kernel_checks import assert_decode_close
from tests.support.paged_decode_cases import check_against_references, contiguous_sdpa


def run_cascade(batch, max_rows, num_splits=None):
    B, H, D = batch.q.shape
    plan, tables = cascade_tables(batch, max_rows)
    ws = alloc_cascade_workspace(B, H, D, "cpu")
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    out = torch.full_like(batch.q, float("nan"))
    own = plan.suffix_indptr[1:] - plan.suffix_indptr[:-1]
    cascade_decode(batch.q, batch.k_cache, batch.v_cache, *tables, sm_scale=D**-0.5, max_rows=plan.max_rows,
                   max_suffix_pages=int(own.max()), workspace=ws, out=out, num_splits=num_splits)
    return out, tables


@pytest.mark.parametrize("num_splits", [1, 3], ids=["suffix-1-split", "suffix-3-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c[0] for c in CASCADE_CASES])
def test_triton_cascade_matches_references(case, dtype, num_splits):
    _, groups, H, Hkv, D, P, max_rows = case
    batch = make_group_batch(groups, H, Hkv, D, P, dtype, seed=len(groups) * 7 + D)
    out, tables = run_cascade(batch, max_rows, num_splits)
    check_against_references(out, batch, D**-0.5)
    assert_decode_close(out, contiguous_sdpa(batch, D**-0.5), dtype)
    torch.testing.assert_close(cascade_decode_ref(batch.q, batch.k_cache, batch.v_cache, *tables, sm_scale=D**-0.5),
                               out, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)


def test_triton_cascade_sharp_softmax():
    """Log-sum-exps past fp32's exp range: only a max-subtracted merge stays finite."""
    batch = make_group_batch([(4, [3, 11, 6])], 4, 2, 64, 8, torch.float32, seed=1, q_scale=50.0)
    out, _ = run_cascade(batch, 64)
    check_against_references(out, batch, 64**-0.5)


def test_triton_cascade_rejects_too_many_rows():
    batch = make_group_batch([(2, [3, 4])], 4, 2, 64, 8, torch.float32, seed=3)
    plan, tables = cascade_tables(batch)
    with pytest.raises(ValueError, match="max_rows"):
        cascade_decode(batch.q, batch.k_cache, batch.v_cache, *tables, sm_scale=0.1, max_rows=64,
                       max_suffix_pages=1, workspace=alloc_cascade_workspace(2, 4, 64, "cpu"))
