"""Decode graphs that run the LM head and the sampler inside, and pick their KV splits from the context.

Through cuda_graph.StaticReplay (the CPU stand-in of a CUDA graph, which re-runs the captured step on
the fixed buffers and the capture-time batch only): graph decode gives the eager engine's tokens for
greedy and seeded temperature / top-k / top-p rows (unseeded rows draw bs rows of randomness in a
graph, so only their distribution matches), and log-probs equal in fp32 and within
low_precision_bounds(L) in bf16. The Triton backend's split count follows the context inside one
bucket (a graph per split class), with no merge launch while one split covers the context.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.benchmarks.decode_launches import LaunchCounter
from rlengine.engine.cuda_graph import StaticReplay
from rlengine.model import load_pretrained

from tests.support.engine_learner_logprobs import low_precision_bounds
from tests.support.hf_models import DENSE_CONFIGS, hf_greedy, make_hf_model, random_prompts, save_hf_model

LAYERS = 2


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=LAYERS, seed=11)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("dense") / "ckpt")


MIXED = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
         SamplingParams(temperature=0.7, max_tokens=7, seed=3, ignore_eos=True),
         SamplingParams(temperature=1.0, top_k=5, max_tokens=5, seed=4, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, seed=5, ignore_eos=True),
         SamplingParams(temperature=1.3, top_k=7, top_p=0.6, max_tokens=6, seed=6, ignore_eos=True,
                        logprobs_mode="processed")]


def _run(path, params, prompts, *, graphs: bool, dtype=torch.float32):
    llm = LLM(load_pretrained(path, dtype=dtype), max_num_seqs=5, attention_backend="cpp", block_size=8)
    g = llm._use_decode_graphs(StaticReplay) if graphs else None
    return llm.generate(prompts, params), g


@pytest.mark.parametrize("case", ["greedy", "top_k", "top_p", "mixed"])
def test_graph_with_head_and_sampler_matches_eager_fp32(dense, case):
    hf, path = dense
    n = 5 if case == "mixed" else 3  # B_act 3 runs in bucket 4: a padding row
    prompts = random_prompts(n, hf.config.vocab_size, 16, seed=7)
    params = {"greedy": [MIXED[0]] * n, "top_k": [MIXED[2]] * n, "top_p": [MIXED[3]] * n, "mixed": MIXED}[case]
    outs, g = _run(path, params, prompts, graphs=True)
    eager, _ = _run(path, params, prompts, graphs=False)
    sampled = [k.sampling for bucket in g.graphs.values() for k in bucket]
    assert g.num_replays > 0 and all(s is not None for s in sampled), "head and sampler ran outside the graph"
    for a, b in zip(outs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # the same ops on each row, but the head's matmul sees bs rows instead of B: with several threads
        # the CPU's GEMM may split that reduction differently, a few ulps of fp32 (equal with one thread)
        ulps = 4 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(torch.tensor(a.outputs[0].token_logprobs),
                                   torch.tensor(b.outputs[0].token_logprobs), atol=ulps, rtol=ulps)
    if case == "greedy":
        for prompt, a in zip(prompts, outs):
            assert a.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_graph_with_head_and_sampler_bf16(dense):
    hf, path = dense
    prompts = random_prompts(4, hf.config.vocab_size, 20, seed=8)
    params = [MIXED[0], MIXED[1], MIXED[3], MIXED[0]]
    outs, g = _run(path, params, prompts, graphs=True, dtype=torch.bfloat16)
    eager, _ = _run(path, params, prompts, graphs=False, dtype=torch.bfloat16)
    worst, mean = low_precision_bounds(LAYERS)
    assert g.num_replays > 0
    diffs = []
    for a, b in zip(outs, eager):
        n = min(len(a.outputs[0].token_ids), len(b.outputs[0].token_ids))
        same = 0
        while same < n and a.outputs[0].token_ids[same] == b.outputs[0].token_ids[same]:
            same += 1
        assert same >= 1
        # compare up to the first differing token (bf16 rounding may flip a near-tie after that)
        diffs += [abs(x - y) for x, y in zip(a.outputs[0].token_logprobs[:same], b.outputs[0].token_logprobs[:same])]
    assert max(diffs) <= worst and sum(diffs) / len(diffs) <= mean


def test_rules_and_top_logprobs_keep_the_sampler_outside(dense):
    hf, path = dense
    prompts = random_prompts(3, hf.config.vocab_size, 20, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    outs, g = _run(path, params, prompts, graphs=True)
    eager, _ = _run(path, params, prompts, graphs=False)
    assert g.num_replays > 0 and any(k.sampling is None for b in g.graphs.values() for k in b)
    for a, b in zip(outs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_split_count_follows_the_context_inside_a_bucket(dense, monkeypatch):
    """One sequence in bucket 1 decodes from 3 to 15 tokens: the Triton backend plans 1 split (no merge
    launch) while one covers the context, then more as it grows, each from its own graph; tokens stay
    transformers' greedy ones. MIN_TOKENS_PER_SPLIT is lowered so a short context needs several splits."""
    from rlengine.kernels import paged_decode as pd

    hf, path = dense
    monkeypatch.setattr(pd, "MIN_TOKENS_PER_SPLIT", 4)
    llm = LLM(load_pretrained(path), max_num_seqs=2, attention_backend="triton", block_size=2, max_model_len=32)
    llm.backend.plan_for_sms(132)
    graphs = llm._use_decode_graphs(StaticReplay)
    prompt = random_prompts(2, hf.config.vocab_size, 3, seed=3)[1]
    n_new = 12
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))
    llm.step()  # prefill
    seen, outs = [], []
    while llm.has_unfinished():
        counter, captured = LaunchCounter(run_kernels=True), len(graphs.graphs.get(1, {}))
        with counter.triton_hook(), counter:
            outs += llm.step()
        runs = 1 + len(graphs.graphs[1]) - captured  # a capture runs the step once more (StaticReplay)
        ctx = len(prompt) + len(seen) + 1  # tokens the k-th decode step attends: the prompt + k outputs
        seen.append((ctx, llm.backend.num_splits, counter.outside.triton["_merge_kernel"] / runs))
    tokens = [o for o in outs if o.finished][0].outputs[0].token_ids
    assert tokens == hf_greedy(hf, prompt, n_new)
    splits = [s for _, s, _ in seen]
    assert splits[0] == 1 and max(splits) > 2 and splits == sorted(splits), seen
    for ctx, s, merges in seen:
        pages = -(-ctx // 2)
        assert s == next(b for b in _classes(llm, pages)), (ctx, s)
        assert merges == (0 if s == 1 else LAYERS), (ctx, s, merges)
    assert len(graphs.graphs[1]) == len(set(splits)) > 2


def _classes(llm, pages):
    """The split count of the smallest page bound >= pages (the graph the step runs in)."""
    bounds = llm.backend.graph_page_bounds(1, llm.runner.inputs.max_pages)
    bound = next(b for b in bounds if b >= pages)
    yield llm.backend.splits(1, bound)
