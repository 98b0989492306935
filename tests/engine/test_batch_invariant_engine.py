"""Batch-invariant mode on the engine (LLM(batch_invariant=True)): a prompt's tokens and log-probs
do not depend on what else is decoded with it, and the learner's recomputation equals them.

Equality is torch.equal / ==, never a tolerance: that is what the mode promises. Sampling uses
per-request seeds, so a sample's draws depend only on its seed, its positions and its logits.
The break tests put back one batch-dependent path (a row-count switch in the linear; the default
decode kernel, whose reduction follows the page layout instead of fixed key chunks) and check
that the same comparisons then fail, so the passing ones can fail.
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.engine.attention.invariant_backend import InvariantBackend
from rlengine.engine.cuda_graph import StaticReplay
from rlengine.model import batch_invariant as inv
from rlengine.model import load_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.learner import processed_token_logprobs, token_logprobs

from tests.support.engine_learner_logprobs import rollout_batch
from tests.support.hf_models import ARCH_CONFIGS, make_hf_arch_model, save_hf_model

DTYPES = [torch.float32, torch.bfloat16]


def _model(dtype=torch.float32, name="tiny", seed=5):
    model = Qwen3ForCausalLM(preset(name), seed=seed, dtype=dtype)
    model.batch_invariant = True
    return model


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(L),), generator=g).tolist() for L in torch.randint(1, 40, (n,), generator=g)]


def _params(i, **kw):
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=kw.pop("max_tokens", 16), ignore_eos=True, **kw)


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, torch.tensor(o.outputs[0].token_logprobs)) for o in outs], outs


def _alone_vs_batch(model, **llm_kw):
    prompts = _prompts(41, model.config.vocab_size, seed=7)
    params = [_params(i) for i in range(41)]
    alone, _ = _run(LLM(model, max_num_seqs=1, batch_invariant=True), prompts[:1], params[:1])
    batched, outs = _run(LLM(model, max_num_seqs=41, batch_invariant=True, **llm_kw), prompts, params)
    return alone[0], batched[0], outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_alone_and_among_40_others_gets_the_same_tokens_and_logprobs(dtype):
    (tok_a, lp_a), (tok_b, lp_b), outs = _alone_vs_batch(_model(dtype))
    assert max(r.b_act for r in outs.trace if r.kind == "decode") > 30
    assert tok_a == tok_b and torch.equal(lp_a, lp_b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_under_forced_preemption_and_recompute(dtype):
    (tok_a, lp_a), (tok_b, lp_b), outs = _alone_vs_batch(_model(dtype), block_size=4, num_kv_blocks=60)
    assert outs.stats["preemptions"] > 0 and outs.stats["recomputed_tokens"] > 0
    assert tok_a == tok_b and torch.equal(lp_a, lp_b)


def test_the_same_through_the_graph_replay_stand_in():
    model = _model(torch.bfloat16)
    prompts = _prompts(13, model.config.vocab_size, seed=8)
    params = [_params(i, max_tokens=3 + i % 7) for i in range(13)]  # ragged: padded buckets
    eager, _ = _run(LLM(model, max_num_seqs=1, batch_invariant=True), prompts[:1], params[:1])
    llm = LLM(model, max_num_seqs=13, batch_invariant=True)
    graphs = llm._use_decode_graphs(StaticReplay)
    replayed, outs = _run(llm, prompts, params)
    decode_bs = {r.b_act for r in outs.trace if r.kind == "decode"}
    assert graphs.num_replays > 0 and decode_bs - set(graphs.sizes), "no step ran in a padded bucket"
    assert eager[0][0] == replayed[0][0] and torch.equal(eager[0][1], replayed[0][1])


def _arch_model(name, tmp_path, dtype):
    family, overrides = ARCH_CONFIGS[name]
    hf = make_hf_arch_model(family, overrides, seed=3)
    model = load_pretrained(save_hf_model(hf, tmp_path / name)).to(dtype)
    model.batch_invariant = True
    return model


def _learner_equals_engine(model, **gen):
    batch = rollout_batch(model, G=3, prompts=4, max_tokens=9, **gen)
    valid = batch.loss_mask > 0
    return batch, valid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["tiny", "qwen2_gqa_tied", "llama3_hd16_untied"])
def test_every_sampled_logprob_equals_the_learners_recomputation(arch, dtype, tmp_path):
    """Raw mode through the learner's training forward (grad on): torch.equal on every token."""
    model = _model(dtype) if arch == "tiny" else _arch_model(arch, tmp_path, dtype)
    batch = rollout_batch(model)
    logp, _ = token_logprobs(model, batch, 1.0, fused=False)
    assert logp.requires_grad
    valid = batch.loss_mask > 0
    assert valid.sum() > 20 and torch.equal(logp.detach()[valid], batch.old_logprobs[valid])


