"""Refusals of `rlengine serve`: bearer-token auth and every listed bad request, each with its status and
OpenAI's error shape {"error": {message, type, param, code}}, and the server still serving after it.

Raw httpx requests check status codes and bodies exactly; the openai client checks that its typed
exceptions come out (BadRequestError, AuthenticationError, NotFoundError) as with OpenAI's servers.
"""

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, TEXT_MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path, body, headers=AUTH, **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def _assert_openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _good_request_works(server):
    r = _post(server, "/v1/completions", {"model": TEXT_MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                          "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_auth_refuses_a_missing_or_wrong_key_and_accepts_the_right_one(text_server):
    for path in ("/v1/models", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.get(text_server.url + path, headers=headers, timeout=10)
            assert _assert_openai_error(r, 401)["type"] == "authentication_error"
        assert httpx.get(text_server.url + path, headers=AUTH, timeout=10).status_code == 200
    _assert_openai_error(_post(text_server, "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi"}, headers={}), 401)
    assert httpx.get(text_server.url + "/health", timeout=10).status_code == 200  # no key needed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=text_server.base_url, api_key="wrong", max_retries=0).models.list()
    _good_request_works(text_server)


LONG = list(range(3, 603))  # 600 tokens: more than the checkpoint's 512 positions
BAD = [  # (id, path, body, the param the error names or None)
    ("unknown-model", "/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("negative-max-tokens", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("zero-max-tokens", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("prompt-too-long", "/v1/completions", {"model": TEXT_MODEL, "prompt": LONG, "max_tokens": 1}, "prompt"),
    ("prompt-plus-max-tokens-too-long", "/v1/completions",
     {"model": TEXT_MODEL, "prompt": LONG[:500], "max_tokens": 100}, "max_tokens"),
    ("chat-too-long", "/v1/chat/completions",
     {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, "prompt"),
    ("bad-type", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("missing-prompt", "/v1/completions", {"model": TEXT_MODEL}, "prompt"),
    ("empty-prompt", "/v1/completions", {"model": TEXT_MODEL, "prompt": []}, "prompt"),
    ("top-p-zero", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("negative-temperature", "/v1/chat/completions",
     {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("penalty-out-of-range", "/v1/completions",
     {"model": TEXT_MODEL, "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("min-p-out-of-range", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ("too-many-logprobs", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions",
     {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("n-above-max-num-seqs", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "n": 17}, None),
    ("token-outside-vocab", "/v1/completions", {"model": TEXT_MODEL, "prompt": [5, 10**6]}, None),
    ("logit-bias", "/v1/completions", {"model": TEXT_MODEL, "prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("chat-bad-role", "/v1/chat/completions", {"model": TEXT_MODEL, "messages": [{"role": "tool", "content": "x"}]},
     "messages"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_400_and_the_next_request_works(text_server, path, body, param):
    err = _assert_openai_error(_post(text_server, path, body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    _good_request_works(text_server)


def test_body_that_is_not_json_is_400(text_server):
    r = httpx.post(text_server.url + "/v1/completions", content=b"{not json", headers=AUTH, timeout=10)
    _assert_openai_error(r, 400)
    _good_request_works(text_server)


def test_unknown_route_is_404_and_wrong_method_405(text_server):
    err = _assert_openai_error(httpx.get(text_server.url + "/v1/nothing", headers=AUTH, timeout=10), 404)
    assert err["type"] == "not_found_error"
    _assert_openai_error(httpx.get(text_server.url + "/v1/completions", headers=AUTH, timeout=10), 405)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=text_server.url + "/v2", api_key=API_KEY, max_retries=0).models.list()
    _good_request_works(text_server)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="nope", prompt="hi")
    assert info.value.body["param"] == "model"


def test_chat_on_a_model_without_template_is_400(tiny_server):
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert "chat template" in _assert_openai_error(r, 400)["message"]
    r = _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "12+34=", "max_tokens": 2})
    assert r.status_code == 200
