"""The top-k / top-p filter (engine/filtering.py) against hand-written definitions, token for token.

filter_logits keeps the CANDIDATES most likely tokens first and, when a nucleus reaches past them,
finds its boundary by mass-weighted radix passes instead of a sort. The references are a plain
Python per-row loop and a stable-sort definition (ties: lower id first); both the CPU's compacted
passes and the device's branch-free masked passes are checked, and the batch-invariant mode must
run the sort-based path unchanged.
"""

import pytest
import torch

from rlengine.engine.sampler import filter_logits


def _filter_ref(z_V: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """One row, plain Python: top-k, renormalise, keep the prefix until the mass reaches p."""
    order = sorted(range(z_V.numel()), key=lambda i: -z_V[i].item())
    head = order[:k] if k > 0 else order
    probs = z_V[head].double().softmax(-1).tolist()
    kept, mass = [], 0.0
    for i, pr in zip(head, probs):
        if kept and p < 1.0 and mass >= p:
            break
        kept.append(i)
        mass += pr
    out = torch.full_like(z_V, float("-inf"))
    out[kept] = z_V[kept]
    return out


@pytest.mark.parametrize("V", [50, 300])  # below and above sampler.CANDIDATES: full sort vs candidates first
def test_filter_logits_matches_a_per_row_reference(V):
    gen = torch.Generator().manual_seed(V)
    B = 48
    # peaked rows (nucleus inside the candidates) and flat rows (nucleus wider: the full-sort fallback)
    z = torch.randn(B, V, generator=gen) * torch.tensor([4.0, 0.2]).repeat(B // 2)[:, None]
    top_k = torch.tensor([[-1, 0, 1, 5, 64, 17][i % 6] for i in range(B)])
    top_p = torch.tensor([[1.0, 0.5, 0.9, 0.99, 0.3, 1.0, 0.97, 0.8][i % 8] for i in range(B)])
    out = filter_logits(z, top_k, top_p)
    for i in range(B):
        ref = _filter_ref(z[i], min(int(top_k[i]), V), float(top_p[i]))
        kept = torch.isfinite(ref)
        # the mass test may flip on the last token by rounding (fp32 cumsum vs double): allow one token of slack
        diff = (torch.isfinite(out[i]) != kept).sum().item()
        assert diff <= 1, f"row {i}: k={int(top_k[i])} p={float(top_p[i])} differs in {diff} tokens"
        torch.testing.assert_close(out[i][kept & torch.isfinite(out[i])], z[i][kept & torch.isfinite(out[i])])


def test_filter_logits_masks_exactly():
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0], [0.0, 0.0, 5.0, 1.0, 1.0]])
    out = filter_logits(z, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False, True], [False, False, True, False, False]]
    torch.testing.assert_close(out[torch.isfinite(out)], z[torch.isfinite(out)])
    # k >= V and p = 1 keep everything
    torch.testing.assert_close(filter_logits(z, torch.tensor([9, -1]), torch.tensor([1.0, 1.0])), z)


def _sorted_keep(z_V: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """The sort-based definition by hand: stable descending sort (ties: lower id first), top-k, then the
    prefix whose mass before each token (fp64 cumsum of the fp32 probabilities) is < p; the first always."""
    V = z_V.numel()
    k = V if k <= 0 else min(k, V)
    order = torch.sort(z_V, descending=True, stable=True).indices[:k]
    vals = z_V[order]
    lse = z_V.logsumexp(-1) if k == V else vals.logsumexp(-1)  # as the filter sums: the row's own order
    probs = torch.exp(vals - lse).double()
    n = len(order) if p >= 1.0 else max(1, int(((probs.cumsum(-1) - probs) < p).sum()))
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[:n]] = True
    return keep


# V: inside the candidates / past them / Qwen-like; ties: logits rounded to halves (large tie groups)
@pytest.mark.parametrize("V,ties", [(50, False), (300, False), (3000, False), (300, True), (3000, True)])
@pytest.mark.parametrize("compact", [True, False], ids=["cpu-compacted", "device-masked"])
def test_filter_logits_keeps_the_sort_based_set_exactly(V, ties, compact, monkeypatch):
    """filter_logits (candidates + radix select) == the stable-sort definition, token for token: peaked and
    flat rows, top_p near 0 and 1, top-k with top-p. compact=False runs the GPU's branch-free passes."""
    from rlengine.engine import filtering

    if not compact:  # the device branch of filter_logits (masked passes, no host read), on the CPU
        nk = filtering.nucleus_keep
        monkeypatch.setattr(filtering, "nucleus_keep", lambda z, lse, p, compact: nk(z, lse, p, compact=False))
    gen = torch.Generator().manual_seed(V + ties)
    B = 24
    z = torch.randn(B, V, generator=gen) * torch.tensor([4.0, 0.3, 1.0]).repeat(B // 3)[:, None]
    if ties:
        z = (z * 2).round() / 2
    top_k = torch.tensor([[0, -1, 100, 7, 0, 40][i % 6] for i in range(B)])  # 100: more than CANDIDATES
    top_p = torch.tensor([[0.95, 1e-6, 0.9999, 0.5, 0.8, 1.0, 0.3, 0.99][i % 8] for i in range(B)])
    out = filter_logits(z, top_k, top_p)
    for i in range(B):
        keep = _sorted_keep(z[i], int(top_k[i]), float(top_p[i]))
        if ties and int(top_k[i]) > 0:  # the k-th value's ties: torch.topk's choice; compare values
            assert torch.equal(z[i][out[i].isfinite()].sort().values, z[i][keep].sort().values), f"row {i}"
            continue
        assert torch.equal(out[i].isfinite(), keep), f"row {i}: k={int(top_k[i])} p={float(top_p[i])}"
        assert torch.equal(out[i][keep], z[i][keep])


@pytest.mark.parametrize("compact", [True, False])
def test_radix_nucleus_on_wide_rows_and_tie_groups(compact):
    """nucleus_keep alone (rows with no top-k): a flat row (nucleus of thousands of tokens), a boundary inside
    a tie group (part of it kept, in id order), -inf tokens, a row whose mass stays below top_p."""
    from rlengine.engine.filtering import nucleus_keep

    gen = torch.Generator().manual_seed(5)
    V = 5000
    z = torch.randn(4, V, generator=gen) * torch.tensor([[0.1], [1.0], [1.0], [2.0]])
    z[1, ::3] = 0.25                      # one tie group of ~1667 tokens across the boundary
    z[2, 100:900] = float("-inf")         # excluded tokens (min_p / banned ids)
    top_p = torch.tensor([0.95, 0.6, 0.99, 0.9999999])
    keep = nucleus_keep(z, z.logsumexp(-1), top_p, compact=compact)
    for i in range(4):
        assert torch.equal(keep[i], _sorted_keep(z[i], 0, float(top_p[i]))), f"row {i}"
    tied = z[1] == 0.25
    assert 0 < (keep[1] & tied).sum() < tied.sum(), "the boundary must cut the tie group"
    assert keep[0].sum() > 1000


def test_filter_logits_batch_invariant_mode_is_the_sorted_path():
    z = torch.randn(6, 400, generator=torch.Generator().manual_seed(2))
    k, p = torch.tensor([0, 5, 0, 0, 30, 0]), torch.tensor([0.9, 0.8, 0.3, 1.0, 0.95, 0.99])
    from rlengine.engine.filtering import filter_logits_sorted
    assert torch.equal(filter_logits(z, k, p, invariant=True), filter_logits_sorted(z, k, p, invariant=True))
    assert torch.equal(filter_logits(z, k, p).isfinite(), filter_logits_sorted(z, k, p).isfinite())
