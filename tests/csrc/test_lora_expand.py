"""csrc/lora_expand.cpp (LoRA's second GEMM on the CPU decode path) against a float64 block-by-block reference:
out = y + s * t[:, cols] B[rows, cols]^T per targeted slice, y elsewhere (t None: y holds [y | t]). Random non-zero inputs everywhere,
including B's off-block entries, which the kernel must not read."""

import pytest
import torch

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)

expand = torch.ops.rlengine.lora_expand


def _ref(y, t, B, s, r, blocks):
    out = y.double().clone()
    for row0, col0, rows in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
        out[:, row0:row0 + rows] += s * (t[:, col0:col0 + r].double() @ B[row0:row0 + rows, col0:col0 + r].double().t())
    return out


def _bound(y, t, B, s, r, blocks, ref, dtype):
    """One rounding of the result to dtype (half an ulp: 2^-8 relative in bf16, 2^-24 in fp32) plus fp32
    accumulation over r + 1 terms (r * 2^-24 of the sum of magnitudes)."""
    mag = y.double().abs().clone()
    for row0, col0, rows in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
        mag[:, row0:row0 + rows] += abs(s) * (t[:, col0:col0 + r].double().abs()
                                              @ B[row0:row0 + rows, col0:col0 + r].double().abs().t())
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    return ulp * ref.abs() + (r + 2) * 2.0 ** -24 * mag


