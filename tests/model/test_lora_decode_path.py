"""The engine's adapter path (LoraAdapter.project) on the CPU kernel set: where add_lora put A right behind the
frozen W in one allocation, x [W; A]^T is one GEMM and the B GEMM's output takes y + s * d in place (2 linears a
projection), or csrc's lora_expand adds B's block product (1 linear); with the parameters moved apart (as .to()
or FSDP leave them) A takes a GEMM of its own. Both equal
the learner's torch path (y + (x A^T)(B * mask)^T s, model/lora.py forward) on the same weights: fp32 to the
fast path's usual bound (tests/kernels/test_fused_norm.py), bf16 to a few roundings of the hidden state.
Adapters get random non-zero B, so a path that dropped or misplaced the adapter fails."""

import dataclasses

import pytest
import torch
from torch import nn

from rlengine.model import ops as op_dispatch
from rlengine.model.attention import PackedCausal
from rlengine.model.config import preset
from rlengine.model.lora import PROJECTIONS, ADAPTER_ATTR, LoraSpec, add_lora, adapters
from rlengine.model.qwen3 import Qwen3ForCausalLM

CU = [0, 5, 12, 13]  # three packed sequences, one of a single token (a decode row)


def _model(dtype: torch.dtype) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(preset("tiny"), seed=3, dtype=dtype)
    add_lora(model, LoraSpec(r=4, alpha=8.0, targets="all-linear"), seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for a in adapters(model):
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=gen) * 0.3 * a.mask)
    return model


def _pairs(model):
    """(adapter, its projection's weight) for every adapter."""
    for layer in model.model.layers:
        for proj, (owner, _) in PROJECTIONS.items():
            holder = getattr(layer, owner)
            yield getattr(holder, ADAPTER_ATTR[proj]), getattr(holder, proj).weight


EXPANDS = ["gemm", "kernel"]  # B's product: a GEMM + add, or csrc's lora_expand (FusedOps.lora)


def _fused(model, ids, positions, expand) -> tuple[torch.Tensor, int]:
    """Hidden states [T, C] of the no-grad fast path, and how many projection GEMMs it ran."""
    calls = []

    def counted(x, w):
        calls.append(tuple(w.shape))
        return op_dispatch.CPU_OPS.linear(x, w)
    lora = None if expand == "gemm" else op_dispatch.LoraOps(lambda x, w, like: counted(x, w),
                                                             torch.ops.rlengine.lora_expand)
    ops = dataclasses.replace(op_dispatch.CPU_OPS, linear=counted, lora=lora)
    with torch.no_grad():
        h = model.model.forward_fused(model.model.embed_tokens(ids), positions,
                                      PackedCausal(CU, model.config.head_dim ** -0.5), ops)
    return h.float(), len(calls)


@pytest.mark.parametrize("expand", EXPANDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_joint_gemm_and_two_gemm_paths_equal_the_torch_path(dtype, expand):
    assert op_dispatch.CPU_OPS is not None, "the C++ extension (csrc/) is part of the build"
    model = _model(dtype)
    ids = torch.randint(3, model.config.vocab_size, (CU[-1],), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])
    want = model.model(ids, positions, PackedCausal(CU, model.config.head_dim ** -0.5)).detach().float()
    pairs = list(_pairs(model))
    assert all(a._joint(w) for a, w in pairs)  # every bias-free projection shares one allocation with its A
    joint, n_joint = _fused(model, ids, positions, expand)
    for a, _ in pairs:  # A moved into storage of its own, values unchanged
        a.lora_A = nn.Parameter(a.lora_A.detach().clone())
    assert not any(a._joint(w) for a, w in pairs)
    apart, n_apart = _fused(model, ids, positions, expand)
    per_pair = 1 if expand == "kernel" else 2  # the kernel takes B's GEMM
    assert (n_joint, n_apart) == (per_pair * len(pairs), (per_pair + 1) * len(pairs))
    # fp32: the fast path's bound against the torch path; bf16: each path rounds each sublayer's output in
    # its own order (the kernel rounds y + s d once, the torch path d, s d and the sum), up to ~2 bf16 ulps
    # (2^-8 relative) of the largest value per sublayer, two sublayers a layer
    layers = model.config.num_hidden_layers
    bound = 1e-4 if dtype == torch.float32 else 2 * 2 * layers * 2 ** -8 * want.abs().max().item()
    for got in (joint, apart):
        assert (got - want).abs().max().item() < bound
    with torch.no_grad():  # the adapters matter here: the base alone is far off
        for a, _ in pairs:
            a.enabled = False
        base = model.model(ids, positions, PackedCausal(CU, model.config.head_dim ** -0.5)).float()
    assert (base - want).abs().max().item() > 10 * bound
