"""PackedCausal (the prefill / learner attention over packed sequences) against per-sequence SDPA.

Both of its layouts, the right-padded single SDPA call (used with gradients) and the
per-sequence loop (CPU inference, and very ragged batches), must equal causal attention of each
sequence alone, forward and backward (GQA, fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine.model.attention import PackedCausal


def _reference(q, k, v, cu, scale):
    outs = []
    for a, b in zip(cu, cu[1:]):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


# ragged (padded), too ragged to pad (loop), equal lengths (viewed as [B, S], no padding copies)
@pytest.mark.parametrize("lens,can_pad", [([5, 9, 1, 7, 8], True), ([40, 1, 2, 1], False), ([1, 1, 1], True),
                                          ([6, 6, 6], True)])
@pytest.mark.parametrize("grad", [True, False])
def test_packed_causal_matches_per_sequence_sdpa(lens, can_pad, grad):
    gen = torch.Generator().manual_seed(sum(lens))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T, H, Hkv, D = cu[-1], 6, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=gen, requires_grad=grad) for h in (H, Hkv, Hkv))
    ctx = PackedCausal(cu, D ** -0.5)
    assert ctx.can_pad == can_pad
    out = ctx.attend(0, q, k, v)
    ref = _reference(q, k, v, cu, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
