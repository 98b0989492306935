"""What generate() returns: vLLM-style RequestOutput / CompletionOutput plus the step trace.

text / prompt are None where the request had no text (token-id prompts without detokenize=True): the
trainer's requests are never detokenised. token_logprobs (the log-prob of each sampled token) is always
filled: it is what the learner trains on. logprobs / prompt_logprobs are vLLM's shapes, filled only when
SamplingParams asks for them: per position {token_id: Logprob} holding the k most likely tokens and the
sampled (or prompt) token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlengine.engine.sequence import Sequence
from rlengine.telemetry.records import StepRecord


@dataclass(slots=True)
class Logprob:
    """vLLM's per-token log-prob record."""

    logprob: float                   # log-prob under the sample's distribution (SamplingParams.logprobs_mode)
    rank: int                        # 1 + the number of tokens with a higher log-prob at this position
    decoded_token: str | None = None  # the token's text; None without a tokenizer or with detokenize=False


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int                       # sample index within the request (0..n-1)
    token_ids: list[int]             # generated tokens
    token_logprobs: list[float]      # log-prob of each generated token (SamplingParams.logprobs_mode), always
    finish_reason: str               # "stop" | "length" | "abort"
    policy_versions: list[int]       # engine weight version that sampled each token
    cumulative_logprob: float = 0.0  # sum of token_logprobs
    routing_ids: torch.Tensor | None = None  # [prompt + generated - 1, L_moe, K] int64 expert ids when recorded
    text: str | None = None          # detokenised output (cut at a stop string); None when not detokenised
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS / length)
    logprobs: list[dict[int, Logprob]] | None = None  # SamplingParams.logprobs=k: per token, top k + the sampled


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt: str | None = None        # the prompt text (rendered chat for LLM.chat); None for token-id prompts
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # prompt_logprobs=k: per prompt token, first None


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
    lps = list(seq.logprobs)
    return CompletionOutput(index=seq.index, token_ids=seq.output_token_ids, token_logprobs=lps,
                            finish_reason=seq.finish_reason or "abort", policy_versions=list(seq.versions),
                            cumulative_logprob=float(sum(lps)), routing_ids=routing, text=text,
                            stop_reason=stop_reason,
                            logprobs=None if seq.top_logprobs is None else list(seq.top_logprobs))


@dataclass(slots=True)
class RequestState:
    """Engine-side bookkeeping of one request."""

    request_id: str
    prompt: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    prompt_text: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # set by the prefill that computes them

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, [completion_of(s) for s in self.seqs], self.finished,
                             self.prompt_text, self.prompt_logprobs)
