"""The batch-invariant Triton kernels under TRITON_INTERPRET=1 (fp32 and fp16), on random inputs.

Two properties each, as tests/model/test_batch_invariant_ops.py for the C++ ops: a row computed
alone equals (torch.equal) the same row inside batches of 1, 7, 64 and 513 rows; paged decode over
shuffled pages equals the packed causal pass; and the values match float64 references to the
arithmetic's rounding: fp32 accumulation over K terms (K * 2^-24 of sum |x w|) plus one rounding to
the output dtype (2^-11 of |y| for fp16, none for fp32). A planted bug (the matmul's tile config
chosen by M) must make the equality check fail. The per-row norms of fused_norm.py that the
invariant mode runs on CUDA are checked for row invariance too.
"""

import pytest
import torch

from rlengine.kernels import fused_norm as fn
from rlengine.kernels import invariant_matmul as im
from rlengine.kernels.invariant_attention import (invariant_attention_ref, invariant_attention_varlen,
                                                  invariant_paged_decode)
from rlengine.kernels.invariant_logsumexp import invariant_logsumexp, invariant_logsumexp_ref

ROUND = {torch.float32: 0.0, torch.float16: 2.0 ** -11}
DTYPES = list(ROUND)
BATCHES = (slice(5, 6), slice(0, 7), slice(100, 164), slice(0, 513))  # 1, 7, 64, 513 rows


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


def _rows_invariant(fn_, x, full):
    return {f"{r.start}:{r.stop}": torch.equal(fn_(x[r]), full[r]) for r in BATCHES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_alone_equal_rows_in_any_batch_and_match_fp64(dtype):
    g = torch.Generator().manual_seed(7)
    K = 100  # a K tail (100 = 64 + 36)
    x, w, b = _rand(513, K, dtype=dtype, gen=g), _rand(37, K, dtype=dtype, gen=g), _rand(37, dtype=dtype, gen=g)
    full = im.invariant_matmul(x, w, b)
    got = _rows_invariant(lambda t: im.invariant_matmul(t, w, b), x, full)
    assert all(got.values()), got
    ref = x.double() @ w.double().T + b.double()
    bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + b.double().abs()) + ROUND[dtype] * ref.abs()
    assert ((full.double() - ref).abs() <= bound * 1.01 + 1e-30).all()


def test_fp32_logits_from_fp16_weights_are_row_invariant():
    g = torch.Generator().manual_seed(8)
    h, w = _rand(64, 48, dtype=torch.float16, gen=g), _rand(70, 48, dtype=torch.float16, gen=g)
    z = im.invariant_matmul(h, w, fp32_out=True)
    assert z.dtype == torch.float32
    assert all(torch.equal(im.invariant_matmul(h[i:i + 1], w, fp32_out=True), z[i:i + 1]) for i in (0, 17, 63))
    ref = h.double() @ w.double().T
    assert ((z.double() - ref).abs() <= 48 * 2.0 ** -24 * (h.double().abs() @ w.double().abs().T) * 1.01).all()


def test_a_tile_config_chosen_by_m_breaks_the_equality(monkeypatch):
    """Negative control: the equality check above must catch a config that moves with the batch."""
    real = im.matmul_config
    rows = {}

    def by_m(N, K, dtype, device_type):  # a "tuned" config: wider K steps for big batches
        return im.MatmulConfig(1, 64, 16, 4, 1, "ieee") if rows["M"] >= 64 else real(N, K, dtype, device_type)

    def launch(x, w, b=None, fp32_out=False, *, config=None):
        rows["M"] = x.shape[0]
        return im.invariant_matmul(x, w, b, fp32_out, config=by_m(w.shape[0], x.shape[1], x.dtype, "cpu"))
    g = torch.Generator().manual_seed(9)
    x, w = _rand(513, 100, dtype=torch.float32, gen=g), _rand(37, 100, dtype=torch.float32, gen=g)
    full = launch(x, w)
    assert not torch.equal(launch(x[5:6], w), full[5:6])


