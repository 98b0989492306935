"""The vLLM surface a real script uses next: LLM arguments, get_tokenizer / use_tqdm, the sampling rules
(penalties, min_p, min_tokens), prompt_logprobs, Logprob records and cumulative_logprob.

References: hand-written loops over the plain forward's logits for every rule (one token at a time, Python
sets and Counters, no engine code), transformers' generate(repetition_penalty=...) (which implements vLLM's
rule) for greedy decoding, torch.topk and a strict-greater count for Logprob ranks, the plain forward's
log_softmax for prompt_logprobs. Negative controls: each rule is checked to change the output it is
tested on (a rule that did nothing would pass a parity test trivially).
"""

from collections import Counter

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.engine.outputs import Logprob
from rlengine.engine.sampling_rules import apply_min_p, apply_penalties
from rlengine.model.loader import load_pretrained

from tests.support.text_ckpt import checkpoint_with_eos


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return LLM(model=str(text_checkpoint.path), max_num_seqs=8)


def _prompt(llm, text="Hello, my name is"):
    return llm.get_tokenizer().encode(text)


@torch.no_grad()
def _next_logits(llm, ids):
    """Plain forward (no cache): fp32 logits [V] of the token after ids."""
    return llm.model(torch.tensor([ids]))[0, -1].float()


def _penalised_ref(logits, prompt, gen, *, rep=1.0, freq=0.0, pres=0.0):
    """vLLM's penalties written out token by token (the definition in SamplingParams' docstring)."""
    out = logits.clone()
    for t in set(prompt) | set(gen):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, c in Counter(gen).items():
        out[t] -= freq * c + pres
    return out


# ---- LLM arguments ---------------------------------------------------------------------------------------
def test_vllm_llm_arguments(text_checkpoint, tmp_path):
    llm = LLM(model=str(text_checkpoint.path), gpu_memory_utilization=0.5, tensor_parallel_size=1,
              trust_remote_code=False, dtype="auto", seed=0, enforce_eager=True, max_num_seqs=2)
    assert llm.model.dtype == torch.float32  # the fixture checkpoint is fp32
    assert llm.cuda_graphs_off == "enforce_eager=True"
    # dtype="auto" is the checkpoint's torch_dtype: a copy that says bfloat16 loads in bfloat16
    import json
    import shutil
    dst = tmp_path / "bf16"
    shutil.copytree(text_checkpoint.path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    assert LLM(model=str(dst), dtype="auto", max_num_seqs=2).model.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs,match", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: rlengine runs the model on one device"),
    ({"trust_remote_code": True}, "trust_remote_code=True: rlengine runs its own"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 0.5, "num_kv_blocks": 8}, "gpu_memory_utilization sizes the KV pool"),
    ({"dtype": "fp8"}, "dtype must be 'auto' or one of"),
], ids=["tp2", "remote-code", "util-0", "util-1.5", "util-and-blocks", "bad-dtype"])
def test_llm_refuses_what_it_cannot_honour(text_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(text_checkpoint.path), **kwargs)


def test_get_tokenizer_and_progress_bar(llm, text_checkpoint):
    assert llm.get_tokenizer() is llm.tokenizer
    assert LLM(load_pretrained(text_checkpoint.path), max_num_seqs=2).tokenizer is None
    with pytest.raises(ValueError, match="get_tokenizer: this engine has none"):
        LLM(load_pretrained(text_checkpoint.path), max_num_seqs=2).get_tokenizer()

    bars = []

    class Bar:  # a tqdm-like callable (vLLM accepts one)
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    params = SamplingParams(temperature=0.0, max_tokens=3)
    llm.generate(["Hello", "The capital"], params, use_tqdm=Bar)
    llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=Bar)
    assert [(b.total, b.n, b.closed) for b in bars] == [(2, 2, True), (1, 1, True)]
    assert len(llm.generate(["Hello"], params, use_tqdm=True)) == 1  # the real tqdm bar


