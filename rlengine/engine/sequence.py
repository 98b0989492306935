"""Sequence: one sample in flight (prompt + generated tokens, KV blocks, sampling state).

A request with n samples owns n Sequences, queued and admitted together as one group: at
admission the scheduler gives the first (the leader) fresh KV blocks and forks them into the
others, and only the leader runs through the prefill forward; every member samples its first
token from the leader's last logits row. A preempted sequence comes back alone, keeping its
generated tokens, and is prefilled again (prompt + generated) on re-admission.
A multi-turn sequence (a trajectory, `multi_turn`) does not finish at a stop: it is PAUSED with its
KV blocks (`num_cached` tokens in the cache) until the caller appends an observation, which is then
prefilled as a chunk on top of that cache (engine/turns.py has the lifecycle); `roles` marks each
token after the prompt as the model's (1) or an observation's (0).
Finish conditions are fixed when the sequence is created (`stop_ids`, `max_len`), so the
per-step check is one set lookup and one length compare; samples that need text also carry a
Detokenizer (`detok`, None otherwise), which checks stop strings.
"""

from __future__ import annotations

import enum
import itertools

import numpy as np

from rlengine.engine.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PAUSED = "paused"       # multi-turn: a turn ended; waits for an observation (blocks kept unless preempted)


class Sequence:
    """Token ids, KV blocks and per-sample sampling state of one sample."""

    __slots__ = ("seq_id", "request_id", "index", "token_ids", "num_prompt_tokens", "logprobs", "versions",
                 "block_table", "row", "status", "params", "seed_key", "stop_ids", "max_len", "finish_reason",
                 "routing_ids", "detok", "stop_reason", "top_logprobs", "multi_turn", "num_cached", "roles",
                 "turn_start", "void_outputs")

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams, *,
                 seed_key: int | None = None, stop_ids: frozenset[int] = frozenset(), max_len: int | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index                      # sample index within the request
        self.token_ids = list(prompt)           # prompt followed by generated tokens
        self.num_prompt_tokens = len(prompt)
        self.logprobs: list[float] = []         # one per generated token
        self.versions: list[int] = []           # weight version that sampled each generated token
        self.block_table: list[int] = []        # KV block of each page (the BlockManager's bookkeeping)
        self.row = -1                           # row in the engine's per-sequence tables while it holds blocks
        self.status = SequenceStatus.WAITING
        self.params = params
        self.seed_key = seed_key                # sample_seed(params.seed, index); None: the engine's generator
        self.stop_ids = stop_ids                # a sampled token in here finishes the sequence ("stop")
        self.max_len = max_len if max_len is not None else len(prompt) + params.max_tokens  # "length" at this
        self.finish_reason: str | None = None
        self.routing_ids: list[np.ndarray] = []  # per step [tokens, L_moe, K] expert ids (routing replay)
        self.detok = None                       # engine.detokenizer.Detokenizer when the sample needs text
        self.stop_reason: int | str | None = None  # stop string / stop token id that finished it (not EOS)
        # SamplingParams.logprobs: per generated token {token id: outputs.Logprob} (CompletionOutput.logprobs)
        self.top_logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.multi_turn = False                 # a trajectory: a stop pauses it instead of finishing it
        self.num_cached = 0                     # leading tokens whose K/V the cache holds (a chunk prefill's start)
        self.roles: list[int] = []              # multi-turn only: per token after the prompt, 1 model, 0 observation
        self.turn_start = len(prompt)           # index in token_ids of the current model turn's first token
        self.void_outputs = 0                   # async: outputs of steps launched past its turn's end, to skip

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.multi_turn:
            self.roles.append(1)