def test_logsumexp_is_row_invariant_and_exact_to_rounding():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(70, 2500, generator=g) * 5  # 3 chunks of 1024, the last partial
    z[3, 10:] = float("-inf")
    z[4] = float("-inf")
    lse = invariant_logsumexp(z)
    assert all(torch.equal(invariant_logsumexp(z[i:i + 1]), lse[i:i + 1]) for i in (0, 3, 4, 69))
    assert torch.equal(invariant_logsumexp(z[:7]), lse[:7]) and torch.equal(invariant_logsumexp(z[10:64]), lse[10:64])
    assert lse[4] == float("-inf")
    ok = torch.arange(70) != 4
    ref = invariant_logsumexp_ref(z)
    assert ((lse[ok].double() - ref[ok]).abs() <= 1e-6 * ref[ok].abs() + 2500 * 2.0 ** -24).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_qk_norm_rope_rows_are_batch_invariant(dtype):
    g = torch.Generator().manual_seed(10)
    x, w = _rand(513, 40, dtype=dtype, gen=g), _rand(40, dtype=dtype, gen=g)
    full = fn.rms_norm(x, w, 1e-6)
    got = _rows_invariant(lambda t: fn.rms_norm(t, w, 1e-6), x, full)
    assert all(got.values()), got
    H, Hkv, D = 4, 2, 16
    qkv = _rand(64, (H + 2 * Hkv) * D, dtype=dtype, gen=g)
    cos_sin = torch.randn(2, 128, D, generator=g)
    pos = torch.randint(0, 128, (64,), generator=g)
    qw, kw = _rand(D, dtype=dtype, gen=g), _rand(D, dtype=dtype, gen=g)
    q, k = fn.qk_norm_rope(qkv, qw, kw, cos_sin, pos, H, Hkv, 1e-6)
    q1, k1 = fn.qk_norm_rope(qkv[9:10], qw, kw, cos_sin, pos[9:10], H, Hkv, 1e-6)
    assert torch.equal(q1, q[9:10]) and torch.equal(k1, k[9:10])


def _packed(lens, H, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (_rand(T, n, D, dtype=dtype, gen=g) for n in (H, Hkv, Hkv))
    return q, k, v, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), g


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_attention_matches_sdpa_and_is_sequence_invariant(dtype):
    lens = [1, 31, 32, 33, 70]  # one key, inside, at and past a 32-key chunk boundary
    q, k, v, cu, _ = _packed(lens, 4, 2, 16, dtype, 5)
    o = invariant_attention_varlen(q, k, v, cu, 0.25)
    ref = invariant_attention_ref(q, k, v, cu, 0.25)
    # fp32 softmax and sums over <= 70 keys (~1e-6), the hi + lo probabilities, one rounding to the dtype
    assert ((o.double() - ref).abs() <= 2e-6 + 2 * ROUND[dtype] * ref.abs()).all()
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = invariant_attention_varlen(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), 0.25)
        assert torch.equal(alone, o[a:b]), f"sequence {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P", [5, 16])
def test_paged_decode_equals_the_packed_causal_pass(dtype, P):
    """Every prefix length 1..70 of one sequence as a decode row over shuffled pages = the packed pass."""
    L, H, Hkv, D = 70, 4, 2, 16
    q, k, v, cu, g = _packed([L], H, Hkv, D, dtype, 6)
    packed = invariant_attention_varlen(q, k, v, cu, 0.25)
    pages = -(-L // P)
    order = torch.randperm(pages + 3, generator=g)[:pages]  # fragmented, garbage in the other pages
    k_cache, v_cache = _rand(pages + 3, P, Hkv, D, dtype=dtype, gen=g), _rand(pages + 3, P, Hkv, D, dtype=dtype, gen=g)
    for j in range(L):
        k_cache[order[j // P], j % P], v_cache[order[j // P], j % P] = k[j], v[j]
    indptr, indices, last = [0], [], []
    for n in range(1, L + 1):
        used = -(-n // P)
        indices += order[:used].tolist()
        indptr.append(len(indices))
        last.append(n - (used - 1) * P)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    invariant_paged_decode(q, k_cache, v_cache, i32(indptr), i32(indices), i32(last), 0.25, out)
    assert torch.equal(out, packed)


def test_bad_inputs_name_the_problem():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x must be"):
        im.invariant_matmul(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        q = torch.randn(5, 2, 16)
        invariant_attention_varlen(q, q[:, :1], q[:, :1], torch.tensor([0, 3]), 0.25)
    with pytest.raises(ValueError, match="float32"):
        invariant_logsumexp(torch.randn(2, 5, dtype=torch.float16))
