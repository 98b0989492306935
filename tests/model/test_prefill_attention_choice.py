"""The CPU prefill attention chosen by measurement (model/attention.py PackedCausal, no autograd).

Each candidate ("torch": one SDPA per sequence, "padded": one right-padded SDPA, "upcast": bf16 on fp32
copies, "tiled": csrc/prefill_attention.cpp where built and the head dim allows) is forced in turn through injected timings and checked against causal attention of each
sequence alone in float64, so whichever the measurement picks computes the same function. The choice
is recorded in the process's table under the shape class key, and `rlengine info --kernels` decides it.
"""

from __future__ import annotations

import pytest
import torch

from rlengine.model import kernel_choice as kc
from rlengine.model import ops
from rlengine.model import attention
from rlengine.model.attention import PackedCausal, decide_prefill, prefill_candidates, prefill_key

from tests.support.kernel_checks import packed_causal_fp64


def _forcing(monkeypatch, winner: str) -> list[list[str]]:
    """KERNELS with a timer that makes `winner` the clear fastest; returns the candidate lists timed."""
    timed = []

    def timer(cands):
        timed.append(sorted(cands))
        return {name: (0.1 if name == winner else 1.0) for name in cands}
    monkeypatch.setattr(ops, "KERNELS", kc.KernelChoices("measure", timer=timer))
    return timed


# lens: equal (padding-free), ragged within the 2x padding bound, one sequence (no padded candidate),
# and a sequence of 1 token; odd head counts; a head dim the tiled kernel takes (32) and one it does not
@pytest.mark.parametrize("lens", [[16, 16, 16], [5, 9, 1, 7, 8], [37], [1, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 32])
def test_every_candidate_matches_per_sequence_attention(monkeypatch, lens, dtype, D):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    H, Hkv = 6, 2
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v = (torch.randn(cu[-1], h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    ref = packed_causal_fp64(q, k, v, cu, D ** -0.5)
    can_pad = PackedCausal(cu, 1.0).can_pad
    names = prefill_candidates(dtype, can_pad, D)
    assert ("padded" in names) == can_pad and ("upcast" in names) == (dtype == torch.bfloat16)
    assert ("tiled" in names) == (attention.TILED and D == 32)
    # fp32: summation order only; bf16: inputs are exact, the output and torch's bf16 probabilities round
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name in names:
        timed = _forcing(monkeypatch, name)
        with torch.inference_mode():
            out = PackedCausal(cu, D ** -0.5).attend(0, q, k, v)
        assert timed == ([sorted(names)] if len(names) > 1 else []), "timed once, over every candidate"
        key = prefill_key(dtype, len(lens), max(lens), H, Hkv, D)
        assert ops.KERNELS.table[key].impl == name
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), ref, **tol, msg=f"candidate {name}")


def test_autograd_and_forced_layouts_bypass_the_choice(monkeypatch):
    timed = _forcing(monkeypatch, "padded")
    cu = [0, 4, 9]
    q, k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(3))
    PackedCausal(cu, 0.3).attend(0, q, k, v).sum().backward()  # the learner: padded under autograd, untimed
    with torch.inference_mode():
        PackedCausal(cu, 0.3, layout="loop").attend(0, q.detach(), k.detach(), v.detach())
    assert timed == [] and ops.KERNELS.table == {}


def test_one_decision_per_shape_class_and_the_torch_mode(monkeypatch):
    timed = _forcing(monkeypatch, "padded")
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    with torch.inference_mode():
        for cu in ([0, 20, 40], [0, 18, 36]):  # both: 2 sequences of S class 32
            PackedCausal(cu, 0.3).attend(0, q[:cu[-1]], k[:cu[-1]], v[:cu[-1]])
    assert len(timed) == 1
    ops.KERNELS.configure("torch")
    with torch.inference_mode():
        PackedCausal([0, 20, 40], 0.3).attend(0, q, k, v)
    assert ops.KERNELS.table == {} and len(timed) == 1


def test_decide_prefill_fills_the_table_for_every_class(monkeypatch):
    from rlengine.model.config import preset

    _forcing(monkeypatch, "torch")
    cfg = preset("tiny")
    decide_prefill(cfg, torch.bfloat16, [16, 40], [1, 3])
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert set(ops.KERNELS.table) == {prefill_key(torch.bfloat16, B, S, H, Hkv, D) for S in (16, 40) for B in (1, 3)}


def test_a_pinned_table_without_the_class_keeps_the_loop(monkeypatch):
    timed = _forcing(monkeypatch, "padded")
    ops.KERNELS.configure("pinned", table={"linear/float32/B=1/8x8": "torch"})
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    with torch.inference_mode():
        out = PackedCausal([0, 20, 40], 0.3).attend(0, q, k, v)
    assert timed == [] and set(ops.KERNELS.table) == {"linear/float32/B=1/8x8"}
    torch.testing.assert_close(out.double(), packed_causal_fp64(q, k, v, [0, 20, 40], 0.3), atol=1e-5, rtol=1e-5)
