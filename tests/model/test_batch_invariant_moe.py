"""Batch-invariant mode on a Qwen3-MoE model (model/batch_invariant_moe.py), on the CPU.

Equality checks are torch.equal / ==: a prompt alone and among 40 others, the engine against the
learner's recomputation, routing replay. The block is also checked against the default block's
plain-torch reference (moe_experts_ref), forward and every gradient, to fp32 rounding: the mode
changes the order of sums, not the function. The break test puts back one batch-dependent order (an
expert GEMM that switches kernel by its token count) and checks that the equality then fails.
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine.model.config import preset
from rlengine.model import batch_invariant as inv
from rlengine.model import batch_invariant_moe as inv_moe
from rlengine.model.moe import SparseMoeBlock, moe_experts_ref, route
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.learner import token_logprobs

from tests.engine.test_batch_invariant_engine import _alone_vs_batch
from tests.support.engine_learner_logprobs import rollout_batch

DTYPES = [torch.float32, torch.bfloat16]


def _model(dtype=torch.float32, seed=5):
    model = Qwen3ForCausalLM(preset("tiny-moe"), seed=seed, dtype=dtype)
    model.batch_invariant = True
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_alone_and_among_40_others_gets_the_same_tokens_and_logprobs(dtype):
    (tok_a, lp_a), (tok_b, lp_b), outs = _alone_vs_batch(_model(dtype))
    assert max(r.b_act for r in outs.trace if r.kind == "decode") > 30
    assert tok_a == tok_b and torch.equal(lp_a, lp_b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_sampled_logprob_equals_the_learners_recomputation(dtype):
    model = _model(dtype)
    batch = rollout_batch(model)
    logp, _ = token_logprobs(model, batch, 1.0, fused=False)
    assert logp.requires_grad
    valid = batch.loss_mask > 0
    assert valid.sum() > 20 and torch.equal(logp.detach()[valid], batch.old_logprobs[valid])


def _block(C=24, F_=16, E=7, K=3, seed=0, norm=True):
    torch.manual_seed(seed)
    block = SparseMoeBlock(C, F_, E, K, norm_topk_prob=norm)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


# prime E; K = 1 (unnormalised: normalised, its weight is exactly 1 and the router gets no gradient); K = E
@pytest.mark.parametrize("E,K,norm", [(7, 3, True), (7, 3, False), (5, 1, False), (4, 4, True)])
def test_the_block_equals_the_reference_block_with_the_same_gradients(E, K, norm):
    """fp32: the orders differ, so rounding does. Each sum over C, F or K terms rounds by ~2^-24 of its
    terms' magnitude, not of the result (which can cancel), so the bound is relative to the output's
    scale: 1e-5 of max|y| per element (a dropped slot or expert is O(max|y|))."""
    block = _block(E=E, K=K, norm=norm)
    x = torch.randn(37, 24, requires_grad=True)
    g = torch.randn(37, 24)
    outs, grads = [], []
    for invariant in (True, False):
        block.zero_grad()
        x.grad = None
        if invariant:
            y = inv_moe.moe_block(block, x)
        else:
            w, ids = route(block.gate(x), K, norm)
            y = moe_experts_ref(x, block.w13, block.w2, w, ids)
        (y * g).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in block.parameters()])
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[1].abs().max()
    for a, b in zip(*grads):
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_a_row_gets_the_same_bits_alone_and_in_batches_of_any_size():
    """Routing spreads the rows differently over the experts at each size: 1, 7, 64 and 513 rows."""
    block = _block(E=7, K=3, seed=1)
    xs = torch.randn(513, 24)
    with torch.no_grad():
        alone = inv_moe.moe_block(block, xs[:1])
        for n in (1, 7, 64, 513):
            assert torch.equal(inv_moe.moe_block(block, xs[:n])[:1], alone)


def test_routing_replay_is_exact_and_reports_no_disagreement():
    block = _block(E=7, K=2, seed=2)
    x = torch.randn(40, 24)
    block.record_ids = True
    with torch.no_grad():
        own = inv_moe.moe_block(block, x)
        block.replay_ids = block.last_ids.clone()
        replayed = inv_moe.moe_block(block, x)
    assert torch.equal(own, replayed) and block.last_disagreement.item() == 0.0


def test_an_empty_batch_gives_an_empty_output():
    block = _block()
    assert inv_moe.moe_block(block, torch.randn(0, 24)).shape == (0, 24)


# ---- the equality tests above can fail: put back one batch-dependent order -------------------
def test_an_expert_gemm_that_switches_kernel_by_token_count_breaks_alone_vs_batch(monkeypatch):
    real = inv.linear

    def by_rows(x, w, bias=None):  # at::linear once an expert has several rows
        return F.linear(x, w, bias) if x.reshape(-1, x.shape[-1]).shape[0] > 4 else real(x, w, bias)
    monkeypatch.setattr(inv_moe.inv, "linear", by_rows)
    block = _block(E=3, K=2, seed=3, C=64, F_=96)
    xs = torch.randn(64, 64)
    with torch.no_grad():
        assert not torch.equal(inv_moe.moe_block(block, xs)[:1], inv_moe.moe_block(block, xs[:1]))
