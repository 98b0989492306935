"""The "sorted" fused MoE backward (kernels/fused_moe_bwd.py) against the plain-torch loop over experts.

Runs under TRITON_INTERPRET=1 in fp32 and fp16 at tiny shapes. The pinned config gives each kernel
its own tiles, with the weight-gradient kernel reducing 32 rows a step over 16-row expert segments,
so a step spans several experts' segments and must mask the rows past its own. Forward, dx, dW13,
dW2 and d topk_weights share one upstream gradient.
"""

import pytest
import torch

from rlengine.kernels import fused_moe as fm
from rlengine.kernels import fused_moe_bwd as bwd
from rlengine.kernels import moe_gemm as gemm
from rlengine.kernels import moe_tuning as tuning
from rlengine.kernels.moe_align import max_padded_rows

from tests.kernels.test_fused_moe import check_against_ref
from tests.support.moe_cases import make_inputs
from tests.support.tolerances import tol

TILES = (("down_bwd", gemm.Tiles(block_n=16, block_k=32)), ("dx", gemm.Tiles(block_n=32, block_k=16)),
         ("wgrad", gemm.Tiles(block_n=16, block_k=32, block_p=16)))
SORTED_SMALL = gemm.MoEConfig(block_m=16, block_n=16, block_k=16, wgrad_block=16, wgrad_block_r=16, kernel_tiles=TILES)
DTYPES = [torch.float32, torch.float16]


def _skewed_ids(T, E, K, gen):
    """Uneven routing: every token's first expert is 0 (three blocks of rows), the rest random."""
    rest = 1 + torch.rand(T, E - 1, generator=gen).argsort(dim=1)[:, :K - 1]
    return torch.cat([torch.zeros(T, 1, dtype=torch.long), rest], dim=1).contiguous()