@pytest.mark.parametrize("dtype", DTYPES)
def test_processed_logprobs_equal_the_learners_too(dtype, monkeypatch):
    """top-k / top-p filtered sampling, log-probs of the filtered distribution on both sides."""
    from tests.support import engine_learner_logprobs as support

    model = _model(dtype)
    real = support.SamplingParams

    def filtered(**kw):
        return real(top_k=20, top_p=0.9, logprobs_mode="processed", **kw)
    monkeypatch.setattr(support, "SamplingParams", filtered)
    batch = rollout_batch(model)
    logp, _ = processed_token_logprobs(model, batch, 1.0, 20, 0.9)
    valid = batch.loss_mask > 0
    assert torch.equal(logp.detach()[valid], batch.old_logprobs[valid])


def test_the_learners_backward_runs_and_matches_the_default_modes_gradients():
    """Only the forward changes: the invariant forward's gradients are the ordinary ones (fp32). The two
    forwards differ by fp32 rounding (~1e-7 relative), which the backward carries: each parameter's
    gradient agrees to 1e-5 of its norm (a dropped term, e.g. a missing bias gradient, is O(1))."""
    model = _model(torch.float32)
    batch = rollout_batch(model)
    grads = {}
    for mode, ckpt in ((True, False), (True, True), (False, False)):  # with activation checkpointing too
        model.batch_invariant = mode
        model.zero_grad()
        logp, _ = token_logprobs(model, batch, 1.0, fused=False, checkpoint_layers=ckpt)
        (logp * batch.loss_mask).sum().backward()
        grads[mode, ckpt] = [p.grad.clone() for p in model.parameters()]
    for key in ((True, False), (True, True)):
        for a, b in zip(grads[key], grads[False, False]):
            assert (a - b).norm() <= 1e-5 * b.norm(), (key, (a - b).norm().item(), b.norm().item())


# ---- the tests above can fail: put back one batch-dependent path ------------------------------
def test_a_row_count_dependent_linear_breaks_alone_vs_batch(monkeypatch):
    real = inv.linear

    def by_rows(x, w, bias=None):  # at::linear for more than one row, the invariant kernel for one
        return F.linear(x, w, bias) if x.reshape(-1, x.shape[-1]).shape[0] > 1 else real(x, w, bias)
    monkeypatch.setattr(inv, "linear", by_rows)
    (tok_a, lp_a), (tok_b, lp_b), _ = _alone_vs_batch(_model(torch.float32))
    assert tok_a != tok_b or not torch.equal(lp_a, lp_b)


def test_a_decode_split_tied_to_the_page_layout_breaks_engine_vs_learner(monkeypatch):
    def layout_order(self, layer_id, q_BHD, k_cache, v_cache):  # the default kernel: page-by-page order
        b = self.batch
        torch.ops.rlengine.paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                        self.scale, self.step_out)
        return self.step_out
    monkeypatch.setattr(InvariantBackend, "decode", layout_order)
    model = _model(torch.float32)
    batch = rollout_batch(model)
    logp, _ = token_logprobs(model, batch, 1.0, fused=False)
    valid = batch.loss_mask > 0
    assert not torch.equal(logp.detach()[valid], batch.old_logprobs[valid])


# ---- what the mode refuses --------------------------------------------------------------------
def test_other_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="attention_backend='cpp'"):
        LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), batch_invariant=True, attention_backend="cpp")
    with pytest.raises(ValueError, match="pass batch_invariant=True"):
        LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), attention_backend="invariant")


def test_an_engine_on_an_invariant_model_follows_it():
    llm = LLM(_model(), max_num_seqs=2)
    assert llm.attention_backend == "invariant" and llm.runner.sampler.invariant
    assert not llm.backend.shared_prefix  # no cascade pass: each query reads its own prefix in the chunk grid
    assert llm.cpu_kernels() == "batch_invariant"
