"""What generate() returns: vLLM-style RequestOutput / CompletionOutput plus the step trace.

text / prompt are None where the request had no text (token-id prompts without detokenize=True): the
trainer's requests are never detokenised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlengine.engine.sequence import Sequence
from rlengine.telemetry.records import StepRecord


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int                       # sample index within the request (0..n-1)
    token_ids: list[int]             # generated tokens
    logprobs: list[float]            # log-prob of each generated token (SamplingParams.logprobs_mode)
    finish_reason: str               # "stop" | "length" | "abort"
    policy_versions: list[int]       # engine weight version that sampled each token
    routing_ids: torch.Tensor | None = None  # [prompt + generated - 1, L_moe, K] int64 expert ids when recorded
    text: str | None = None          # detokenised output (cut at a stop string); None when not detokenised
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS / length)
    top_logprobs: list[dict[int, float]] | None = None  # per token: k most likely ids -> log-prob, + the sampled one


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt: str | None = None        # the prompt text (rendered chat for LLM.chat); None for token-id prompts


class GenerateResult(list):
    """A list of RequestOutput (in prompt order) that also carries the step trace of the call."""

    def __init__(self, outputs: list[RequestOutput], trace: list[StepRecord], stats: dict):
        super().__init__(outputs)
        self.trace = trace
        self.stats = stats


def completion_of(seq: Sequence) -> CompletionOutput:
    routing = None
    if seq.routing_ids:
        routing = torch.from_numpy(np.concatenate(seq.routing_ids)[: len(seq) - 1].astype(np.int64))
    text, stop_reason = None, seq.stop_reason
    if seq.detok is not None:
        seq.detok.finish()
        text = seq.detok.text
    return CompletionOutput(index=seq.index, token_ids=seq.output_token_ids, logprobs=list(seq.logprobs),
                            finish_reason=seq.finish_reason or "abort", policy_versions=list(seq.versions),
                            routing_ids=routing, text=text, stop_reason=stop_reason,
                            top_logprobs=None if seq.top_logprobs is None else list(seq.top_logprobs))


@dataclass(slots=True)
class RequestState:
    """Engine-side bookkeeping of one request."""

    request_id: str
    prompt: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    prompt_text: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, [completion_of(s) for s in self.seqs], self.finished,
                             self.prompt_text)
