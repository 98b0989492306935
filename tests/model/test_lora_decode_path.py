"""The engine's adapter path (LoraAdapter.project) on the CPU kernel set: where add_lora put A right behind the
frozen W in one allocation, x [W; A]^T is one GEMM and the B GEMM's output takes y + s * d in place (2 linears a
projection); with the parameters moved apart (as .to() or FSDP leave them) it falls back to three. Both equal
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


def _fused(model, ids, positions) -> tuple[torch.Tensor, int]:
    """Hidden states [T, C] of the no-grad fast path, and how many projection GEMMs it ran."""
    calls = []

    def counted(x, w):
        calls.append(tuple(w.shape))
        return op_dispatch.CPU_OPS.linear(x, w)
    ops = dataclasses.replace(op_dispatch.CPU_OPS, linear=counted)
    with torch.no_grad():
        h = model.model.forward_fused(model.model.embed_tokens(ids), positions,
                                      PackedCausal(CU, model.config.head_dim ** -0.5), ops)
    return h.float(), len(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_joint_gemm_and_two_gemm_paths_equal_the_torch_path(dtype):
    assert op_dispatch.CPU_OPS is not None, "the C++ extension (csrc/) is part of the build"
    model = _model(dtype)
    ids = torch.randint(3, model.config.vocab_size, (CU[-1],), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])
    want = model.model(ids, positions, PackedCausal(CU, model.config.head_dim ** -0.5)).detach().float()
    pairs = list(_pairs(model))
    assert all(a._joint(w) for a, w in pairs)  # every bias-free projection shares one allocation with its A
    joint, n_joint = _fused(model, ids, positions)
    for a, _ in pairs:  # A moved into storage of its own, values unchanged
        a.lora_A = nn.Parameter(a.lora_A.detach().clone())
    assert not any(a._joint(w) for a, w in pairs)
    apart, n_apart = _fused(model, ids, positions)
    assert (n_joint, n_apart) == (2 * len(pairs), 3 * len(pairs))
    # fp32: the fast path's bound against the torch path; bf16: each path rounds the hidden state's
    # sublayer outputs in its own order, a few bf16 ulps (2^-8 relative) of the largest value
    bound = 1e-4 if dtype == torch.float32 else 4 * 2 ** -8 * want.abs().max().item()
    for got in (joint, apart):
        assert (got - want).abs().max().item() < bound
    with torch.no_grad():  # the adapters matter here: the base alone is far off
        for a, _ in pairs:
            a.enabled = False
        base = model.model(ids, positions, PackedCausal(CU, model.config.head_dim ** -0.5)).float()
    assert (base - want).abs().max().item() > 10 * bound
