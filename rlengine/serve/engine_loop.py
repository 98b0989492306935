"""One engine loop behind every HTTP request: a thread that drives LLM.step and streams new tokens out.

    HTTP handler --submit(prompts, params)--> command queue --> engine thread: add_request / abort_request,
    LLM.step(), then per request the tokens, log-probs and text each sample gained --> RequestStream
    (streams.py: an asyncio queue on the server's event loop; one call_soon_threadsafe per step).

The thread owns the LLM: nothing else touches it, so the engine needs no lock. Requests join and leave
between steps (continuous batching across API requests, one scheduler). An API request with P prompts
is P engine requests; its choices are numbered prompt * n + sample. A request whose client went away
is aborted here, which frees its KV blocks at once. Text is streamed as the detokenizer emits it,
holding back the last len(longest stop string) - 1 characters while a sample runs, so a stop string
that completes later never retracts text already sent (vLLM holds back the same way).
Simplification: a sample's finish reason is sent when its whole engine request finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time

from rlengine.engine.llm import LLM
from rlengine.engine.outputs import CompletionOutput, RequestOutput
from rlengine.engine.sampling_params import SamplingParams
from rlengine.serve.metrics import ServerMetrics
from rlengine.serve.protocol import ApiError
from rlengine.serve.streams import RequestStream, Update, deliver

log = logging.getLogger("rlengine.serve")
TRACE_KEEP = 1024  # StepRecords kept on the LLM (a server runs forever; the trace would grow without bound)


class _Tracked:
    """Engine-thread state of one engine request: how much of each sample was sent."""

    __slots__ = ("stream", "first_choice", "sent_tokens", "sent_text", "hold", "first_token", "prompt_len")

    def __init__(self, stream: RequestStream, first_choice: int, params: SamplingParams, prompt_len: int):
        self.stream, self.first_choice, self.prompt_len = stream, first_choice, prompt_len
        self.sent_tokens, self.sent_text = [0] * params.n, [0] * params.n
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.first_token: float | None = None

    def progress(self, seq) -> Update | None:
        i, k = seq.index, self.sent_tokens[seq.index]
        n = len(seq.logprobs)  # tokens sampled and read (never an overlap placeholder)
        if n == k:
            return None
        start = seq.num_prompt_tokens
        text = seq.detok.text
        visible = max(self.sent_text[i], len(text) - self.hold)
        top = seq.top_logprobs[k:n] if seq.top_logprobs is not None else None
        up = Update(self.first_choice + i, seq.token_ids[start + k:start + n], seq.logprobs[k:n], top,
                    text[self.sent_text[i]:visible])
        self.sent_tokens[i], self.sent_text[i] = n, visible
        return up

    def final(self, c: CompletionOutput) -> Update:
        k, t = self.sent_tokens[c.index], self.sent_text[c.index]
        return Update(self.first_choice + c.index, c.token_ids[k:], c.token_logprobs[k:],
                      None if c.logprobs is None else c.logprobs[k:], (c.text or "")[t:], c.finish_reason,
                      c.stop_reason)


class EngineLoop:
    """The engine thread and its command queue (see the module docstring)."""

    def __init__(self, llm: LLM, metrics: ServerMetrics):
        self.llm, self.metrics = llm, metrics
        self.draining = False                  # set at shutdown: submit() refuses new requests
        self.failed: str | None = None         # the loop thread died (a bug): /health reports it
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list[tuple[RequestStream, object]] = []
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlengine-engine-loop", daemon=True)

    # ---- the HTTP side (event-loop thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompts: list[tuple[list[int], str | None]], params: SamplingParams) -> RequestStream:
        if self.draining or self.failed:
            raise ApiError(503, "the server is shutting down" if self.draining else f"engine failed: {self.failed}")
        stream = RequestStream(asyncio.get_running_loop(), time.perf_counter())
        self._commands.put(("add", stream, prompts, params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client went away: drop the request's samples and free their KV blocks (no-op once done)."""
        if not stream.done:
            self._commands.put(("abort", stream))

    def abort_all(self) -> None:
        """End every request in flight now: each choice gets a final update with finish_reason "abort"
        (the shutdown deadline; callable from any thread)."""
        self._commands.put(("abort_all",))

    @property
    def idle(self) -> bool:
        return not self._tracked and self._commands.empty()

    def stop(self, timeout: float) -> None:
        """Stop admitting; let requests in flight finish for up to `timeout` s, abort the rest; join."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while not self.idle and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(timeout=max(1.0, timeout))

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        try:
            while not self._stop.is_set():
                self._take_commands(block=not llm.has_unfinished())
                if not llm.has_unfinished():
                    continue
                try:
                    outputs = llm.step()
                except Exception as exc:  # a bug in a step: fail the requests in flight, keep serving
                    log.exception("engine step failed; aborting the requests in flight")
                    self._abort_all(ApiError(500, f"engine step failed: {exc!r}"))
                else:
                    self._publish(outputs)
                if len(llm.trace) > 2 * TRACE_KEEP:
                    del llm.trace[:-TRACE_KEEP]
            self._abort_all(None)
        except BaseException as exc:  # a bug outside a step: nothing more can run, so end every request
            self.failed = repr(exc)
            log.exception("the engine loop stopped")
            self._abort_all(ApiError(500, f"the engine loop stopped: {exc!r}"))
            raise

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(cmd[1], None)
            else:
                self._abort_all(None)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._record_gauges(0)
        self._flush()

    def _add(self, stream: RequestStream, prompts, params: SamplingParams) -> None:
        rids = []
        try:
            for ids, text in prompts:
                rid = str(next(self._ids))
                self.llm.add_request(ids, params, request_id=rid, prompt=text)
                rids.append(rid)
        except Exception as exc:  # ValueError / TypeError: the engine's own checks (vocabulary, n, KV pool size)
            for rid in rids:
                self.llm.abort_request(rid)
            if not isinstance(exc, (ValueError, TypeError)):
                log.exception("add_request failed")
            status = 400 if isinstance(exc, (ValueError, TypeError)) else 500
            self._outbox.append((stream, ApiError(status, str(exc))))
            return
        stream.rids = rids
        for i, (rid, (ids, _)) in enumerate(zip(rids, prompts)):
            self._tracked[rid] = _Tracked(stream, i * params.n, params, len(ids))
        self._outbox.append((stream, "accepted"))

    def _abort(self, stream: RequestStream, error: ApiError | None) -> None:
        """Abort the stream's unfinished engine requests; its consumer gets `error`, or a final "abort"
        update per choice (None: the client is gone or the server stops)."""
        ups = []
        for rid in stream.rids:
            tr = self._tracked.pop(rid, None)
            if tr is None:
                continue
            self.llm.abort_request(rid)
            self.metrics.record_finish("abort", prompt_tokens=tr.prompt_len, ttft=None, tpot=None)
            ups += [Update(tr.first_choice + i, [], [], None, "", "abort") for i in range(len(tr.sent_tokens))]
        if ups or error is not None:
            self._outbox += [(stream, error if error is not None else ups), (stream, None)]

    def _abort_all(self, error: ApiError | None) -> None:
        for stream in {tr.stream: None for tr in self._tracked.values()}:
            self._abort(stream, error)
        self._record_gauges(0)
        self._flush()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        finished = {o.request_id: o for o in outputs}
        now, tokens = time.perf_counter(), 0
        per_stream: dict[RequestStream, list[Update]] = {}
        for rid, tr in list(self._tracked.items()):
            if rid not in self._tracked:
                continue  # ended above with the rest of its API request
            out = finished.get(rid)
            if out is not None:
                ups = [tr.final(c) for c in out.outputs]
            else:
                state = self.llm.requests.get(rid)
                if state is None:  # gone from the engine without an output: end it rather than hang its client
                    log.error("engine request %s vanished; ending it with finish_reason 'abort'", rid)
                    self._abort(tr.stream, None)
                    continue
                ups = [u for u in (tr.progress(s) for s in state.seqs) if u is not None]
            if not ups:
                continue
            n = sum(len(u.token_ids) for u in ups)
            tokens += n
            if tr.first_token is None and n:
                tr.first_token = now
            per_stream.setdefault(tr.stream, []).extend(ups)
            if out is not None:
                self._finish(rid, tr, out, now)
        for stream, ups in per_stream.items():
            self._outbox.append((stream, ups))
            if not any(rid in self._tracked for rid in stream.rids):
                self._outbox.append((stream, None))
        self._record_gauges(tokens)
        self._flush()

    def _finish(self, rid: str, tr: _Tracked, out: RequestOutput, now: float) -> None:
        del self._tracked[rid]
        first = out.outputs[0]
        ttft = None if tr.first_token is None else tr.first_token - tr.stream.arrival
        tpot = (now - tr.first_token) / (len(first.token_ids) - 1) if len(first.token_ids) > 1 else None
        self.metrics.record_finish(first.finish_reason, prompt_tokens=tr.prompt_len, ttft=ttft, tpot=tpot)

    def _record_gauges(self, tokens: int) -> None:
        sched, bm = self.llm.scheduler, self.llm.block_manager
        running = {s.request_id for s in sched.running}
        waiting = {g[0].request_id for g in sched.waiting} - running
        self.metrics.record_step(tokens, running=len(running), waiting=len(waiting),
                                 kv_used=bm.num_blocks - bm.num_free)

    def _flush(self) -> None:
        """Hand this step's items to the event loops, one thread-safe call per loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in self._outbox:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        self._outbox = []
        for loop, items in by_loop.items():
            if not loop.is_closed():  # closed: the server stopped and nobody is listening
                loop.call_soon_threadsafe(deliver, items)
