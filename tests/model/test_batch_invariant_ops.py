"""The batch-invariant ops (csrc/batch_invariant.cpp via model/batch_invariant.py) on random inputs.

Two properties each: the row of a token computed alone equals, bit for bit (torch.equal), the same
row inside batches of other sizes (1, 7, 64, 513 rows; other sequences; other page layouts); and the
values match a float64 reference to the arithmetic's rounding: fp32 accumulation over K terms
(~K * 2^-24 relative to sum|x w|) plus one final rounding to the output dtype (half an ulp: 2^-9 of
|y| for bf16, 2^-12 for fp16, nothing extra for fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine.model import batch_invariant as inv
from rlengine.model.attention import PackedCausal

ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = list(ROUND)


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 100, 1030])
def test_linear_rows_alone_equal_rows_in_any_batch(dtype, K):
    g = torch.Generator().manual_seed(K)
    w, b = _rand(37, K, dtype=dtype, gen=g), _rand(37, dtype=dtype, gen=g)
    x = _rand(513, K, dtype=dtype, gen=g)
    full = inv.linear(x, w, b)
    for rows in (slice(5, 6), slice(0, 7), slice(100, 164), slice(0, 513)):
        assert torch.equal(inv.linear(x[rows], w, b), full[rows]), rows
    ref = x.double() @ w.double().T + b.double()
    bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + ROUND[dtype] * ref.abs() + 1e-30
    assert ((full.double() - ref).abs() <= bound * 1.01 + 2.0 ** -24 * ref.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_fp32_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    h, w = _rand(64, 48, dtype=dtype, gen=g), _rand(300, 48, dtype=dtype, gen=g)
    z = inv.logits(h, w)
    assert z.dtype == torch.float32
    assert all(torch.equal(inv.logits(h[i:i + 1], w), z[i:i + 1]) for i in (0, 17, 63))
    ref = h.double() @ w.double().T
    assert ((z.double() - ref).abs() <= 48 * 2.0 ** -24 * (h.double().abs() @ w.double().abs().T) * 1.01).all()


def test_linear_backward_is_the_ordinary_one():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 20, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(7, 20, generator=g).requires_grad_()
    b = torch.randn(7, generator=g).requires_grad_()
    gy = torch.randn(9, 7, generator=g)
    inv.linear(x, w, b).backward(gy)
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).backward(gy)
    for a, t in zip(got, (x, w, b)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


def test_logsumexp_is_row_invariant_and_exact_to_rounding():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(70, 1001, generator=g) * 5
    z[3, 10:] = float("-inf")
    z[4] = float("-inf")
    lse = inv.logsumexp(z)
    assert all(torch.equal(inv.logsumexp(z[i:i + 1]), lse[i:i + 1]) for i in range(70))
    ref = z.double().logsumexp(-1)
    assert lse[4] == float("-inf")
    ok = torch.arange(70) != 4
    # exp: a few ulps per term; the lane sums: V * 2^-24 relative; the log: half an ulp
    assert ((lse[ok].double() - ref[ok]).abs() <= 1e-6 * ref[ok].abs() + 1001 * 2.0 ** -24).all()


def test_logsumexp_backward_is_softmax():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(5, 33, generator=g).requires_grad_()
    gy = torch.randn(5, generator=g)
    inv.logsumexp(z).backward(gy)
    torch.testing.assert_close(z.grad, gy[:, None] * z.detach().softmax(-1), rtol=1e-6, atol=1e-7)


def _packed(lens, H, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (_rand(T, n, D, dtype=dtype, gen=g) for n in (H, Hkv, Hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, cu


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_attention_matches_sdpa_and_is_sequence_invariant(dtype):
    lens = [1, 31, 32, 33, 100]  # one key, inside, at and past a 32-key chunk boundary
    q, k, v, cu = _packed(lens, 4, 2, 16, dtype, 5)
    o = inv.attention_varlen(q, k, v, cu, 0.25)
    ref = PackedCausal(cu.tolist(), 0.25, layout="loop").attend(0, q.double(), k.double(), v.double())
    # fp32 softmax and sums over <= 100 keys, then one rounding to the dtype
    assert ((o.double() - ref).abs() <= 1e-5 + ROUND[dtype] * ref.abs() * 2).all()
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = inv.attention_varlen(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), 0.25)
        assert torch.equal(alone, o[a:b]), f"sequence {i}"


def _paged(k_TKD, v_TKD, P, pages, order):
    """Scatter one sequence's K/V rows into a [pages, P, Hkv, D] cache at page ids `order`."""
    cache_k = torch.randn(pages, P, *k_TKD.shape[1:]).to(k_TKD.dtype)  # garbage elsewhere
    cache_v = torch.randn(pages, P, *k_TKD.shape[1:]).to(k_TKD.dtype)
    for j in range(k_TKD.shape[0]):
        cache_k[order[j // P], j % P] = k_TKD[j]
        cache_v[order[j // P], j % P] = v_TKD[j]
    return cache_k, cache_v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P", [1, 5, 16])
def test_paged_decode_equals_the_packed_causal_pass(dtype, P):
    """The last query of a sequence decoded over pages (scattered in random order) gives the packed
    causal pass's bits, at every page size and for contexts across the chunk boundaries."""
    for L in (1, 32, 33, 70):
        q, k, v, cu = _packed([L], 4, 2, 16, dtype, 10 + L)
        packed = inv.attention_varlen(q, k, v, cu, 0.3)
        pages = -(-L // P)
        order = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(L))[:pages].tolist()
        ck, cv = _paged(k, v, P, pages + 3, order)
        out = torch.empty(1, 4, 16, dtype=dtype)
        torch.ops.rlengine.inv_paged_decode(q[-1:], ck, cv, torch.tensor([0, pages], dtype=torch.int32),
                                            torch.tensor(order, dtype=torch.int32),
                                            torch.tensor([L - (pages - 1) * P], dtype=torch.int32), 0.3, out)
        assert torch.equal(out[0], packed[-1]), f"L={L}"


def test_paged_decode_rejects_a_bad_page_table():
    q = torch.randn(1, 2, 8)
    ck = torch.randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.rlengine.inv_paged_decode(q, ck, ck.clone(), torch.tensor([0, 1], dtype=torch.int32),
                                            torch.tensor([7], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                                            1.0, torch.empty_like(q))


def test_attention_backward_is_the_ordinary_one():
    q, k, v, cu = _packed([5, 9], 2, 1, 8, torch.float32, 6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    gy = torch.randn_like(q)
    inv.attention_varlen(q, k, v, cu, 0.5).backward(gy)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    PackedCausal(cu.tolist(), 0.5, layout="loop").attend(0, q, k, v).backward(gy)
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-6)


def test_elementwise_log_and_exp_do_not_depend_on_where_an_element_sits():
    """torch's elementwise loops use a vector kernel in the body and a scalar one in the tail; the
    invariant ones give an element the same bits at any offset and size (within 2 ulp of float64)."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(1000, generator=g) + 1e-3
    for fn, ref in ((inv.log, torch.log), (inv.exp, torch.exp)):
        full = fn(x)
        for a, b in ((0, 1), (3, 20), (500, 1000), (999, 1000)):
            assert torch.equal(fn(x[a:b].clone()), full[a:b]), (fn, a, b)
        r = ref(x.double())
        assert ((full.double() - r).abs() <= 2 * 2.0 ** -24 * r.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_rows_are_invariant_and_match_torch(dtype):
    """Row by row; against silu(g) * u in float64: the activation rounded once to the dtype and the
    product once (2 units of roundoff of the product), plus a few fp32 ulps of the sigmoid."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(65, 2 * 37, generator=g) * 4).to(dtype)
    y = inv.silu_and_mul(x)
    assert all(torch.equal(inv.silu_and_mul(x[i:i + 1]), y[i:i + 1]) for i in (0, 31, 64))
    gate, up = x.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert ((y.double() - ref).abs() <= (2 * ROUND[dtype] + 2.0 ** -20) * ref.abs() + 1e-30).all()
