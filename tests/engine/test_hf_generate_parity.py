"""Engine greedy parity with transformers' generate(), and log-prob parity with its logits.

Ragged batch of 16+ prompts (lengths 1..~200) on random tiny Qwen3 and Qwen3-MoE models in
fp32, max_num_seqs smaller than the batch (so continuous batching admits work mid-flight),
for every backend that runs on the CPU (torch, cpp; triton under the interpreter on a
smaller case).
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model import load_pretrained

from tests.support.hf_models import DENSE_CONFIGS, MOE_CONFIGS, hf_greedy, make_hf_model, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind, overrides in [("dense", DENSE_CONFIGS["dense_gqa2_untied"]), ("moe", MOE_CONFIGS["moe_top2_norm"])]:
        hf = make_hf_model(kind, overrides, layers=2, seed=11)
        path = save_hf_model(hf, tmp_path_factory.mktemp(kind) / "ckpt")
        out[kind] = (hf, path)
    return out


CASES = [("dense", "torch", 16, 200, 12), ("moe", "torch", 16, 200, 12),
         ("dense", "cpp", 16, 200, 12), ("moe", "cpp", 16, 200, 12),
         ("dense", "triton", 4, 40, 4), ("moe", "triton", 3, 24, 3)]


@pytest.mark.parametrize("kind,backend,num_prompts,max_len,max_new", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_greedy_matches_transformers(models, kind, backend, num_prompts, max_len, max_new):
    hf, path = models[kind]
    prompts = random_prompts(num_prompts, hf.config.vocab_size, max_len, seed=len(kind) + num_prompts)
    llm = LLM(load_pretrained(path), max_num_seqs=max(2, num_prompts // 3), attention_backend=backend,
              block_size=8 if backend != "triton" else 4)
    assert llm.attention_backend == backend
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, max_new), f"prompt of length {len(prompt)}"
    # continuous batching actually ran decode steps with a partial batch, and admitted work later
    assert max(r.b_act for r in outs.trace if r.kind == "decode") <= llm.max_num_seqs
    assert sum(r.kind == "prefill" for r in outs.trace) > 1

    # returned log-probs = log_softmax of transformers' logits at the same tokens
    for prompt, out in list(zip(prompts, outs))[:6]:
        toks = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1]
        ref = logits.log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        assert (torch.tensor(out.outputs[0].token_logprobs) - ref).abs().max() < 1e-4


def test_sampled_logprobs_use_temperature(models):
    hf, path = models["dense"]
    prompts = random_prompts(4, hf.config.vocab_size, 30, seed=3)
    llm = LLM(load_pretrained(path), max_num_seqs=4, attention_backend="torch")
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=6, seed=1,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1] / 0.7
        ref = logits.log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        assert (torch.tensor(out.outputs[0].token_logprobs) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_unwritten_cache_memory_never_leaks_into_outputs(models, backend):
    """Cache slots no sequence wrote (here: NaN) must not reach any output, whatever the padding."""
    hf, path = models["dense"]
    prompts = random_prompts(6, hf.config.vocab_size, 40, seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    clean = LLM(load_pretrained(path), max_num_seqs=3, attention_backend=backend).generate(prompts, params)
    llm = LLM(load_pretrained(path), max_num_seqs=3, attention_backend=backend)
    llm.kv_cache.data.fill_(float("nan"))
    dirty = llm.generate(prompts, params)
    for a, b in zip(clean, dirty):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert all(lp == lp for lp in b.outputs[0].token_logprobs), "NaN log-prob"