# ---- SamplingParams --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens must be an int in \[0, max_tokens=10\]"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"logprobs": -1}, "logprobs must be None or an int >= 0"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be None or an int >= 0"),
    ({"n": 2, "best_of": 4}, "best_of=4 .* is not supported: rlengine returns every sample it draws"),
], ids=["min_p", "min_tokens", "presence", "frequency", "repetition", "logprobs", "prompt_logprobs", "best_of"])
def test_sampling_params_ranges(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert SamplingParams(n=3, best_of=3).best_of == 3


def test_penalty_and_min_p_rules_against_hand_loops():
    """The tensor rules on random logits (both signs) vs per-token Python loops."""
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(3, V, generator=g) * 3
    prompts = [[1, 2, 3, 3], [7], [4, 40]]
    gens = [[3, 5, 5, 9], [], [40, 40, 41, 2]]
    params = torch.tensor([[1.3, 0.4, 0.25], [0.8, -0.3, 1.0], [2.0, 1.5, -0.5]])
    counts = torch.zeros(3, V, dtype=torch.int32)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for r, (p, o) in enumerate(zip(prompts, gens)):
        mask[r, p] = True
        for t in o:
            counts[r, t] += 1
    got = apply_penalties(logits, counts, mask, params)
    for r in range(3):
        rep, freq, pres = params[r].tolist()
        ref = _penalised_ref(logits[r], prompts[r], gens[r], rep=rep, freq=freq, pres=pres)
        torch.testing.assert_close(got[r], ref, rtol=0, atol=1e-6)
    assert (got != logits).any(dim=-1).all()  # every row changed

    min_p = torch.tensor([[0.0], [0.2], [0.9]])
    kept = apply_min_p(logits, min_p).isfinite()
    for r in range(3):
        p = logits[r].softmax(-1)
        want = [bool(p[v] >= min_p[r, 0] * p.max()) for v in range(V)]
        assert kept[r].tolist() == want
    assert kept[0].all() and 1 <= kept[2].sum() <= kept[1].sum() < V


# ---- penalties through the engine ------------------------------------------------------------------------
def _greedy_ref(llm, prompt, n, **pen):
    gen = []
    for _ in range(n):
        gen.append(int(_penalised_ref(_next_logits(llm, prompt + gen), prompt, gen, **pen).argmax()))
    return gen


@pytest.mark.parametrize("pen", [{"rep": 1.8}, {"rep": 0.6}, {"freq": 1.2}, {"pres": 1.5},
                                 {"rep": 1.3, "freq": 0.5, "pres": 0.5}],
                         ids=["repetition", "repetition<1", "frequency", "presence", "all"])
def test_greedy_penalties_match_the_hand_reference(llm, pen):
    prompt = _prompt(llm)
    n = 16
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                            repetition_penalty=pen.get("rep", 1.0), frequency_penalty=pen.get("freq", 0.0),
                            presence_penalty=pen.get("pres", 0.0), logprobs_mode="processed")
    plain = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # the penalised request batched with an unpenalised one: rules apply to their own rows only
    out, free = llm.generate([prompt, prompt], [params, plain])
    got = out.outputs[0]
    ref = _greedy_ref(llm, prompt, n, **pen)
    assert got.token_ids == ref
    assert free.outputs[0].token_ids == _greedy_ref(llm, prompt, n)
    assert got.token_ids != free.outputs[0].token_ids  # the penalty changed the output
    # processed log-probs: log_softmax of the penalised logits; raw: of the model's logits
    raw = llm.generate([prompt], SamplingParams(**{**_fields(params), "logprobs_mode": "raw"}))[0].outputs[0]
    assert raw.token_ids == ref
    for t, tok in enumerate(ref):
        logits = _next_logits(llm, prompt + ref[:t])
        lp_proc = _penalised_ref(logits, prompt, ref[:t], **pen).log_softmax(-1)[tok]
        assert got.token_logprobs[t] == pytest.approx(float(lp_proc), abs=1e-4)
        assert raw.token_logprobs[t] == pytest.approx(float(logits.log_softmax(-1)[tok]), abs=1e-4)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_greedy_repetition_penalty_matches_transformers(llm, text_checkpoint):
    import transformers
    hf = transformers.Qwen3ForCausalLM.from_pretrained(text_checkpoint.path, dtype=torch.float32).eval()
    prompts = [_prompt(llm), _prompt(llm, "The capital of France is"), _prompt(llm, "日本")]
    for r in (1.5, 0.7):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                    repetition_penalty=r))
        for prompt, out in zip(prompts, outs):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=r,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == want, (r, prompt)


def test_penalties_survive_preemption(text_checkpoint):
    """A preempted sample rebuilds its counts from its tokens on recompute: the same output."""
    prompt = LLM(model=str(text_checkpoint.path), max_num_seqs=1).get_tokenizer().encode("Hello, my name is")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.3)
    ref = LLM(model=str(text_checkpoint.path), max_num_seqs=4).generate([prompt] * 4, params)
    tight = LLM(model=str(text_checkpoint.path), max_num_seqs=4, block_size=4, num_kv_blocks=18)
    got = tight.generate([prompt] * 4, params)
    assert got.stats["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


# ---- min_p -----------------------------------------------------------------------------------------------
def test_min_p_keeps_exactly_the_hand_reference_set(llm):
    """processed log-probs with logprobs=V show the distribution sampled from: min_p's kept set, renormalised."""
    prompt = _prompt(llm)
    V = llm.config.vocab_size
    T, min_p = 0.1, 0.2  # the random model's logits are flat: a low temperature gives min_p a tail to cut
    out = llm.generate([prompt], SamplingParams(temperature=T, min_p=min_p, max_tokens=6, ignore_eos=True, seed=5,
                                                logprobs=V, logprobs_mode="processed"))[0].outputs[0]
    for t, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        z = _next_logits(llm, prompt + out.token_ids[:t]) / T
        p = z.softmax(-1)
        keep = p >= min_p * p.max()
        assert set(entry) == set(keep.nonzero()[:, 0].tolist())  # dropped tokens are -inf, left out
        assert tok in entry and 1 < len(entry) < V
        ref = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
        for v, rec in entry.items():
            assert rec.logprob == pytest.approx(float(ref[v]), abs=1e-4)


# ---- min_tokens ------------------------------------------------------------------------------------------
def test_min_tokens_masks_the_stop_ids_until_reached(text_checkpoint, tmp_path):
    eos = text_checkpoint.eos_token_ids[0]
    llm0 = LLM(model=str(text_checkpoint.path), max_num_seqs=2)
    prompt = _prompt(llm0, "The capital of France is")
    dst = tmp_path / "edited"
    expected = checkpoint_with_eos(text_checkpoint.path, dst, prompt, eos, 2)  # greedy stops after 3 tokens
    llm = LLM(model=str(dst), max_num_seqs=2)
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert free.token_ids == expected and free.finish_reason == "stop"  # the control: EOS comes at token 3
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6))[0].outputs[0]
    # reference: greedy with every stop id at -inf while fewer than 6 tokens exist, then stop at EOS
    stops, gen = set(llm.eos_ids), []
    while len(gen) < 12:
        logits = _next_logits(llm, prompt + gen)
        if len(gen) < 6:
            logits[list(stops)] = float("-inf")
        gen.append(int(logits.argmax()))
        if gen[-1] in stops:
            break
    assert got.token_ids == gen and len(gen) > 6 and not stops & set(gen[:6])


