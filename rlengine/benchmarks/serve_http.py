"""The HTTP client of `rlengine bench serve --url URL`: the Poisson schedule sent to an OpenAI-compatible server.

Each request of the schedule is one asyncio task that sleeps until its arrival time, then sends a
streamed POST /v1/completions (prompt as token ids, greedy, max_tokens = its output length, vLLM's
`ignore_eos` so every request makes exactly that many tokens, and `return_token_ids` so each SSE chunk
says how many tokens it carries) over one httpx.AsyncClient. A token's time is the arrival of the
chunk that holds it (a chunk of k tokens stamps k tokens at once, as the in-process driver stamps every
token of one engine step with that step's end). The clock starts at the scheduled arrival, so time
spent queued in the client, the network stack or the server counts. The timelines feed the same
serving_metrics as the in-process run (vLLM's definitions), so the two rows differ by the HTTP path:
JSON, SSE, the server's event loop and its hand-off to the engine thread.
A request that fails (status != 200, a broken stream) has no tokens and is not counted as completed;
`failed` says how many. Both timed passes run under `frozen_heap`: with torch imported, one full
garbage collection of the client's heap took ~0.3 s on 2 cores, long enough to make a whole stream's
tokens look as if they arrived at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time

from rlengine.benchmarks.serving_metrics import RequestTiming
from rlengine.model.config import ConfigError


def _httpx():
    try:
        import httpx
    except ImportError:
        raise ConfigError("--url needs httpx (the serve extra): pip install 'rlengine[serve]'") from None
    return httpx


@contextlib.contextmanager
def frozen_heap():
    """Collect once, then keep what exists out of the collector's sight for the timed pass."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def served_model(url: str, api_key: str | None = None) -> tuple[str, int | None]:
    """(model id, max_model_len or None) of the first model GET URL/v1/models lists."""
    httpx = _httpx()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ConfigError(f"--url {url}: no server answers ({exc})") from None
    if r.status_code != 200:
        raise ConfigError(f"--url {url}: GET /v1/models returned {r.status_code}: {r.text[:200]}")
    model = r.json()["data"][0]
    return model["id"], model.get("max_model_len")


async def _one(client, model: str, prompt: list[int], out_len: int, timing: RequestTiming, t0: float,
               clock) -> bool:
    delay = timing.arrival - (clock() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return False
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return False
            k = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
            if k:
                timing.token_times.extend([clock() - t0] * k)
    return True


async def drive_http(url: str, model: str, prompts: list[list[int]], out_lens: list[int], arrivals: list[float], *,
                     api_key: str | None = None, clock=time.perf_counter) -> tuple[list[RequestTiming], float, int]:
    """Send the schedule; returns each request's timeline, the duration and the number of failed requests."""
    httpx = _httpx()
    timings = [RequestTiming(arrival=a, input_len=len(p)) for a, p in zip(arrivals, prompts)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        t0 = clock()
        results = await asyncio.gather(*(_one(client, model, p, n, t, t0, clock)
                                         for p, n, t in zip(prompts, out_lens, timings)), return_exceptions=True)
        duration = clock() - t0
    failed = sum(1 for ok in results if ok is not True)
    for t, ok in zip(timings, results):
        if ok is not True:
            t.token_times.clear()
    return timings, duration, failed
