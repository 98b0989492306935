"""Sequence: one sample in flight (prompt + generated tokens, KV blocks, sampling state).

A request with n samples owns n Sequences. The first one (the group leader) is prefilled;
its siblings wait in `fork_children` and are forked from its KV blocks right after that
prefill, so the prompt is processed once per request.
"""

from __future__ import annotations

import enum
import itertools

import torch

from rlengine.engine.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, block table and per-sample sampling state of one sample."""

    __slots__ = ("seq_id", "request_id", "index", "token_ids", "num_prompt_tokens", "logprobs", "versions",
                 "block_table", "num_cached_tokens", "status", "params", "generator", "finish_reason",
                 "fork_children", "routing_ids", "arrival")

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                 generator: torch.Generator | None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index                      # sample index within the request
        self.token_ids = list(prompt)           # prompt followed by generated tokens
        self.num_prompt_tokens = len(prompt)
        self.logprobs: list[float] = []         # one per generated token
        self.versions: list[int] = []           # weight version that sampled each generated token
        self.block_table: list[int] = []
        self.num_cached_tokens = 0              # tokens whose K/V is in the cache
        self.status = SequenceStatus.WAITING
        self.params = params
        self.generator = generator
        self.finish_reason: str | None = None
        self.fork_children: list[Sequence] = []  # siblings forked after this sequence's prefill
        self.routing_ids: list[torch.Tensor] = []  # per step [tokens, L_moe, K] expert ids (routing replay)
        self.arrival = self.seq_id

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def group_size(self) -> int:
        """Sequences admitted together with this one (itself plus unforked siblings)."""
        return 1 + len(self.fork_children)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