def test_min_tokens_delays_stop_strings(llm):
    prompt = "Hello, my name is"
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    dec = llm.tokenizer.decode
    n = next(i for i in range(1, 25) if len(dec(free.token_ids[:i])) >= 2)  # first token with 2 chars of text
    stop = dec(free.token_ids[:n])[:2]
    early = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == n
    late = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                 min_tokens=n))[0].outputs[0]
    assert len(late.token_ids) > n and late.token_ids[:n] == free.token_ids[:n]


# ---- log-probs -------------------------------------------------------------------------------------------
def test_logprobs_records_against_topk_ranks(llm):
    prompt = _prompt(llm)
    k = 3
    for params in (SamplingParams(temperature=0.0, max_tokens=5, logprobs=k),
                   SamplingParams(temperature=1.3, max_tokens=8, logprobs=k, seed=3),
                   SamplingParams(temperature=1.0, max_tokens=4, logprobs=0, seed=4)):
        out = llm.generate([prompt], params)[0].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == len(out.token_logprobs)
        assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs), abs=1e-9)
        T = params.temperature or 1.0
        for t, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            lp = (_next_logits(llm, prompt + out.token_ids[:t]) / T).log_softmax(-1)
            vals, ids = lp.topk(params.logprobs)
            assert list(entry)[:params.logprobs] == ids.tolist()
            assert all(isinstance(r, Logprob) for r in entry.values())
            assert [entry[i].rank for i in ids.tolist()] == list(range(1, params.logprobs + 1))
            torch.testing.assert_close(torch.tensor([entry[i].logprob for i in ids.tolist()]), vals, rtol=0,
                                       atol=1e-5)
            assert tok in entry and len(entry) in (params.logprobs, params.logprobs + 1)
            assert entry[tok].rank == 1 + int((lp > lp[tok]).sum())
            assert entry[tok].logprob == pytest.approx(out.token_logprobs[t], abs=1e-6)
            assert entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None  # vLLM: None unless asked
    assert plain.outputs[0].cumulative_logprob == pytest.approx(sum(plain.outputs[0].token_logprobs))


@pytest.mark.parametrize("T", [0.0, 0.6], ids=["greedy", "T0.6"])
def test_prompt_logprobs_against_the_plain_forward(llm, T):
    prompts = [_prompt(llm), _prompt(llm, "The capital of France is")]
    k = 2
    outs = llm.generate(prompts, SamplingParams(temperature=T, max_tokens=2, prompt_logprobs=k, n=2, seed=1))
    for prompt, out in zip(prompts, outs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        with torch.no_grad():
            lp = (llm.model(torch.tensor([prompt]))[0, :-1].float() / (T or 1.0)).log_softmax(-1)
        for j in range(1, len(prompt)):
            entry, tok = entries[j], prompt[j]
            vals, ids = lp[j - 1].topk(k)
            assert list(entry)[:k] == ids.tolist() and tok in entry
            torch.testing.assert_close(torch.tensor([entry[i].logprob for i in ids.tolist()]), vals, rtol=0,
                                       atol=1e-5)
            assert entry[tok].logprob == pytest.approx(float(lp[j - 1, tok]), abs=1e-5)
            assert entry[tok].rank == 1 + int((lp[j - 1] > lp[j - 1, tok]).sum())


def test_rules_stay_off_until_asked(text_checkpoint):
    llm = LLM(model=str(text_checkpoint.path), max_num_seqs=2)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, top_k=5, max_tokens=4, seed=0))
    assert not llm.runner.rules.on and llm.runner.rules.counts is None and not llm.runner.top_logprobs_on
    llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=4, presence_penalty=0.5))
    assert llm.runner.rules.on and llm.runner.rules.counts is not None
