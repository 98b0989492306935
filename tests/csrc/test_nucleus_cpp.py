"""The C++ top-p nucleus (csrc/nucleus.cpp) against the torch radix select it replaces on the CPU
(engine/filtering.nucleus_keep) and against the definition by a full sort: the same kept tokens on
flat, peaked and tied rows, targets near 0 and 1, and rows whose whole mass stays below top_p."""

import pytest
import torch

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine)
from rlengine.engine.filtering import nucleus_keep
from tests.engine.test_filtering import _sorted_keep


def _rows(W: int, V: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(W, V, generator=g) * scale
    z[0, : V // 3] = z[0, 0]  # a third of the row tied: the tie group is kept in id order
    if W > 2:
        z[2] = z[2].round()  # a few values, many ties each
    if W > 3:
        z[3, 7::5] = float("-inf")  # excluded tokens (min_p / banned ids)
    return z


@pytest.mark.parametrize("W,V,scale", [(6, 151936, 2.0), (5, 4096, 0.1), (4, 1000, 8.0), (3, 50, 0.0), (4, 333, 30.0)])
def test_nucleus_op_equals_the_torch_radix_select_and_the_sort(W, V, scale):
    z = _rows(W, V, scale, seed=W * V)
    lse = z.logsumexp(dim=-1)
    for top_p in (torch.rand(W, generator=torch.Generator().manual_seed(V)) * 0.98 + 0.01,
                  torch.full((W,), 0.999), torch.full((W,), 1e-3)):
        got = torch.ops.rlengine.nucleus_filter(z, torch.exp(z - lse[:, None]), top_p)
        ref = torch.where(nucleus_keep(z, lse, top_p, compact=True), z, float("-inf"))
        assert torch.equal(got, ref)
        for i in range(W):  # the stable-sort definition (ties: lower id first)
            assert torch.equal(got[i].isfinite(), _sorted_keep(z[i], 0, float(top_p[i]))), (i, float(top_p[i]))


def test_nucleus_op_keeps_a_row_below_its_target_whole_and_names_bad_inputs():
    z = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    p = torch.softmax(z, dim=-1) * 0.5  # half the mass: top_p 0.9 is never reached
    assert torch.equal(torch.ops.rlengine.nucleus_filter(z, p, torch.tensor([0.9])), z)
    with pytest.raises(RuntimeError, match="p must be fp32 of z's shape"):
        torch.ops.rlengine.nucleus_filter(z, p[:, :3], torch.tensor([0.9]))
    with pytest.raises(RuntimeError, match="top_p must be \\[W\\] fp32"):
        torch.ops.rlengine.nucleus_filter(z, p, torch.tensor([0.9, 0.9]))
