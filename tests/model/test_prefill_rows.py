"""A prefill's sampled rows only: Qwen3Model.forward(rows=...) on the fused path runs the last layer's o_proj,
MLP and final norm on those rows, after attention over every token. It must equal the full forward's rows (the
same ops on fewer rows: fp32 to reassociation, bf16 to a rounding of the last sublayers), write the same K/V
(the next step reads them), and leave every other path alone. Random weights and prompts; a dense, a MoE and
a biased-q/k/v (Qwen2) model; three packed sequences of different lengths."""

import pytest
import torch

from rlengine.model.attention import PackedCausal
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM

CU = [0, 7, 19, 24]
LAST = torch.tensor(CU[1:]) - 1


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (CU[-1],), generator=g)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])
    return ids, positions


class RecordingCausal(PackedCausal):
    """PackedCausal that keeps each layer's K and V, as a cache would receive them."""

    def __init__(self, *a):
        super().__init__(*a)
        self.kv = {}

    def attend(self, layer_id, q, k, v):
        self.kv[layer_id] = (k.clone(), v.clone())
        return super().attend(layer_id, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen2"])
def test_rows_equal_the_full_forwards_rows(name, dtype):
    model = Qwen3ForCausalLM(preset(name), seed=2, dtype=dtype)
    ids, positions = _inputs(model)
    scale = model.config.head_dim ** -0.5
    full_ctx, rows_ctx = RecordingCausal(CU, scale), RecordingCausal(CU, scale)
    with torch.inference_mode():
        full = model.hidden_states(ids, positions, full_ctx, fast=True)
        got = model.hidden_states(ids, positions, rows_ctx, fast=True, rows=LAST)
    assert got.shape == (len(LAST), model.config.hidden_size)
    want = full[LAST].float()
    # fp32: the same sums over fewer rows (GEMM blocking may reassociate); bf16: the last layer's o_proj and
    # MLP outputs and the residual adds rounded again, a few bf16 ulps (2^-8 relative) of the largest value
    bound = 1e-5 * want.abs().max().item() if dtype == torch.float32 else 4 * 2 ** -8 * want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= bound
    for layer, (k, v) in full_ctx.kv.items():  # every layer's K/V for every token, bit for bit
        assert torch.equal(rows_ctx.kv[layer][0], k) and torch.equal(rows_ctx.kv[layer][1], v)


def test_rows_on_the_torch_path_select_rows():
    """fast=False (the learner's differentiable path) computes every row and returns the selected ones."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=2)
    ids, positions = _inputs(model)
    ctx = PackedCausal(CU, model.config.head_dim ** -0.5)
    with torch.no_grad():
        full = model.hidden_states(ids, positions, ctx)
        assert torch.equal(model.hidden_states(ids, positions, ctx, rows=LAST), full[LAST])


def test_engine_prefill_uses_rows_and_matches_the_full_path(monkeypatch):
    """The engine's prefill asks for the sampled rows only; its greedy tokens and log-probs equal those
    of a prefill over every row (the runner's old path, forced here by asking for prompt log-probs)."""
    from rlengine import LLM, SamplingParams

    model = Qwen3ForCausalLM(preset("tiny"), seed=3)
    seen = []
    real = model.hidden_states

    def spy(*a, rows=None, **kw):
        seen.append(rows is not None)
        return real(*a, rows=rows, **kw)
    monkeypatch.setattr(model, "hidden_states", spy)
    prompts = [[5, 9, 11, 3, 7], [4, 4, 8], [12, 6, 5, 9, 10, 2, 8]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fast = LLM(model, max_num_seqs=4).generate(prompts, sp)
    assert seen and seen[0]  # the first step is the prefill, with rows
    seen.clear()
    full = LLM(model, max_num_seqs=4).generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                      prompt_logprobs=1))
    assert seen and not seen[0]  # prompt log-probs need every row
    for a, b in zip(fast, full):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].token_logprobs), torch.tensor(b.outputs[0].token_logprobs),
                                   atol=1e-5, rtol=0)
