"""Engine updates -> OpenAI response bodies: whole responses, SSE chunks, log-probs and usage.

engine_loop.py hands the HTTP handler lists of Update (new tokens, log-probs and text per choice);
a Responder accumulates them per choice and renders either one `text_completion` /
`chat.completion` body or one chunk per update (`text_completion` / `chat.completion.chunk`).
Log-probs take each endpoint's shape: /v1/completions {tokens, token_logprobs, top_logprobs (token text
-> log-prob, the top k plus the sampled token, as vLLM), text_offset}; /v1/chat/completions
{content: [{token, logprob, bytes, top_logprobs: the top k}]}. A log-prob of -inf (a token a filter
removed) is sent as -9999.0, as vLLM does, since JSON has no infinity. With return_token_ids (vLLM's
extension) every choice carries `token_ids` and the prompt's ids (`prompt_token_ids`: per choice for
completions, once per response for chat); streamed, the prompt ids ride on each choice's first chunk.
"""

from __future__ import annotations

import time
import uuid

from rlengine.engine.outputs import Logprob
from rlengine.serve.streams import Update

NEG_INF_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return x if x > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _token_text(token: int, entry: dict[int, Logprob]) -> str:
    lp = entry.get(token)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else f"token_id:{token}"


class _Choice:
    """Everything one choice produced so far."""

    __slots__ = ("token_ids", "text", "finish_reason", "stop_reason", "offset", "started")

    def __init__(self):
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.finish_reason = self.stop_reason = None
        self.offset = 0          # completions text_offset of the next token
        self.started = False     # a chunk was sent (chat: the role; return_token_ids: the prompt's ids)


class Responder:
    """Renders one API request's response. kind: "completion" | "chat"; prompts: the token ids of each
    prompt (choice i belongs to prompt i // n); logprobs: the k asked for (None: no log-probs)."""

    def __init__(self, kind: str, model: str, prompts: list[list[int]], n: int, *, logprobs: int | None,
                 return_token_ids: bool):
        self.kind, self.model, self.prompts, self.n = kind, model, prompts, n
        self.k, self.return_token_ids = logprobs, return_token_ids
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(prompts) * n)]
        self.logprobs: list[list] = [[] for _ in self.choices]  # rendered log-prob entries per choice

    # ---- accumulate ---------------------------------------------------------------------------------
    def _logprob_entries(self, c: _Choice, up: Update) -> list:
        out = []
        for tok, lp, entry in zip(up.token_ids, up.token_logprobs, up.top_logprobs or ()):
            text = _token_text(tok, entry)
            if self.kind == "completion":
                top = {_token_text(t, entry): _lp(e.logprob) for t, e in entry.items()}
                out.append((text, _lp(lp), top, c.offset))
                c.offset += len(text)
            else:
                top = sorted(((e.rank, t, e) for t, e in entry.items() if e.rank <= self.k), key=lambda x: x[0])
                out.append({"token": text, "logprob": _lp(lp), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": _token_text(t, entry), "logprob": _lp(e.logprob),
                                              "bytes": list(_token_text(t, entry).encode())} for _, t, e in top]})
        return out

    def add(self, up: Update) -> list:
        """Record one update; returns its rendered log-prob entries ([] without log-probs)."""
        c = self.choices[up.choice]
        c.token_ids += up.token_ids
        c.text.append(up.text)
        if up.finish_reason is not None:
            c.finish_reason, c.stop_reason = up.finish_reason, up.stop_reason
        entries = self._logprob_entries(c, up) if self.k is not None and up.top_logprobs is not None else []
        self.logprobs[up.choice] += entries
        return entries

    def _logprobs_body(self, entries: list) -> dict | None:
        if self.k is None:
            return None
        if self.kind == "chat":
            return {"content": entries}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- whole responses ----------------------------------------------------------------------------
    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            body = {"index": i, "logprobs": self._logprobs_body(self.logprobs[i]),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.kind == "chat":
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
                if self.return_token_ids:
                    body["prompt_token_ids"] = self.prompts[i // self.n]
            if self.return_token_ids:
                body["token_ids"] = c.token_ids
            choices.append(body)
        out = {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.kind == "chat" and self.return_token_ids:
            out["prompt_token_ids"] = self.prompts[0]
        return out

    # ---- streaming ----------------------------------------------------------------------------------
    def chunks(self, updates: list[Update]) -> list[dict]:
        """One SSE chunk per update, each with one choice (as OpenAI and vLLM send them)."""
        chunks = []
        for up in updates:
            c = self.choices[up.choice]
            first = not c.started
            c.started = True
            entries = self.add(up)
            body = {"index": up.choice, "logprobs": self._logprobs_body(entries), "finish_reason": up.finish_reason,
                    "stop_reason": up.stop_reason}
            if self.kind == "chat":
                body["delta"] = ({"role": "assistant", "content": up.text} if first else {"content": up.text})
            else:
                body["text"] = up.text
            if self.return_token_ids:
                body["token_ids"] = up.token_ids
                if first:
                    body["prompt_token_ids"] = self.prompts[up.choice // self.n]
            chunks.append(self._chunk([body]))
        return chunks

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
