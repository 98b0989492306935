"""Engine features beyond greedy parity: prefix fork, KV exhaustion, bad input, step API, finish reasons.

Everything runs on the `tiny` / `tiny-moe` presets in fp32 on the CPU. The references are
the engine itself under conditions where the feature under test cannot act: n = 1 requests
instead of a forked group, an unconstrained KV cache instead of a tiny one, a clean run
instead of one that saw a bad request. Tokens must match exactly; log-probs to fp32
rounding, because a preempted sequence is recomputed by a prefill (packed causal SDPA)
where the reference ran paged decode, and the two round differently.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.engine.sampling_params import sample_seed
from rlengine.model import Qwen3ForCausalLM

from tests.support.tolerances import tol


def _prompts(lengths, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_same(outs, refs):
    """Same tokens exactly, log-probs to fp32 rounding, per sample."""
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert len(out.outputs) == len(ref.outputs)
        for a, b in zip(out.outputs, ref.outputs):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), **tol(torch.float32))


def _llm(name="tiny", **kw):
    kw.setdefault("dtype", "float32")
    return LLM(name, **kw)


# ---- prefix fork ---------------------------------------------------------------------------
# prompt length 13 with P = 8 leaves the shared last block partial (copy-on-write on the first
# decode write); 16 is an exact multiple (the first decode opens a fresh block, nothing to copy).
FORK_CASES = [("tiny", "cpp", 13), ("tiny", "cpp", 16), ("tiny", "torch", 13), ("tiny-moe", "cpp", 13)]


@pytest.mark.parametrize("model,backend,prompt_len", FORK_CASES, ids=[f"{m}-{b}-len{n}" for m, b, n in FORK_CASES])
def test_fork_prefills_once_and_matches_independent_requests(model, backend, prompt_len):
    G, seed, P = 4, 123, 8
    prompt = _prompts([prompt_len])[0]
    llm = _llm(model, attention_backend=backend, block_size=P, max_num_seqs=8)
    copies = []
    copy_blocks = llm.kv_cache.copy_blocks
    llm.kv_cache.copy_blocks = lambda src, dst: (copies.extend(zip(src.tolist(), dst.tolist())), copy_blocks(src, dst))
    params = SamplingParams(n=G, seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([prompt], params)

    prefills = [r for r in outs.trace if r.kind == "prefill"]
    assert sum(r.tokens for r in prefills) == prompt_len, "the prompt must be prefilled once, not G times"
    assert sum(r.num_seqs_prefilled for r in prefills) == G
    # copy-on-write exactly when the shared last block is partial: one copy per sibling but the last writer
    assert len(copies) == (G - 1 if prompt_len % P else 0)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks

    ref_llm = _llm(model, attention_backend=backend, block_size=P, max_num_seqs=8)
    # the documented seed property: sample i of (n = G, seed s) == the one sample of (n = 1, sample_seed(s, i))
    refs = ref_llm.generate([prompt] * G, [SamplingParams(n=1, seed=sample_seed(seed, i), temperature=1.0,
                                                          max_tokens=10, ignore_eos=True) for i in range(G)])
    assert sum(r.tokens for r in refs.trace if r.kind == "prefill") == G * prompt_len
    (out,) = outs
    assert [c.index for c in out.outputs] == list(range(G))
    for i, ref in enumerate(refs):
        assert out.outputs[i].token_ids == ref.outputs[0].token_ids, f"sample {i}"
        torch.testing.assert_close(torch.tensor(out.outputs[i].token_logprobs), torch.tensor(ref.outputs[0].token_logprobs),
                                   **tol(torch.float32))
    # the samples really differ (the fork did not collapse them onto one generator)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_fork_groups_mixed_with_other_requests():
    """Several forked groups and plain requests in one batch equal the same work done one request at a time."""
    prompts = _prompts([5, 8, 17, 3])
    params = [SamplingParams(n=3, seed=7, max_tokens=6, ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(n=2, seed=9, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True),
              SamplingParams(n=4, seed=1, temperature=0.5, max_tokens=6, ignore_eos=True)]
    batched = _llm(block_size=4, max_num_seqs=16).generate(prompts, params)
    single = _llm(block_size=4, max_num_seqs=16)
    _assert_same(batched, [single.generate([p], sp)[0] for p, sp in zip(prompts, params)])


# ---- KV exhaustion -----------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_kv_exhaustion_preempts_and_completes(model, sampling):
    prompts = _prompts([3, 9, 14, 5, 11, 20, 7, 2, 16, 12])
    if sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    else:  # per-request seeds (unseeded draws depend on batch composition by design); one forked group
        params = [SamplingParams(seed=100 + i, n=2 if i == 3 else 1, top_p=0.95, max_tokens=20, ignore_eos=True)
                  for i in range(len(prompts))]
    P = 4
    ref = _llm(model, block_size=P, max_num_seqs=16).generate(prompts, params)
    assert ref.stats["preemptions"] == 0
    # room for about three sequences at full length, for a batch of ten (eleven samples)
    tight = _llm(model, block_size=P, max_num_seqs=16, num_kv_blocks=3 * (20 + 20) // P)
    outs = tight.generate(prompts, params)
    assert outs.stats["preemptions"] > 0 and outs.stats["recomputed_tokens"] > 0
    _assert_same(outs, ref)
    assert tight.block_manager.num_free == tight.block_manager.num_blocks
    assert not tight.has_unfinished()


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(n=0), "n must be"), (dict(n=-2), "n must be"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("backend,match", [("nope", "must be one of"), ("flashinfer", "unavailable"),
                                           ("triton-typo", "must be one of")])
def test_bad_attention_backend(backend, match):
    with pytest.raises(ValueError, match=match) as err:
        _llm(attention_backend=backend)
    assert backend in str(err.value)


BAD_PROMPTS = [
    ([], ValueError, "empty"),
    (list(range(3, 3 + 64)), ValueError, "max_model_len"),
    ([5, 6, 256], ValueError, "vocab_size"),
    ([5, -1, 7], ValueError, "vocab_size"),
    ([5, 6.5, 7], TypeError, "token ids must be integers"),
    ("hello", TypeError, "token ids must be integers"),
]


@pytest.mark.parametrize("prompt,exc,match", BAD_PROMPTS, ids=["empty", "too-long", "vocab-high", "negative",
                                                               "float", "string"])
def test_bad_request_leaves_others_untouched(prompt, exc, match):
    good = _prompts([4, 9, 6])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = _llm(max_model_len=64).generate(good, params)

    llm = _llm(max_model_len=64)
    ids = [llm.add_request(p, params) for p in good[:2]]
    llm.step()  # the first two are in flight when the bad one arrives
    with pytest.raises(exc, match=match):
        llm.add_request(prompt, params)
    ids.append(llm.add_request(good[2], params))
    finished = {}
    while llm.has_unfinished():
        finished.update((o.request_id, o) for o in llm.step())
    _assert_same([finished[i] for i in ids], clean)


def test_bad_params_type_in_add_request():
    llm = _llm()
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request([5, 6], {"temperature": 0.0})
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([5, 6], request_id="a")
        llm.add_request([5, 7], request_id="a")


def test_generate_bad_prompt_names_index_and_engine_stays_usable():
    llm = _llm(max_model_len=64)
    good = _prompts([4, 9, 6])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt 2"):
        llm.generate([good[0], good[1], [1, 2, 999], good[2]], params)
    assert not llm.has_unfinished() and llm.block_manager.num_free == llm.block_manager.num_blocks
    with pytest.raises(TypeError, match="list of prompts"):
        llm.generate(good[0], params)
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate(good, [params, params])
    _assert_same(llm.generate(good, params), _llm(max_model_len=64).generate(good, params))


def test_request_too_large_for_the_cache():
    llm = _llm(block_size=4, num_kv_blocks=5)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.add_request([5] * 10, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="max_num_seqs"):
        _llm(max_num_seqs=2).add_request([5], SamplingParams(n=3))


# ---- step-level API ----------------------------------------------------------------------------
def test_step_api_abort_and_versions():
    prompts = _prompts([6, 10, 3])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    clean = _llm().generate(prompts, params)

    llm = _llm()
    assert not llm.has_unfinished() and llm.step() == []
    a = llm.add_request(prompts[0], params)
    b = llm.add_request(prompts[1], SamplingParams(n=3, seed=5, max_tokens=12, ignore_eos=True))
    c = llm.add_request(prompts[2], params, request_id="third")
    assert c == "third" and llm.has_unfinished()
    finished, steps = {}, 0
    while llm.has_unfinished():
        if steps == 4:
            llm.weight_version = 1   # a learner update lands mid-generation
            llm.abort_request(b)     # running, forked group: every sample goes, blocks come back
            llm.abort_request("never-added")
        for out in llm.step():
            finished[out.request_id] = out
        steps += 1
    assert set(finished) == {a, c}
    _assert_same([finished[a], finished[c]], [clean[0], clean[2]])
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    # the first token is sampled by the prefill (step 0); steps 1-3 decode under version 0
    for out in (finished[a], finished[c]):
        assert out.outputs[0].policy_versions == [0] * 4 + [1] * 8
    assert llm.trace and {r.kind for r in llm.trace} == {"prefill", "decode"}


def test_abort_waiting_request():
    llm = _llm(max_num_seqs=1)
    a = llm.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    b = llm.add_request([8, 9], SamplingParams(n=1, max_tokens=4))
    llm.step()
    llm.abort_request(b)  # never admitted: only the waiting queue holds it
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [a]
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


# ---- finish reasons ----------------------------------------------------------------------------
def test_finish_reasons():
    prompt = _prompts([7])[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = _llm(max_model_len=64).generate([prompt], greedy)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10

    # stop_token_ids: stops at the first occurrence, the stop token is kept
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = _llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]

    # EOS from the model config: stops unless ignore_eos; same weights, different eos id
    model = Qwen3ForCausalLM(preset("tiny").replace(eos_token_id=[stop_tok, 255]))
    llm = LLM(model)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    out = llm.generate([prompt], greedy)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids

    # max_model_len caps prompt + generated tokens
    out = _llm(max_model_len=10).generate([prompt], greedy)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids[:3]


def test_groups_never_exceed_max_num_seqs():
    """Siblings of leaders admitted in the same prefill step count against B_gen (they fork right after it)."""
    llm = _llm(max_num_seqs=4)
    prompts = _prompts([5, 6, 7])
    params = [SamplingParams(n=3, seed=1, max_tokens=5, ignore_eos=True),
              SamplingParams(n=2, seed=2, max_tokens=5, ignore_eos=True),
              SamplingParams(n=1, seed=3, max_tokens=5, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outs] == [3, 2, 1]
    assert all(len(c.token_ids) == 5 for o in outs for c in o.outputs)
    assert max(r.b_act for r in outs.trace if r.kind == "decode") <= 4


def test_decode_benchmark_smoke(tmp_path):
    """`rlengine bench decode` end to end on the tiny preset: rows with the keys tools/plots.py reads (per-step
    timing: a 3-token wall-clock difference on the tiny model is noise, possibly negative)."""
    import json

    from rlengine.benchmarks import decode

    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"ceilings": {"bandwidth_bytes_per_s": 1e10, "flops_per_s": {"float32": 1e11}}}))
    assert decode.main(["--model", "tiny", "--batches", "1,2,512", "--max-batch", "4", "--prompt-len", "5",
                        "--gen-len", "3", "--reps", "1", "--timing", "steps", "--prefill-len", "0",
                        "--ceilings", str(ceilings), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert [r["b_act"] for r in rows] == [1, 2]
    for r in rows:
        assert set(decode.COLUMNS) <= set(r) and r["tokens_per_s"] > 0 and r["hf_ms_per_step"] > 0
        assert r["same_tokens_as_hf"] is True  # fp32 greedy: both generate the same tokens


def test_generate_does_not_swallow_streaming_requests():
    """Requests added with add_request() that finish inside a generate() call reach the next step()."""
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=4), max_num_seqs=4, attention_backend="torch")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    rid = llm.add_request([5, 6, 7], greedy)
    outs = llm.generate([[8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 6
    later = llm.step()
    assert [o.request_id for o in later] == [rid] and len(later[0].outputs[0].token_ids) == 3
    assert not llm.has_unfinished()


# ---- one KV pool, two engines (the trainer's rollout and eval engines) ---------------------------
def test_eval_engine_shares_the_rollout_pool():
    """An eval engine on the rollout engine's pool: one cache tensor, one free list. An evaluation run
    while a rollout request is in flight (async partial rollouts carry over) neither disturbs it nor
    keeps blocks; a pool laid out for another shape is refused; a pool whose blocks are all held by the
    other engine stops with an error instead of spinning."""
    model = Qwen3ForCausalLM(preset("tiny"))
    kw = dict(block_size=4, attention_backend="cpp")
    rollout = LLM(model, max_num_seqs=8, num_kv_blocks=24, **kw)
    evaluator = LLM(model, max_num_seqs=4, kv_pool=rollout.kv_pool, **kw)
    assert evaluator.kv_cache.data.data_ptr() == rollout.kv_cache.data.data_ptr()
    assert evaluator.block_manager.num_blocks == 24
    prompts = _prompts([6, 9, 3])
    sampled = SamplingParams(n=2, seed=3, max_tokens=10, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref_rollout = LLM(model, max_num_seqs=8, **kw).generate([prompts[0]], sampled)
    ref_eval = LLM(model, max_num_seqs=4, **kw).generate(prompts[1:], greedy)

    rid = rollout.add_request(prompts[0], sampled)
    for _ in range(3):
        rollout.step()
    held = rollout.block_manager.num_blocks - rollout.block_manager.num_free
    assert held > 0
    _assert_same(evaluator.generate(prompts[1:], greedy), ref_eval)
    assert rollout.block_manager.num_blocks - rollout.block_manager.num_free == held
    finished = []
    while rollout.has_unfinished():
        finished += rollout.step()
    assert [o.request_id for o in finished] == [rid]
    _assert_same(finished, ref_rollout)
    assert rollout.block_manager.num_free == 24

    with pytest.raises(ValueError, match="kv_pool"):
        LLM(model, kv_pool=rollout.kv_pool, block_size=8, attention_backend="cpp")
    with pytest.raises(ValueError, match="kv_pool: a shared pool keeps its own size"):
        LLM(model, kv_pool=rollout.kv_pool, num_kv_blocks=4, **kw)
    hog = rollout.add_request([5] * 60, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    rollout.step()  # 15 of 24 blocks held by the rollout engine
    evaluator.add_request([7] * 50, greedy)  # needs 13
    with pytest.raises(RuntimeError, match="needs 13 KV blocks, 9 of 24 are free"):
        evaluator.step()
    rollout.abort_request(hog)


def test_auto_backend_never_picks_flashinfer(monkeypatch):
    """`auto` picks only backends the suite checks against the torch oracle: even with flashinfer
    importable on a GPU it takes triton (FlashInfer stays opt-in until a GPU run has checked it)."""
    from rlengine.engine.attention import AUTO_ORDER, BACKENDS, resolve_backend

    for cls in BACKENDS.values():
        monkeypatch.setattr(cls, "unavailable_reason", staticmethod(lambda device: None), raising=False)
    assert resolve_backend("auto", torch.device("cuda")).name == "triton"
    assert resolve_backend("auto", torch.device("cpu")).name == "cpp"
    assert resolve_backend("flashinfer", torch.device("cuda")).name == "flashinfer"
    assert all("flashinfer" not in order for order in AUTO_ORDER.values())
