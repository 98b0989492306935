"""OpenAI request bodies -> validated engine requests (token ids + SamplingParams), and the error shape.

The HTTP layer (app.py) parses a JSON body into CompletionRequest / ChatCompletionRequest (pydantic;
unknown fields are ignored, as OpenAI's server and vLLM's do), then `completion_prompts` /
`chat_prompts` turn it into token-id prompts and `sampling_params` into one SamplingParams. Every
rejection is an ApiError carrying OpenAI's JSON error shape; SamplingParams' own ValueErrors become
400s naming the field. vLLM's extensions that RL needs are accepted: prompts as token ids,
`return_token_ids`, `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `include_stop_str_in_output`, `skip_special_tokens`.
Simplification: fields OpenAI defines that would change what is generated in ways this engine does
not implement (logit_bias, echo, suffix, a JSON response_format) are refused with a 400, never ignored.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from rlengine.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20           # top log-probs per token at most (OpenAI's chat limit, vLLM's default max_logprobs)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left in the context


class ApiError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's {"error": {...}} body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI's names, then vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


def _refuse_unsupported(req: _Sampling) -> None:
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
        if req.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")
    if isinstance(req, ChatCompletionRequest) and req.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than {'type': 'text'} is not supported (no guided decoding)",
                       param="response_format")


def completion_prompts(req: CompletionRequest, tokenizer) -> list[tuple[list[int], str | None]]:
    """The request's prompts as (token ids, text or None): a str, token ids, or a list of either."""
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise ApiError(400, "text prompts need a tokenizer; send token ids", param="prompt")
            out.append((tokenizer.encode(item, add_special_tokens=True), item))
        else:
            out.append((list(item), None))
    return out


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> tuple[list[int], str]:
    """The conversation rendered with the checkpoint's chat template -> (token ids, rendered text)."""
    from rlengine.model.chat_template import ChatTemplateError

    if tokenizer is None or not tokenizer.chat_templates:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             tools=req.tools, **(req.chat_template_kwargs or {}))
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    return tokenizer.encode(text), text


def check_lengths(prompts: list[list[int]], max_tokens: int | None, max_model_len: int) -> int:
    """max_tokens for these prompts (vLLM's rule: a default fills the context; an explicit value must fit)."""
    longest = max(len(ids) for ids in prompts)
    if min(len(ids) for ids in prompts) == 0:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    if longest >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{longest}, which leaves no room to generate", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - longest
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if longest + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens; you requested "
                       f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} for the completion)",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


def requested_logprobs(req: _Sampling) -> int | None:
    """SamplingParams.logprobs (top-k per token) from either endpoint's fields; None = not asked."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        k, name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        k, name = req.logprobs, "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", param=name)
    return k


def sampling_params(req: _Sampling, max_tokens: int) -> SamplingParams:
    """One SamplingParams for every prompt of the request; SamplingParams' ValueError -> 400 naming the field."""
    _refuse_unsupported(req)
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            logprobs=requested_logprobs(req), best_of=best_of, detokenize=True,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens)
    except ValueError as exc:
        field = re.search(r"SamplingParams\.(\w+)", str(exc))
        raise ApiError(400, str(exc), param=field.group(1) if field else None) from None
