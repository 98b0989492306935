"""`rlengine serve` under load: many concurrent requests, clients that walk away, and memory over time.

All against the tiny preset in batch-invariant mode (tests/serve/conftest.py), so a request's greedy
output cannot depend on what it was batched with, and the reference is the in-process
LLM(batch_invariant=True) run on that prompt alone. Traffic goes to 127.0.0.1 only and every loop is
bounded: a fixed number of requests, a semaphore on concurrency, deadlines on every wait.
"""

import asyncio
import random
import time

import httpx
import openai
import torch

from rlengine import LLM, SamplingParams

from tests.support.http_server import scrape

ABORTED = 'rlengine_request_finished_total{finished_reason="abort"}'


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_256_concurrent_requests_each_equal_their_single_request_output(tiny_server):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 80))] for _ in range(256)]
    max_tokens = [rng.randint(1, 24) for _ in range(256)]

    async def run():
        client = _client(tiny_server)
        try:
            return await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=p, max_tokens=m, temperature=0, extra_body={"return_token_ids": True})
                for p, m in zip(prompts, max_tokens)))
        finally:
            await client.close()

    outs = asyncio.run(run())
    ref, threads = LLM("tiny", batch_invariant=True), torch.get_num_threads()
    torch.set_num_threads(1)  # 256 tiny generate() calls: a second thread only adds sync cost
    try:
        for p, m, out in zip(prompts, max_tokens, outs):
            alone = ref.generate([p], SamplingParams(temperature=0.0, max_tokens=m))[0].outputs[0]
            assert out.choices[0].model_extra["token_ids"] == alone.token_ids
            assert out.choices[0].finish_reason == alone.finish_reason
    finally:
        torch.set_num_threads(threads)


def test_clients_that_disconnect_leave_no_kv_blocks_held(tiny_server):
    url, long = tiny_server.url, 900
    before = scrape(url)
    body = {"model": "tiny", "max_tokens": long, "ignore_eos": True, "temperature": 0}

    async def streaming(i):
        async with httpx.AsyncClient(timeout=30) as c:
            req = {**body, "prompt": [5 + i, 6, 7], "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=req) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        return seen  # leaving both contexts closes the connection mid-stream

    async def waiting(i):  # non-streamed: the client gives up before the answer
        async with httpx.AsyncClient(timeout=0.3) as c:
            try:
                await c.post(url + "/v1/completions", json={**body, "prompt": [9, 9, i]})
            except httpx.TimeoutException:
                return 0
        raise AssertionError("a 900-token request answered within 0.3 s: the test cannot see the abort")

    async def run():
        return await asyncio.gather(*(streaming(i) for i in range(32)), *(waiting(i) for i in range(4)))

    assert asyncio.run(run())[:32] == [3] * 32
    deadline, m = time.monotonic() + 20, scrape(url)
    while (m["rlengine_kv_blocks_used"] or m["rlengine_num_requests_running"] or m["rlengine_num_requests_waiting"]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        m = scrape(url)
    assert m["rlengine_kv_blocks_used"] == 0 and m["rlengine_num_requests_running"] == 0
    assert m["rlengine_num_requests_waiting"] == 0
    assert m.get(ABORTED, 0) - before.get(ABORTED, 0) == 36
    # run to the end, the 36 requests would have made 36 x 900 tokens
    assert m["rlengine_generation_tokens_total"] - before["rlengine_generation_tokens_total"] < 36 * long / 4


def test_resident_memory_is_flat_from_request_500_to_2000(tiny_server):
    rng = random.Random(1)
    jobs = [([rng.randrange(3, 256) for _ in range(rng.randint(1, 16))], rng.randint(1, 4), i % 5 == 0)
            for i in range(2000)]

    async def run():
        client, limit = _client(tiny_server), asyncio.Semaphore(32)

        async def one(prompt, max_tokens, stream):
            async with limit:
                if stream:
                    async for _ in await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                                   n=2, temperature=1.0, stream=True):
                        pass
                else:
                    out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0, logprobs=2)
                    assert out.usage.completion_tokens >= 1

        try:
            await asyncio.gather(*(one(*j) for j in jobs[:500]))
            at_500 = (await asyncio.to_thread(scrape, tiny_server.url))["process_resident_memory_bytes"]
            await asyncio.gather(*(one(*j) for j in jobs[500:]))
            at_2000 = (await asyncio.to_thread(scrape, tiny_server.url))["process_resident_memory_bytes"]
            return at_500, at_2000
        finally:
            await client.close()

    at_500, at_2000 = asyncio.run(run())
    assert abs(at_2000 - at_500) <= 0.05 * at_500, (at_500, at_2000)
