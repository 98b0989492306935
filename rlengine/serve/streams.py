"""The HTTP side of one API request: the updates the engine thread sends it, and how they arrive.

engine_loop.py's thread turns each engine step into Update objects (what every choice gained) and hands
them, with one loop.call_soon_threadsafe per step, to `deliver`, which runs on the server's event loop
and puts them on each request's RequestStream queue. The HTTP handler (app.py) awaits
`RequestStream.accepted` (the engine took the prompts, or refused them with an ApiError), then iterates
`updates()`. A reader that fell behind the engine gets everything queued since its last read merged
into one Update per choice, so a slow stream costs one write per catch-up, not one per engine step
(one run at 64 concurrent streams of the tiny preset on 2 loaded cores: 1.5x the request throughput).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlengine.engine.outputs import Logprob
from rlengine.serve.protocol import ApiError


@dataclass(slots=True)
class Update:
    """What one choice gained since its previous update."""

    choice: int                                        # prompt index * n + sample index
    token_ids: list[int]                               # new token ids
    token_logprobs: list[float]                        # their log-probs (SamplingParams.logprobs_mode "raw")
    top_logprobs: list[dict[int, Logprob]] | None      # per new token: top k + the sampled one, when asked
    text: str                                          # new text
    finish_reason: str | None = None                   # set on the choice's last update
    stop_reason: int | str | None = None               # the stop string / stop token that ended it


class RequestStream:
    """The HTTP side of one API request: `accepted` resolves when the engine took (or refused) its
    prompts; `updates()` yields lists of Update until every prompt finished."""

    def __init__(self, loop: asyncio.AbstractEventLoop, arrival: float):
        self.loop = loop
        self.arrival = arrival                 # perf_counter() at submit: TTFT starts here
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.done = False                      # the last update was delivered
        self.rids: list[str] = []              # engine request ids (engine thread only)

    async def updates(self):
        """Yields the updates queued since the last yield, one merged Update per choice: a reader that
        fell behind the engine catches up with one write, not one per step."""
        while True:
            merged: dict[int, Update] = {}
            item = await self.queue.get()
            while True:
                if item is None or isinstance(item, ApiError):
                    if merged:
                        yield list(merged.values())
                    self.done = True
                    if item is None:
                        return
                    raise item
                for up in item:
                    prev = merged.get(up.choice)
                    merged[up.choice] = up if prev is None else merge_updates(prev, up)
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            yield list(merged.values())


def merge_updates(a: Update, b: Update) -> Update:
    """Two consecutive updates of one choice as one."""
    top = None if a.top_logprobs is None else a.top_logprobs + (b.top_logprobs or [])
    return Update(a.choice, a.token_ids + b.token_ids, a.token_logprobs + b.token_logprobs, top, a.text + b.text,
                  b.finish_reason, b.stop_reason)


def deliver(items: list[tuple[RequestStream, object]]) -> None:
    """Runs on the event loop: resolve `accepted` futures and queue updates."""
    for stream, item in items:
        if item == "accepted":
            if not stream.accepted.done():
                stream.accepted.set_result(None)
        elif isinstance(item, ApiError) and not stream.accepted.done():
            stream.accepted.set_exception(item)
        else:
            stream.queue.put_nowait(item)
