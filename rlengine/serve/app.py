"""The FastAPI application: OpenAI's routes over one EngineLoop, bearer-token auth, OpenAI-shaped errors.

Routes: GET /health (never needs the key), GET /v1/models, GET /metrics (Prometheus text),
POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template). A handler parses
and validates the body (protocol.py), submits the prompts to the engine loop, waits until the engine
accepted them (its own checks can still refuse with a 400), then either streams SSE chunks ending in
`data: [DONE]` or gathers the whole response. A client that disconnects is noticed while it waits
(non-streamed: a watcher on the ASGI receive channel; streamed: Starlette cancels the generator) and
its request is aborted, which frees its KV blocks. Every error, ours or the framework's (404 for an
unknown route, 405, a body that is not JSON), is answered as {"error": {message, type, param, code}};
none of them stops the server or touches other requests.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlengine.serve.engine_loop import EngineLoop
from rlengine.serve.streams import RequestStream
from rlengine.serve.metrics import ServerMetrics
from rlengine.serve.protocol import (COMPLETION_MAX_TOKENS, ApiError, ChatCompletionRequest, CompletionRequest,
                                     chat_prompt, check_lengths, completion_prompts, sampling_params)
from rlengine.serve.responses import Responder

log = logging.getLogger("rlengine.serve")


def _error(exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class BearerAuth:
    """ASGI middleware: every HTTP path but /health needs `Authorization: Bearer <key>` (else 401)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                msg = "missing API key" if not got else "invalid API key"
                await _error(ApiError(401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key"))(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _body(request: Request, model_cls):
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param=where) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, engine: EngineLoop, stream: RequestStream, responder: Responder) -> Response:
    async def consume():
        async for updates in stream.updates():
            for up in updates:
                responder.add(up)

    consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            engine.abort(stream)
    if consumer not in done:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    consumer.result()  # an ApiError from the engine propagates
    return JSONResponse(responder.response())


async def _sse(engine: EngineLoop, stream: RequestStream, responder: Responder, include_usage: bool):
    try:
        try:
            async for updates in stream.updates():
                yield "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in responder.chunks(updates))
            if include_usage:
                yield f"data: {json.dumps(responder.usage_chunk())}\n\n"
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away and Starlette cancelled us: free its KV blocks now
        engine.abort(stream)


async def _generate(request: Request, kind: str) -> Response:
    st = request.app.state
    req = await _body(request, CompletionRequest if kind == "completion" else ChatCompletionRequest)
    if req.model != st.model_name:
        raise ApiError(400, f"The model `{req.model}` does not exist; this server has `{st.model_name}`",
                       param="model", code="model_not_found")
    if kind == "completion":
        prompts = completion_prompts(req, st.tokenizer)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(COMPLETION_MAX_TOKENS, st.max_model_len - max(len(ids) for ids, _ in prompts))
    else:
        prompts = [chat_prompt(req, st.tokenizer)]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, check_lengths([ids for ids, _ in prompts], max_tokens, st.max_model_len))
    responder = Responder(kind, st.model_name, [ids for ids, _ in prompts], params.n, logprobs=params.logprobs,
                          return_token_ids=req.return_token_ids)
    engine: EngineLoop = st.engine
    stream = engine.submit(prompts, params)
    try:
        await stream.accepted
    except asyncio.CancelledError:
        engine.abort(stream)
        raise
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_sse(engine, stream, responder, usage), media_type="text/event-stream")
    return await _collect(request, engine, stream, responder)


def build_app(engine: EngineLoop, metrics: ServerMetrics, *, model_name: str, max_model_len: int, tokenizer,
              api_key: str | None = None, stop_timeout: float = 5.0) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (aborting what is left) at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Everything built so far (torch, the model, the app) lives as long as the server: out of the
        # collector's sight, a full collection takes milliseconds instead of ~0.3 s that stall every
        # stream (measured with the tiny preset on 2 cores; vLLM's server freezes its startup heap too).
        gc.collect()
        gc.freeze()
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, stop_timeout)

    app = FastAPI(title="rlengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.tokenizer = engine, metrics, tokenizer
    app.state.model_name, app.state.max_model_len = model_name, max_model_len
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    async def api_error(_, exc: ApiError):
        return _error(exc)

    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(ApiError(exc.status_code, message))

    async def validation_error(_, exc: RequestValidationError):
        return _error(ApiError(400, str(exc)))

    async def internal(_, exc: Exception):
        log.error("request failed", exc_info=exc)
        return _error(ApiError(500, f"internal error: {exc!r}"))

    for cls, handler in ((ApiError, api_error), (StarletteHTTPException, http_error),
                         (RequestValidationError, validation_error), (Exception, internal)):
        app.add_exception_handler(cls, handler)

    @app.get("/health")
    async def health():
        if engine.failed or engine.draining:
            return _error(ApiError(503, engine.failed or "shutting down"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "rlengine", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "chat")

    return app
