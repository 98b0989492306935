"""Incremental detokenisation and stop strings: generated token ids -> CompletionOutput.text, as tokens arrive.

One Detokenizer per sample that needs text (a text or chat prompt, SamplingParams.detokenize=True, or stop
strings); token-only requests (the trainer's) have none and pay nothing. The LLM's postprocess feeds it
each sampled token (engine/llm.py) and finishes the sample when a stop string appears.
vLLM's approach: decode a window of ids twice, ids[prefix:read] (text already emitted) and ids[prefix:]
(the same plus the new tokens), and emit the difference. Starting the window a few tokens back keeps
decoders that strip a leading space (Metaspace) or merge bytes (byte-level BPE) right; a window that ends
in U+FFFD is an incomplete multi-byte character and waits for the next token. The window starts on the
prompt's last tokens, so the first generated token decodes in context. Simplification: at the end
(`finish`) whatever is still held back is flushed, so the text of a finished sample equals one-shot
decode(token_ids) for byte-level tokenizers; the window only grows while tokens add no text (skipped
special tokens).
Stop strings (vLLM semantics): searched, once more than min_tokens tokens exist, in the newly emitted
text plus the len(stop) - 1 characters before it; the text is cut at the first match, keeping the stop
string with include_stop_str_in_output.
The token that completed the match stays in token_ids (tokens are never split).
"""

from __future__ import annotations

from rlengine.model.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens the first window starts on (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
REPLACEMENT = "\ufffd"


class Detokenizer:
    """Text of one sample's generated tokens, built incrementally; applies the request's stop strings."""

    __slots__ = ("tok", "skip_special", "stops", "include_stop", "ids", "prefix", "read", "text", "stop_reason",
                 "_done", "min_tokens", "generated")

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tok, self.skip_special = tok, skip_special_tokens
        self.stops, self.include_stop = list(stop), include_stop_str_in_output
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: the window cannot start in context
        self.ids = context                # the window's token ids: prompt context, then generated tokens
        self.prefix, self.read = 0, len(context)  # ids[prefix:read] decode to text already emitted
        self.text = ""                    # emitted text (cut at a stop string once one matched)
        self.stop_reason: str | None = None  # the stop string that matched
        self._done = False
        self.min_tokens = min_tokens      # no stop string matches before more than this many tokens (vLLM)
        self.generated = 0                # generated tokens taken

    def _decode(self, ids: list[int]) -> str:
        return self.tok.hf.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token: int) -> bool:
        """Take one generated token; True when the text now contains a stop string (the sample must stop)."""
        self.ids.append(token)
        self.generated += 1
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return False  # no new text yet (a special token skipped, or half a character)
        return self._emit(after[len(before):])

    def _emit(self, new: str) -> bool:
        # the next window starts where this one's new tokens start, as in vLLM
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        if not self.stops or self.generated <= self.min_tokens:
            return False
        for stop in self.stops:
            at = self.text.find(stop, max(0, len(self.text) - len(new) - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at + len(stop) if self.include_stop else at]
                self.stop_reason = stop
                return True
        return False

    def finish(self) -> None:
        """Flush text held back for an incomplete character (idempotent; not after a stop string matched)."""
        if self._done or self.stop_reason is not None:
            return
        self._done = True
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before):
            self._emit(after[len(before):])
