"""The learner's chunked torch log-prob head (rl/learner/chunked_head.py) against the unchunked oracle.

Forward values and the gradients of h and W, with one shared upstream gradient on log-prob and
entropy, in fp64 (agreement to 1e-12: only the summation order of grad_W changes) for raw and
processed modes; with one chunk the ops are the unchunked ones, so fp32 agrees bit for bit.
"""

import pytest
import torch

from rlengine.kernels.fused_logprob import fused_logprob_ref
from rlengine.rl.learner.chunked_head import chunked_head
from rlengine.rl.learner.logprobs import processed_head, raw_head


def _inputs(dtype, T=53, C=24, V=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, C, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(V, C, generator=g, dtype=dtype).requires_grad_()
    return h, w, torch.randint(0, V, (T,), generator=g), torch.randn(T, generator=g, dtype=dtype), \
        torch.randn(T, generator=g, dtype=dtype)


def _run(h, w, a, b, fn):
    h.grad = w.grad = None
    lp, en = fn()
    (lp * a + en * b).sum().backward()
    return [lp.detach(), en.detach(), h.grad.clone(), w.grad.clone()]


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("chunk", [1, 7, 53])  # one row per chunk, a ragged last chunk, one chunk
def test_chunked_matches_unchunked_values_and_gradients(mode, chunk):
    h, w, t, a, b = _inputs(torch.float64)
    fn = raw_head(0.7) if mode == "raw" else processed_head(0.7, 5, 0.9)
    ref = _run(h, w, a, b, lambda: fn(h, w, t))
    got = _run(h, w, a, b, lambda: chunked_head(h, w, t, fn, chunk_tokens=chunk))
    for x, y in zip(ref, got):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y))
        assert (x[finite] - y[finite]).abs().max() < 1e-12


def test_one_chunk_is_bitwise_the_unchunked_fp32_head():
    h, w, t, a, b = _inputs(torch.float32)
    ref = _run(h, w, a, b, lambda: fused_logprob_ref(h, w, t, temperature=1.3, return_entropy=True))
    got = _run(h, w, a, b, lambda: chunked_head(h, w, t, raw_head(1.3)))
    assert all(torch.equal(x, y) for x, y in zip(ref, got))


def test_bad_chunk_is_refused():
    h, w, t, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_head(h, w, t, raw_head(1.0), chunk_tokens=0)


def _peak_bytes(T, chunk, V=151_936, C=64):
    """Peak heap above entry of one forward + backward at V = Qwen3's vocabulary (fp32, one thread)."""
    from tests.support.cpu_peak import PeakHeap

    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, C, generator=g).requires_grad_()
    w = torch.randn(V, C, generator=g).mul_(0.05).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with PeakHeap() as meter:
            lp, en = chunked_head(h, w, t, raw_head(1.0), chunk_tokens=chunk)
            (lp.sum() + en.sum()).backward()
    finally:
        torch.set_num_threads(threads)
    return meter.peak


def test_the_peak_grows_with_the_chunk_not_with_T():
    """At V = 151,936 one [T, V] fp32 block is 0.6 MB per row. With 16-row chunks, T = 64 -> 256 adds
    192 rows' worth (117 MB) to an unchunked head; the chunked peak may grow by far less (the
    per-token outputs and h's gradient are ~1 KB per row). A 64-row chunk raises the peak by about
    48 rows' worth of blocks (a [T_c, V] block, its softmax and its gradient: >= 29 MB each)."""
    row = 151_936 * 4
    small_t, big_t, big_chunk = _peak_bytes(64, 16), _peak_bytes(256, 16), _peak_bytes(64, 64)
    assert big_t - small_t < 20 * row, (small_t, big_t)
    assert big_chunk - small_t > 48 * row, (small_t, big_chunk)
    # the negative control: one chunk of all T rows is the unchunked head, and grows with T
    assert _peak_bytes(256, 256) - _peak_bytes(64, 64) > 192 * row