# (id, T, C, F, E, K, experts routed to or None, ids builder or None): the path each covers
CASES = [
    ("single_token", 1, 32, 16, 4, 2, None, None),
    ("empty_experts_odd_dims", 20, 47, 23, 7, 2, [0, 2, 3, 6], None),
    ("uneven_routing", 40, 32, 16, 5, 2, None, _skewed_ids),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sorted_backward_matches_ref(case, dtype):
    _, T, C, F, E, K, experts, build = case
    gen = torch.Generator().manual_seed(T)
    ids = build(T, E, K, gen) if build else None
    leaves, ids, dy = make_inputs(T, C, F, E, K, dtype, seed=CASES.index(case) + 20, experts=experts, ids=ids)
    with fm.pin_config(SORTED_SMALL):
        check_against_ref(leaves, ids, dy, backward="sorted")


@pytest.mark.parametrize("wants", [(True, False, False, True), (False, False, True, False),
                                   (False, True, False, False)], ids=["x_and_router", "w2_only", "w13_only"])
def test_gradient_subsets(wants):
    """Leaves that do not require grad: dx alone, and each half of the persistent dW launch alone."""
    (x, w13, w2, tw), ids, dy = make_inputs(T=17, C=32, F=16, E=5, K=2, dtype=torch.float32, seed=4)
    leaves = [t.detach().requires_grad_(w) for t, w in zip((x, w13, w2, tw), wants)]
    asked = [t for t in leaves if t.requires_grad]
    with fm.pin_config(SORTED_SMALL):
        got = torch.autograd.grad(fm.fused_moe(*leaves, ids, backward="sorted"), asked, dy)
    want = torch.autograd.grad(fm.fused_moe_ref(*leaves, ids), asked, dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **tol(torch.float32))


def test_poisoned_buffers_and_padding_rows(monkeypatch):
    """Every buffer from gemm.alloc starts as nan: the sorted gu and dgu keep nan in their padding
    rows, which the dx and weight-gradient kernels must never read."""
    (x, w13, w2, tw), ids, dy = make_inputs(T=13, C=32, F=16, E=5, K=2, dtype=torch.float32, seed=11, experts=[0, 2, 4])
    monkeypatch.setattr(gemm, "alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                              device=device))
    with fm.pin_config(SORTED_SMALL):
        check_against_ref([x, w13, w2, tw], ids, dy, backward="sorted")


def test_no_pair_major_round_trip(monkeypatch):
    """The sorted backward allocates neither dx per pair [N, C] nor hw = w*h [N, F]; v1 does both."""
    T, C, F, E, K = 9, 48, 16, 3, 2
    (x, w13, w2, tw), ids, dy = make_inputs(T, C, F, E, K, torch.float32, seed=5)
    shapes = {}
    real_alloc = gemm.alloc
    for variant in ("v1", "sorted"):
        with fm.pin_config(SORTED_SMALL):
            y = fm.fused_moe(x, w13, w2, tw, ids, backward=variant)
            seen = shapes[variant] = []
            monkeypatch.setattr(gemm, "alloc", lambda s, d, dev: seen.append(tuple(s)) or real_alloc(s, d, dev))
            torch.autograd.grad(y, [x, w13, w2, tw], dy)
            monkeypatch.setattr(gemm, "alloc", real_alloc)
    N = T * K
    assert (N, C) in shapes["v1"] and (N, F) in shapes["v1"]
    assert (N, C) not in shapes["sorted"] and (N, F) not in shapes["sorted"], shapes["sorted"]


def test_persistent_grid_walks_every_tile():
    """Three programs under the interpreter: each walks a strided share of the (expert, tile) list."""
    assert bwd.persistent_programs(torch.device("cpu"), 100) == 3
    assert bwd.persistent_programs(torch.device("cpu"), 2) == 2


def test_bad_backward_name_and_tiles():
    (x, w13, w2, tw), ids, _ = make_inputs(T=4, C=16, F=16, E=3, K=2, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="backward must be one of"):
        fm.fused_moe(x, w13, w2, tw, ids, backward="fast")
    with pytest.raises(ValueError, match="Tiles.block_p"):
        gemm.Tiles(block_n=16, block_k=16, block_p=24)
    with pytest.raises(ValueError, match="kernel_tiles"):
        gemm.MoEConfig(block_m=16, block_n=16, block_k=16, kernel_tiles=(("nope", gemm.Tiles(block_n=16, block_k=16)),))


def test_tuner_picks_the_fastest_within_its_budget():
    """A fake timer: the tuner keeps the fastest candidate, stops trying new ones once the budget is
    spent, and answers a known key from its cache without running anything."""
    cands = (gemm.Tiles(block_n=16, block_k=16), gemm.Tiles(block_n=32, block_k=16), gemm.Tiles(block_n=64, block_k=16))
    cost = {16: 3.0, 32: 1.0, 64: 0.5}
    ran = []
    tuner = tuning.Tuner(budget_s=1e9, timer=lambda fn, reps: (fn(), cost[ran[-1].block_n])[1])
    assert tuner.pick("k", cands, ran.append) == cands[2]
    assert [t.block_n for t in ran] == [16, 16, 32, 32, 64, 64]  # a warm-up run and a timed run each
    ran.clear()
    assert tuner.pick("k", cands, ran.append) == cands[2] and ran == []
    capped = tuning.Tuner(budget_s=0.0, timer=lambda fn, reps: (fn(), cost[ran[-1].block_n])[1])
    assert capped.pick("k", cands, ran.append) == cands[0] and len(capped.log) == 1


def test_tuned_launch_without_a_gpu_runs_the_first_candidate():
    """Under the interpreter no timing: the first candidate of the class, clipped to the dims; a
    pinned config or a class without candidates (decode) runs the call's config as given."""
    base = gemm.MoEConfig(block_m=64, block_n=64, block_k=64)
    got = tuning.tuned_launch("wgrad", base, (1 << 20, 128, 2048, 768), torch.device("cpu"), torch.float16, lambda c: c)
    assert got.tiles("wgrad") == tuning.CANDIDATES["wgrad"]["large"][0] and got.tiles("dx") == base.tiles(None)
    cpu = torch.device("cpu")
    clipped = tuning.tuned_launch("wgrad", base, (1 << 20, 128, 32, 48), cpu, torch.float16, lambda c: c)
    assert clipped.tiles("wgrad").block_p == 32 and clipped.tiles("wgrad").block_n == 32  # next_pow2(min(C, F))
    assert tuning.tuned_launch("wgrad", base, (64, 128, 2048, 768), cpu, torch.float16, lambda c: c) is base
    with fm.pin_config(SORTED_SMALL):
        assert tuning.tuned_launch("wgrad", base, (1 << 20, 128, 2048, 768), torch.device("cpu"), torch.float16,
                                   lambda c: c) is base


@pytest.mark.parametrize("variant,path", [("v1", "fused_v1"), ("sorted", "fused_sorted")])
def test_saved_tensors_match_the_memory_plan_terms(variant, path):
    """What FusedMoEFunction saves beyond its inputs is the pre-activations gu alone ([N, 2F] by pair,
    [N_pad, 2F] sorted): SwiGLU's output is not stored. The plan's fused terms bound it, and the
    torch path's terms (what the plan uses) bound those."""
    from rlengine.analysis.activations import moe_expert_bytes
    from rlengine.model.config import ModelConfig

    T, C, F, E, K = 24, 32, 16, 6, 2
    leaves, ids, _ = make_inputs(T, C, F, E, K, torch.float16, seed=9)
    inputs = {t.data_ptr() for t in leaves}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with fm.pin_config(gemm.MoEConfig(block_m=16, block_n=16, block_k=16)):
            fm.fused_moe(*leaves, ids, backward=variant)
    extra = [t for t in saved if t.data_ptr() not in inputs]
    rows = T * K if variant == "v1" else max_padded_rows(T * K, E, 16)
    assert [tuple(t.shape) for t in extra] == [(rows, 2 * F)]
    cfg = ModelConfig(vocab_size=64, hidden_size=C, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F)
    per_tok, _, per_layer, _ = moe_expert_bytes(cfg, 2, path)
    assert sum(t.numel() * t.element_size() for t in extra) <= T * per_tok + per_layer
    torch_saved, torch_transient, _, _ = moe_expert_bytes(cfg, 2, "torch")
    for big in (512, 32768):  # training micro-batches (the sorted padding is per layer, E x 63 rows)
        ours = moe_expert_bytes(cfg, 2, path)
        assert big * ours[0] + ours[2] <= big * torch_saved
        assert big * ours[1] + ours[3] <= big * torch_transient


def test_the_sm90_tier_compiles_every_candidate():
    """tools/sm90/cases.py compiles candidates 0..n-1 of each training shape class of Qwen3-30B-A3B:
    n must be the longest candidate list of that class (a candidate added here joins the tier)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools.sm90.cases import MOE_SORTED_CANDIDATES, MOE_TOKENS

    classes = [gemm.shape_class(T * 8, 128) for T in MOE_TOKENS[2:]]
    assert {c for per in tuning.CANDIDATES.values() for c in per} == set(classes)
    for cls, n in zip(classes, MOE_SORTED_CANDIDATES):
        assert n == max(len(per[cls]) for per in tuning.CANDIDATES.values()), cls
