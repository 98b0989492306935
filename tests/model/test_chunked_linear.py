"""The "chunked" linear candidate (model/ops.py): torch's GEMM over 2 MiB blocks of the weight's rows, written into
column slices of one output. It must equal one GEMM (the same dot products, fewer columns per call), be offered
only where it applies (>= 16 token rows, a weight of at least two blocks), and run when the kernel choice picks it."""

import pytest
import torch
import torch.nn.functional as F

from rlengine.model import ops
from rlengine.model.kernel_choice import KernelChoices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_linear_equals_one_gemm(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 96, generator=gen).to(dtype)
    w = torch.randn(ops._chunk_rows(torch.empty(0, 96, dtype=dtype)) * 2 + 37, 96, generator=gen).to(dtype)  # a tail block
    with torch.inference_mode():
        got = ops._chunked_linear(x, w)
    ref = x.double() @ w.double().t()
    # fp32: reassociation only; bf16: one rounding of an fp32-accumulated sum
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert got.shape == ref.shape and got.dtype == dtype
    assert ((got.double() - ref).abs() <= bound * ref.abs() + 1e-4 * 96 ** 0.5).all()


def test_chunked_is_offered_where_it_applies_and_runs_when_chosen(monkeypatch):
    w = torch.randn(2 * ops._chunk_rows(torch.empty(0, 64)), 64)
    assert "chunked" not in ops._linear_candidates(torch.randn(8, 64), w)  # decode rows: GEMV kernels
    assert "chunked" not in ops._linear_candidates(torch.randn(32, 64), w[:300])  # one block: nothing to split
    assert "chunked" in ops._linear_candidates(torch.randn(32, 64), w)
    monkeypatch.setattr(ops, "KERNELS", KernelChoices("measure", timer=lambda c: {k: 0.1 if k == "chunked" else 1.0
                                                                                 for k in c}))
    ran = []
    real = ops._chunked_linear
    monkeypatch.setattr(ops, "_chunked_linear", lambda x, w: ran.append(1) or real(x, w))
    x = torch.randn(32, 64)
    with torch.inference_mode():
        got = ops.linear_nograd(x, w)
    assert ops.KERNELS.to_dict()[f"linear/float32/B=32/{w.shape[0]}x64"]["impl"] == "chunked" and ran
    torch.testing.assert_close(got, F.linear(x, w))
