"""The learner's chunked torch log-prob head (rl/learner/chunked_head.py) against the unchunked oracle.

Forward values and the gradients of h and W, with one shared upstream gradient on log-prob and
entropy, in fp64 (agreement to 1e-12: only the summation order of grad_W changes) for raw and
processed modes; with one chunk the ops are the unchunked ones, so fp32 agrees bit for bit.
The raw definition's own Function (raw_chunked_head: written-out logit gradient, backward GEMMs in
the model's dtype, the one-chunk block kept) against the same oracle: fp64 to 1e-12, fp32 and bf16
log-probs bit for bit with one chunk, gradients within the rounding their arithmetic allows.
"""

import pytest
import torch

from rlengine.kernels.fused_logprob import fused_logprob_ref
from rlengine.rl.learner.chunked_head import chunked_head, raw_chunked_head
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


def _raw_case(dtype, chunk, temperature, grads, T=53, C=24, V=97):
    """(reference, got) of [logp, entropy, grad_h, grad_W]; `grads` names the outputs the loss uses."""
    h, w, t, a, b = _inputs(dtype, T, C, V)
    a, b = (a if "logp" in grads else 0 * a), (b if "entropy" in grads else 0 * b)

    def loss_of(fn):
        lp, en = fn()
        return (lp * a if "logp" in grads else 0) + (en * b if "entropy" in grads else 0)

    out = []
    for fn in (lambda: fused_logprob_ref(h, w, t, temperature=temperature, return_entropy=True),
               lambda: raw_chunked_head(h, w, t, temperature, chunk_tokens=chunk)):
        h.grad = w.grad = None
        lp, en = fn()
        loss_of(lambda: (lp, en)).sum().backward()
        out.append([lp.detach(), en.detach(), h.grad.clone(), w.grad.clone()])
    return out


@pytest.mark.parametrize("grads", [("logp", "entropy"), ("logp",), ("entropy",)])  # the three gradient branches
@pytest.mark.parametrize("chunk,temperature", [(1, 0.7), (7, 1.0), (53, 0.7), (64, 1.3)])  # ragged, one chunk
def test_raw_head_matches_the_oracle_in_fp64(chunk, temperature, grads):
    ref, got = _raw_case(torch.float64, chunk, temperature, grads)
    for x, y in zip(ref, got):
        assert (x - y).abs().max() < 1e-12


@pytest.mark.parametrize("chunk", [7, 53])
def test_raw_head_fp32_log_probs_and_gradients(chunk):
    """One chunk: the oracle's ops, so log-probs and entropy bit for bit (several chunks: the GEMM's
    blocking by rows may move them by an ulp). The gradient is written out instead of replayed
    through autograd: each element is a length-V sum of fp32-rounded terms, so the two differ by up
    to V * eps32 of the largest gradient element (97 * 1.2e-7)."""
    ref, got = _raw_case(torch.float32, chunk, 0.7, ("logp", "entropy"))
    if chunk == 53:
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for x, y in zip(ref, got):
        assert (x - y).abs().max() <= 97 * 1.2e-7 * x.abs().max()


def test_raw_head_bf16_gradients_within_the_rounding_of_the_logit_gradient():
    """bf16 model, one chunk: the log-probs are fp32 logits from the bf16 weights, bit for bit the
    oracle's; the backward rounds the fp32 logit gradient G to bf16 (unit roundoff 2**-8) before the
    GEMMs (fp32 accumulation) and their bf16 outputs are rounded once more (2**-8), so each gradient
    element is within 2**-7 of the sum of its terms' magnitudes (|G| @ |W| for h, |G|^T @ |h| for W)
    of the exact fp64 gradient of the same bf16 inputs."""
    T, C, V = 40, 32, 300
    g = torch.Generator().manual_seed(5)
    h = torch.randn(T, C, generator=g).bfloat16().requires_grad_()
    w = torch.randn(V, C, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    lp, en = raw_chunked_head(h, w, t, 0.8)
    (lp * a + en * b).sum().backward()
    ref_lp, ref_en = fused_logprob_ref(h.detach(), w.detach(), t, temperature=0.8, return_entropy=True)
    assert torch.equal(lp, ref_lp) and torch.equal(en, ref_en)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (h64 @ w64.T).requires_grad_()
    lp64, en64 = fused_logprob_ref(z, torch.eye(V, dtype=torch.float64), t, temperature=0.8, return_entropy=True)
    G, = torch.autograd.grad((lp64 * a.double() + en64 * b.double()).sum(), z)
    for got, exact, bound in ((h.grad, G @ w64.detach(), G.abs() @ w64.detach().abs()),
                              (w.grad, G.T @ h64.detach(), G.T.abs() @ h64.detach().abs())):
        assert ((got.double() - exact).abs() <= 2 ** -7 * bound).all()


def test_raw_head_second_backward_gives_the_same_gradients():
    """The one-chunk block saved from the forward must come out of the first backward intact:
    retain_graph=True and a second backward give the same gradients."""
    h, w, t, a, _ = _inputs(torch.float64)
    lp, _ = raw_chunked_head(h, w, t, 0.9)
    first = torch.autograd.grad((lp * a).sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad((lp * a).sum(), (h, w))
    assert all((x - y).abs().max() < 1e-13 for x, y in zip(first, second))


def test_raw_head_bad_input_is_refused():
    h, w, t, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        raw_chunked_head(h, w, t, 0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        raw_chunked_head(h, w, t, 1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match="targets_T"):
        raw_chunked_head(h, w, t[:-1], 1.0)
