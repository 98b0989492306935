"""csrc/prefill_attention.cpp: causal attention of packed sequences (the engine's CPU prefill, no autograd).

Checked against per-sequence causal attention in float64 with the KV heads repeated: sequences
shorter and longer than one key block (256) and one query block, ragged packing, 1-token sequences,
GQA groups of 1 / 2 / 4, head dims 16-256, v a strided slice of a fused qkv row. bf16 sums exact
products in fp32 (vdpbf16ps where built, else on widened inputs), so it is within one output rounding.
"""

from __future__ import annotations

import pytest
import torch

from rlengine.model import ext

from tests.support.kernel_checks import packed_causal_fp64

pytestmark = pytest.mark.skipif(not ext.has_op("prefill_attention"),
                                reason="prefill_attention is built only with AVX-512 (csrc/prefill_attention.cpp)")


def _inputs(lens, H, Hkv, D, dtype, seed):
    """q [T, H, D] contiguous, k [T, Hkv, D] contiguous, v a slice of a [T, (H + 2 Hkv) D] qkv row."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    return q, k, v, cu


def _op(q, k, v, cu, scale):
    return torch.ops.rlengine.prefill_attention(q, k, v, torch.tensor(cu, dtype=torch.int64), scale)


@pytest.mark.parametrize("lens,H,Hkv,D", [
    ([300, 1, 77, 520], 4, 2, 32),   # key blocks crossed, ragged, a 1-token sequence
    ([65], 4, 4, 16),                # G = 1: 64-row query blocks
    ([40, 33], 8, 2, 64),            # G = 4
    ([17, 3], 2, 1, 256),            # the widest head
    ([129], 2, 1, 48),               # D not a multiple of 64: the P V kernel's short tile
    ([260, 40], 6, 2, 32),           # G = 3: 21-row query blocks, some straddling a key block's end:
    ([1550], 3, 1, 16),              # at 1536 with 3 tokens (9 rows) before it, a P V tile mixing rows with no key
])
def test_matches_per_sequence_attention_fp32(lens, H, Hkv, D):
    q, k, v, cu = _inputs(lens, H, Hkv, D, torch.float32, seed=sum(lens) + D)
    scale = D ** -0.5
    out = _op(q, k, v, cu, scale)
    assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
    # fp32 dot products of D terms and sums of up to 520 probabilities: ~1e-6 relative
    torch.testing.assert_close(out.double(), packed_causal_fp64(q, k, v, cu, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens,H,Hkv,D", [([270, 9], 4, 2, 32), ([300], 2, 2, 48)])
def test_bf16_is_within_one_output_rounding(lens, H, Hkv, D):
    q, k, v, cu = _inputs(lens, H, Hkv, D, torch.bfloat16, seed=3 + D)
    out = _op(q, k, v, cu, 0.2)
    assert out.dtype == torch.bfloat16
    # bf16 products are exact in fp32 and sums stay fp32: ~1e-6, then half a bf16 ulp (2^-9 relative)
    torch.testing.assert_close(out.double(), packed_causal_fp64(q, k, v, cu, 0.2), atol=1e-5, rtol=2 ** -8)


def test_threads_split_the_work_without_changing_it():
    q, k, v, cu = _inputs([200, 90], 4, 2, 32, torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op(q, k, v, cu, 0.3)
        torch.set_num_threads(2)
        two = _op(q, k, v, cu, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output row is one item's, whichever thread ran it


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v, cu: (q, k[:, :, :8].contiguous(), v, cu), "k and v must be"),
    (lambda q, k, v, cu: (q[:, :3], k, v, cu), "multiple of Hkv"),
    (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 5])), "from 0 to T"),
    (lambda q, k, v, cu: (q, k, v, torch.tensor([0, 30, 20, 40])), "non-decreasing"),
    (lambda q, k, v, cu: (q.half(), k.half(), v.half(), cu), "float32 or all bfloat16"),
    (lambda q, k, v, cu: (q[:, :, :24], k[:, :, :24], v[:, :, :24], cu), "multiple of 16"),
])
def test_bad_inputs_are_refused(bad, match):
    q, k, v, _ = _inputs([40], 4, 2, 32, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.rlengine.prefill_attention(*bad(q, k, v, torch.tensor([0, 40])), 0.1)
