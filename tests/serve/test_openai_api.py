"""The OpenAI API of `rlengine serve`, through the real `openai` client, against the in-process LLM.

The server (tests/serve/conftest.py) and the reference LLM load the same text checkpoint in
batch-invariant mode, so token ids, text and log-probs must be equal, not close: the reference is
LLM.generate / LLM.chat on the same prompt, alone. Streaming is checked by reassembling the chunks
into the non-streamed response; seeds by repetition and by LLM.generate with the same seed.
"""

import json

import httpx
import pytest

from rlengine import SamplingParams

from tests.serve.conftest import API_KEY, TEXT_MODEL

PROMPT = "The capital of France is"
TOKENS = {"return_token_ids": True}


def _gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_models_lists_the_served_name(client, text_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [TEXT_MODEL]
    assert models[0].model_extra["max_model_len"] == text_llm.max_model_len


def test_completion_equals_llm_generate_for_text_and_token_prompts(client, text_llm):
    ref = _gen(text_llm, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    got = client.completions.create(model=TEXT_MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, **TOKENS})
    c = got.choices[0]
    assert c.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert c.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert c.text == ref.outputs[0].text and c.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids) and got.usage.completion_tokens == 12
    by_ids = client.completions.create(model=TEXT_MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, **TOKENS})
    assert by_ids.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert by_ids.choices[0].text == ref.outputs[0].text


def test_several_prompts_give_choices_in_prompt_order(client, text_llm):
    prompts = [[5, 6, 7, 8], [40, 41], [100, 3, 9, 27, 31]]
    got = client.completions.create(model=TEXT_MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, **TOKENS})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for p, c in zip(prompts, got.choices):
        assert c.model_extra["token_ids"] == _gen(text_llm, p, temperature=0.0, max_tokens=5,
                                                  ignore_eos=True).outputs[0].token_ids


def test_chat_completion_equals_llm_chat(client, text_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus three?"}]
    ref = text_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    got = client.chat.completions.create(model=TEXT_MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, **TOKENS})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert got.model_extra["prompt_token_ids"] == ref.prompt_token_ids


def test_n_samples_with_a_seed_equal_llm_generate_and_repeat(client, text_llm):
    kw = dict(model=TEXT_MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True, **TOKENS})
    ref = _gen(text_llm, PROMPT, n=3, temperature=1.0, max_tokens=8, seed=1234, ignore_eos=True)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ids = [c.model_extra["token_ids"] for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert ids == [o.token_ids for o in ref.outputs]
    assert ids == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(x) for x in ids}) > 1, "three samples at T=1 all equal: n is not sampling"
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.model_extra["token_ids"] for c in other.choices] != ids


def test_stop_string_cuts_the_text_streamed_or_not(client, text_llm):
    full = _gen(text_llm, PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True).outputs[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and
                full.find(full[i:i + 2]) == i)
    want = full[:full.find(stop)]
    got = client.completions.create(model=TEXT_MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=TEXT_MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_equal_the_engines(client, text_llm):
    ref = _gen(text_llm, PROMPT, temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True).outputs[0]
    lp = client.completions.create(model=TEXT_MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.token_logprobs == ref.token_logprobs
    assert lp.tokens == [entry[t].decoded_token for t, entry in zip(ref.token_ids, ref.logprobs)]
    for top, entry in zip(lp.top_logprobs, ref.logprobs):
        assert top == {e.decoded_token: e.logprob for e in entry.values()}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_and_top_logprobs(client, text_llm):
    messages = [{"role": "user", "content": "Hello"}]
    ref = text_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True))[0]
    got = client.chat.completions.create(model=TEXT_MODEL, messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == ref.outputs[0].token_logprobs
    for c, entry in zip(content, ref.outputs[0].logprobs):
        want = sorted((e for e in entry.values() if e.rank <= 2), key=lambda e: e.rank)
        assert [t.logprob for t in c.top_logprobs] == [e.logprob for e in want]
        assert c.top_logprobs[0].logprob >= c.logprob  # greedy: the sampled token is the top one
        assert bytes(c.bytes).decode() == c.token


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_reassembles_to_the_greedy_response(client, kind):
    if kind == "completion":
        kw = dict(model=TEXT_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, n=2,
                  extra_body={"ignore_eos": True, **TOKENS})
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
        assert [texts[i] for i in (0, 1)] == [c.text for c in whole.choices]
    else:
        kw = dict(model=TEXT_MODEL, messages=[{"role": "user", "content": "Name a city."}], max_tokens=16,
                  temperature=0, n=2, extra_body={"ignore_eos": True, **TOKENS})
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                            if c.choices and c.choices[0].index == i) for i in (0, 1)}
        assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
        assert next(c for c in chunks if c.choices).choices[0].delta.role == "assistant"
    ids = {i: sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and c.choices[0].index == i),
                  []) for i in (0, 1)}
    assert [ids[i] for i in (0, 1)] == [c.model_extra["token_ids"] for c in whole.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32
    assert whole.usage.completion_tokens == 32


def test_sse_ends_with_done(text_server):
    with httpx.stream("POST", text_server.base_url + "/completions", timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": TEXT_MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"
