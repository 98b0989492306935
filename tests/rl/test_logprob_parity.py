"""Generator vs learner log-probs: the engine's fused inference path against the learner's training
forward (grad enabled), in fp32, bf16 and (Triton kernels under the interpreter) fp16.

The engine samples from fp32 logits of its fused no-grad forward (compute_logits); the learner
recomputes log_softmax(logits / T) at the same tokens through the differentiable torch forward and
the log-prob kernel (or its reference). Which forward runs is an explicit argument (fast=...), never
grad mode. fp32: both are the same math to rounding (< 1e-5). Low precision: the two forwards round
the residual stream and sublayer outputs to bf16/fp16 at different points (a fused kernel keeps fp32
inside it), a few ulps (2^-8 relative for bf16) of the hidden state after 2 layers; with |logit| <= ~1
here that bounds a per-token log-prob difference by 2^-6 and its mean by 2^-9 (measured on this CPU:
bf16 max 2-5e-3, mean 6e-4).
"""

import pytest
import torch

from rlengine.model.config import preset
from rlengine.model import qwen3
from rlengine.model.qwen3 import Qwen3ForCausalLM

from tests.support.engine_learner_logprobs import MAX_LOW, MEAN_LOW, learner_minus_engine, rollout_batch


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_fp32_training_forward_matches_engine(name):
    model = Qwen3ForCausalLM(preset(name), seed=5)
    d = learner_minus_engine(model, rollout_batch(model), fused=False)
    assert d.max() < 1e-5, f"max |learner - engine| {d.max():.2e}"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_bf16_training_forward_matches_engine_within_rounding(name):
    model = Qwen3ForCausalLM(preset(name), seed=5, dtype=torch.bfloat16)
    d = learner_minus_engine(model, rollout_batch(model), fused=False)
    assert d.max() < MAX_LOW and d.mean() < MEAN_LOW, (d.max().item(), d.mean().item())


def test_fp16_triton_paths_match_under_the_interpreter(monkeypatch):
    """The GPU pairing: Triton fused norms in the engine, the fused log-prob kernel in the learner."""
    if qwen3.triton_ops() is None:
        pytest.fail("triton is a dependency on Linux and must import")
    monkeypatch.setattr(qwen3, "fused_ops_for", lambda device: qwen3.triton_ops())
    model = Qwen3ForCausalLM(preset("tiny"), seed=5, dtype=torch.float16)
    batch = rollout_batch(model, G=2, prompts=2, max_tokens=4, backend="torch")
    d = learner_minus_engine(model, batch, fused=True)
    assert d.max() < MAX_LOW and d.mean() < MEAN_LOW, (d.max().item(), d.mean().item())


def test_engine_logits_are_fp32_accumulated_not_rounded():
    """compute_logits of a bf16 model: fp32 out, equal to the fp32 product of the bf16 inputs, while a
    bf16 LM head (the old behaviour) is off by up to half a bf16 ulp of each logit."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=3, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits of size 10-20, where bf16 rounding is 0.03-0.06
        h = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
        got = model.compute_logits(h)
        ref = h.double() @ model.lm_head.weight.double().T
        old = model.lm_head(h)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (old.double() - ref).abs().max() > 1e-2


def test_fast_path_is_an_explicit_choice_and_refuses_autograd():
    model = Qwen3ForCausalLM(preset("tiny"), seed=1)
    ids = torch.randint(0, 200, (2, 7))
    with torch.no_grad():
        slow, fast = model(ids), model(ids, fast=True)
    assert (slow - fast).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="no autograd"):
        model(ids, fast=True)  # grad enabled: the fused ops cannot backpropagate
