"""Fused MoE Triton kernels against the plain-torch loop over experts (fused_moe_ref).

Runs on the CPU through TRITON_INTERPRET=1 (set in tests/conftest.py) in fp32 and fp16 with tiny
shapes; a pinned 16-wide config makes those shapes cross tile and block boundaries. Forward
and the gradients of x, w13, w2 and topk_weights are checked with one shared upstream grad.
"""

import pytest
import torch

from rlengine.kernels import fused_moe as fm
from rlengine.kernels import moe_align as ma
from rlengine.kernels import moe_gemm as gemm
from rlengine.kernels.moe_align import max_padded_rows, moe_align, moe_align_block_size, moe_align_ref

from tests.support.moe_cases import ALIGN_CASES, make_inputs, make_routing
from tests.support.tolerances import tol


SMALL = fm.MoEConfig(block_m=16, block_n=16, block_k=16, num_warps=4, wgrad_block=16, wgrad_block_r=16)
DTYPES = [torch.float32, torch.float16]


def check_against_ref(leaves, ids, dy, backward="v1"):
    """Forward and all four gradients of fused_moe vs fused_moe_ref, same upstream dy."""
    y = fm.fused_moe(*leaves, ids, backward=backward)
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref = fm.fused_moe_ref(*leaves, ids)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    t = tol(leaves[0].dtype)
    assert y.dtype == leaves[0].dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **t)
    for name, g, g_ref in zip(("x", "w13", "w2", "topk_weights"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        torch.testing.assert_close(g, g_ref, **t, msg=lambda m, name=name: f"grad of {name}: {m}")


# (id, T, C, F, E, K, experts routed to or None, all-to-one expert or None)
CASES = [
    ("decode_T1", 1, 32, 16, 4, 2, None, None),
    ("T_lt_block_m", 5, 32, 32, 4, 2, None, None),
    ("odd_C_F", 20, 47, 23, 4, 2, None, None),
    ("prime_E", 24, 32, 16, 7, 3, None, None),
    ("K1", 24, 32, 16, 5, 1, None, None),
    ("K_eq_E", 12, 24, 16, 5, 5, None, None),
    ("empty_experts", 16, 32, 16, 7, 2, [1, 4, 5], None),
    ("all_to_one_expert_crosses_blocks", 40, 32, 16, 5, 1, None, 3),
    ("many_blocks_per_expert", 40, 48, 48, 3, 2, None, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_backward_matches_ref(case, dtype):
    _, T, C, F, E, K, experts, one = case
    ids = torch.full((T, K), one, dtype=torch.long) if one is not None else None
    leaves, ids, dy = make_inputs(T, C, F, E, K, dtype, seed=CASES.index(case), experts=experts, ids=ids)
    with fm.pin_config(SMALL):
        check_against_ref(leaves, ids, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_config_path(dtype):
    """The unpinned config table (tiles clipped to the dims) on an odd shape."""
    assert fm.pin_config._pinned is None
    leaves, ids, dy = make_inputs(T=9, C=23, F=47, E=3, K=2, dtype=dtype, seed=7)
    check_against_ref(leaves, ids, dy)


def test_inference_path_matches_ref():
    """No grad: the forward that does not store pre-activations; int32 ids accepted."""
    (x, w13, w2, tw), ids, _ = make_inputs(T=17, C=32, F=16, E=5, K=2, dtype=torch.float32, seed=3)
    with torch.no_grad(), fm.pin_config(SMALL):
        y = fm.fused_moe(x, w13, w2, tw, ids.int())
        y_ref = fm.fused_moe_ref(x, w13, w2, tw, ids)
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))


def test_poisoned_buffers_and_neighbours(monkeypatch):
    """Every kernel output buffer starts as nan, and nan sits right outside x, dy and the
    expert weights: padding rows (sentinel N -> token T) or unused blocks (expert -1) that
    were read or left unwritten would put nan into the result."""
    T, C, F, E, K = 13, 32, 16, 5, 2
    (x, w13, w2, tw), ids, dy = make_inputs(T, C, F, E, K, torch.float32, seed=11, experts=[0, 2, 4])

    def nan_alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def padded(t, dim0_before):
        """t inside a bigger nan buffer: dim0_before nan slices before and one after."""
        big = torch.full((t.shape[0] + dim0_before + 1, *t.shape[1:]), float("nan"), dtype=t.dtype)
        big[dim0_before:-1] = t.detach()
        return big[dim0_before:-1].requires_grad_()

    monkeypatch.setattr(gemm, "alloc", nan_alloc)
    leaves = [padded(x, 0), padded(w13, 1), padded(w2, 1), padded(tw, 0)]
    with fm.pin_config(SMALL):
        check_against_ref(leaves, ids, padded(dy, 0).detach())


@pytest.mark.parametrize("align", [moe_align, moe_align_ref], ids=["kernel", "torch"])
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("route", ["random", "empty_experts", "one_expert"])
def test_align_invariants(block_m, route, align):
    T, E, K = 23, 7, 2
    gen = torch.Generator().manual_seed(5)
    if route == "one_expert":
        ids = torch.full((T, K), 6, dtype=torch.long)
    else:
        _, ids = make_routing(T, E, K, gen, [0, 3, 6] if route == "empty_experts" else None)
    N = T * K
    a = align(ids, E, block_m)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, E, block_m)
    assert torch.equal(sorted_ids, a.sorted_token_ids) and torch.equal(expert_ids, a.expert_ids)
    assert sorted_ids.numel() == max_padded_rows(N, E, block_m) and sorted_ids.numel() % block_m == 0
    assert sorted_ids.numel() >= N + min(E, N) * (block_m - 1)
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    # A permutation of all pairs plus sentinels.
    real = sorted_ids[sorted_ids < N]
    assert torch.equal(real.sort().values, torch.arange(N, dtype=real.dtype))
    assert bool((sorted_ids[sorted_ids >= N] == N).all())
    counts = torch.bincount(ids.flatten(), minlength=E)
    offsets = a.expert_offsets.long()
    assert offsets[0] == 0 and int(ntpp) == int(offsets[-1])
    flat = ids.flatten()
    for e in range(E):
        start, end, c = int(offsets[e]), int(offsets[e + 1]), int(counts[e])
        assert end - start == -(-c // block_m) * block_m, f"expert {e} padding"
        seg = sorted_ids[start:end].long()
        assert torch.equal(seg[:c], torch.nonzero(flat == e).flatten()), f"expert {e}: stable order"
        assert bool((seg[c:] == N).all())
        assert bool((expert_ids[start // block_m:end // block_m] == e).all())
    assert bool((expert_ids[int(ntpp) // block_m:] == -1).all())


@pytest.mark.parametrize("case", ALIGN_CASES, ids=[c[0] for c in ALIGN_CASES])
def test_align_kernel_equals_torch_version(case):
    """The one-program kernel against the torch version, element for element (padding, unused
    blocks and offsets included); the buffers come from torch.empty, so an unwritten element shows.
    Every other case passes int32 ids (the kernel loads either width)."""
    _, T, E, K, block_m, experts = case
    ids_dtype = torch.int32 if ALIGN_CASES.index(case) % 2 else torch.int64
    _, ids = make_routing(T, E, K, torch.Generator().manual_seed(T + E), experts)
    got, want = moe_align(ids.to(ids_dtype), E, block_m), moe_align_ref(ids, E, block_m)
    for field in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded", "expert_offsets"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), field
    assert (got.block_m, got.num_pairs) == (want.block_m, want.num_pairs)


def test_align_dispatch(monkeypatch):
    """One kernel launch up to MAX_KERNEL_PAIRS pairs, the torch version above."""
    launches = []
    kernel = ma._moe_align_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(ma, "_moe_align_kernel", Counting())
    monkeypatch.setattr(ma, "MAX_KERNEL_PAIRS", 32)
    _, ids = make_routing(16, 8, 2, torch.Generator().manual_seed(0))
    moe_align(ids, 8, 16)
    assert launches == [(1,)]
    _, ids = make_routing(17, 8, 2, torch.Generator().manual_seed(0))
    a = moe_align(ids, 8, 16)
    assert launches == [(1,)] and torch.equal(a.sorted_token_ids, moe_align_ref(ids, 8, 16).sorted_token_ids)


def test_align_kernel_failure_falls_back_once_and_says_why(monkeypatch, capsys):
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("compiler said no")

    monkeypatch.setattr(ma, "_moe_align_kernel", Broken())
    monkeypatch.setattr(ma, "KERNEL_STATE", ma._KernelState())
    _, ids = make_routing(16, 8, 2, torch.Generator().manual_seed(0))
    for _ in range(2):
        assert torch.equal(moe_align(ids, 8, 16).sorted_token_ids, moe_align_ref(ids, 8, 16).sorted_token_ids)
    assert "compiler said no" in ma.KERNEL_STATE.error
    assert capsys.readouterr().err.count("moe_align kernel failed") == 1


def test_align_no_pairs_for_zero_tokens():
    a = moe_align(torch.empty(0, 2, dtype=torch.long), 4, 16)
    assert a.sorted_token_ids.numel() == 0 and int(a.num_tokens_post_padded) == 0


def test_zero_tokens():
    (x, w13, w2, tw), ids, _ = make_inputs(T=3, C=16, F=16, E=3, K=2, dtype=torch.float32, seed=1)
    y = fm.fused_moe(x[:0], w13, w2, tw[:0], ids[:0])
    assert y.shape == (0, 16)


def _bad(**changes):
    (x, w13, w2, tw), ids, _ = make_inputs(T=4, C=16, F=8, E=3, K=2, dtype=torch.float32, seed=2)
    args = {"x_TC": x.detach(), "w13_EFC": w13.detach(), "w2_ECF": w2.detach(), "topk_weights_TK": tw.detach(),
            "topk_ids_TK": ids}
    args.update({k: v(args) for k, v in changes.items()})
    return args


@pytest.mark.parametrize("changes,match", [
    ({"w2_ECF": lambda a: a["w2_ECF"][:, :, :4].contiguous()}, "w2_ECF"),
    ({"w13_EFC": lambda a: a["w13_EFC"][:, :15].contiguous()}, "w13_EFC"),
    ({"x_TC": lambda a: torch.randn(4, 12)}, "x_TC hidden dim"),
    ({"topk_ids_TK": lambda a: torch.zeros(4, 4, dtype=torch.long),
      "topk_weights_TK": lambda a: torch.rand(4, 4)}, "K=4"),
    ({"x_TC": lambda a: torch.randn(16, 4).t()}, "x_TC must be contiguous"),
    ({"w13_EFC": lambda a: a["w13_EFC"].transpose(0, 1).contiguous().transpose(0, 1)}, "w13_EFC must be contiguous"),
    ({"topk_weights_TK": lambda a: a["topk_weights_TK"].half()}, "topk_weights_TK has dtype"),
    ({"topk_ids_TK": lambda a: a["topk_ids_TK"].float()}, "topk_ids_TK must be int64"),
    ({"topk_ids_TK": lambda a: a["topk_ids_TK"][:3]}, "topk_ids_TK"),
    ({"x_TC": lambda a: a["x_TC"].long()}, "x_TC must be float"),
], ids=["w2_shape", "w13_odd_rows", "x_hidden", "K_gt_E", "x_noncontig", "w13_noncontig", "weights_dtype",
        "ids_dtype", "ids_rows", "x_dtype"])
def test_bad_inputs(changes, match):
    with pytest.raises(ValueError, match=match):
        fm.fused_moe(**_bad(**changes))


def test_bad_config():
    with pytest.raises(ValueError, match="block_m"):
        fm.MoEConfig(block_m=24, block_n=16, block_k=16)
    with pytest.raises(ValueError, match="pin_config"):
        fm.pin_config("small")
    (x, w13, _, _), ids, _ = make_inputs(T=4, C=16, F=16, E=3, K=2, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="align.block_m"):
        fm.gate_up(x, w13, moe_align(ids, 3, 32), SMALL, save_preact=False)