CASES = {  # M, N, r, blocks (row0, col0, rows per targeted slice), J = t's columns
    "gate_up": (4, 96, 8, (0, 0, 48, 48, 8, 48), 16),
    "qkv-one-target": (3, 80, 8, (0, 0, 40), 8),  # rows 40-79 untargeted: out = y there
    "tails": (17, 75, 18, (5, 0, 33, 40, 18, 29), 36),  # rows 0-4 and 38-39 untargeted; tiles of 1-16 rows
    "rank-2": (9, 33, 2, (0, 0, 33), 2),
    "rank-64": (2, 40, 64, (0, 0, 40), 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_lora_expand_matches_blockwise_reference(dtype, case):
    M, N, r, blocks, J = CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 31 + M)
    joint = torch.randn(M, N + J, generator=gen).to(dtype)  # as LoraAdapter.project: y and t are slices of one output
    y, t = joint[:, :N], joint[:, N:]
    B = torch.randn(N, J, generator=gen).to(dtype)  # dense: off-block values must be ignored
    with torch.inference_mode():
        got = expand(y, t, B, 0.75, r, list(blocks))
        assert torch.equal(expand(joint, None, B, 0.75, r, list(blocks)), got)  # t = None: [y | t] in one tensor
    ref = _ref(y, t, B, 0.75, r, blocks)
    assert got.shape == (M, N) and got.dtype == dtype and got.is_contiguous()
    err = (got.double() - ref).abs()
    assert (err <= _bound(y, t, B, 0.75, r, blocks, ref, dtype)).all(), err.max()


def test_lora_expand_rows_are_batch_invariant():
    """Each output row is computed alone, in one order, whatever the row count: bitwise equal."""
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(13, 64, generator=gen).bfloat16()
    t = torch.randn(13, 16, generator=gen).bfloat16()
    B = torch.randn(64, 16, generator=gen).bfloat16()
    blocks = [0, 0, 32, 32, 8, 32]
    with torch.inference_mode():
        full = expand(y, t, B, 2.0, 8, blocks)
        for i in (0, 6, 12):
            assert torch.equal(expand(y[i:i + 1], t[i:i + 1], B, 2.0, 8, blocks), full[i:i + 1])
        assert torch.equal(expand(y[3:8], t[3:8], B, 2.0, 8, blocks), full[3:8])


def test_lora_expand_falls_back_to_the_dense_product():
    """What the kernel does not run (odd r, a strided B, autograd) is y + s * t B^T on the dense B."""
    gen = torch.Generator().manual_seed(6)
    y, t = torch.randn(3, 24, generator=gen), torch.randn(3, 5, generator=gen)
    B = torch.randn(24, 5, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(expand(y, t, B, 0.5, 5, [0, 0, 24]), y + 0.5 * t @ B.t())
        Bs = torch.randn(24, 10, generator=gen)[:, ::2]
        torch.testing.assert_close(expand(y, t, Bs, 0.5, 5, [0, 0, 24]), y + 0.5 * t @ Bs.t())
    Bg = B.clone().requires_grad_()
    expand(y, t, Bg, 0.5, 5, [0, 0, 24]).sum().backward()  # recorded by autograd as usual
    torch.testing.assert_close(Bg.grad, 0.5 * t.sum(0).expand(24, 5))


def test_lora_expand_rejects_blocks_outside_b_by_falling_back():
    """Blocks past B's rows or columns, or overlapping, never reach the kernel's raw pointers."""
    y, t, B = torch.randn(2, 8), torch.randn(2, 4), torch.randn(8, 4)
    with torch.inference_mode():
        for blocks in ([0, 0, 9], [0, 3, 8], [0, 0, 5, 4, 2, 4], [-1, 0, 4]):
            torch.testing.assert_close(expand(y, t, B, 1.0, 2, blocks), y + t @ B.t())


@pytest.mark.parametrize("winner", ["torch", "expand"])
def test_lora_expand_nograd_runs_what_the_kernel_choice_picked(monkeypatch, winner):
    """The engine's entry point times both implementations once per shape class (here a fixed timer)
    and runs the winner; both give y + s t B^T on the joint [y | t] output."""
    from rlengine.model import ops
    from rlengine.model.kernel_choice import KernelChoices

    times = {"torch": 1.0, "expand": 0.5} if winner == "expand" else {"torch": 0.5, "expand": 1.0}
    monkeypatch.setattr(ops, "KERNELS", KernelChoices("measure", timer=lambda cands: {k: times.get(k, 2.0) for k in cands}))
    ran = []
    monkeypatch.setattr(ops, "_lora_dense", lambda *a: ran.append("torch") or _dense(*a))
    gen = torch.Generator().manual_seed(7)
    yt, B = torch.randn(4, 48 + 16, generator=gen), torch.randn(48, 16, generator=gen)
    B[:24, 8:] = 0
    B[24:, :8] = 0  # block-diagonal, as the adapters keep it
    with torch.inference_mode():
        got = ops.lora_expand_nograd(yt, None, B, 0.5, 8, (0, 0, 24, 24, 8, 24))
    assert ops.KERNELS.to_dict()["lora_expand/float32/B=4/48x16"]["impl"] == winner
    assert ran == (["torch"] if winner == "torch" else [])
    torch.testing.assert_close(got, yt[:, :48] + 0.5 * yt[:, 48:] @ B.t())


def _dense(y, t, B, scale, linear):
    if t is None:
        y, t = y[:, :B.shape[0]], y[:, B.shape[0]:]
    return y + scale * linear(t, B)


def test_joint_gemm_takes_the_base_weights_kernel_choice(monkeypatch):
    """[W; A] runs under W's decision: one key for both, so noise cannot put them on different kernels."""
    from rlengine.model import ops
    from rlengine.model.kernel_choice import KernelChoices

    monkeypatch.setattr(ops, "KERNELS", KernelChoices("measure", timer=lambda cands: {k: 1.0 for k in cands}))
    gen = torch.Generator().manual_seed(8)
    joint, x = torch.randn(40 + 8, 32, generator=gen), torch.randn(3, 32, generator=gen)
    with torch.inference_mode():
        got = ops.linear_nograd(x, joint, like=joint[:40])
    assert set(ops.KERNELS.to_dict()) == {"linear/float32/B=3/40x32"}
    torch.testing.assert_close(got, x @ joint.t())
