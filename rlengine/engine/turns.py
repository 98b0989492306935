"""Trajectories in the engine: a sequence that finished a turn waits with its KV, takes an observation, resumes.

    rid = llm.add_request(prompt_ids, params, multi_turn=True)   # params.n trajectories, one prefill
    llm.step() ...; for turn in llm.take_turns(): ...              # TurnOutput per ended model turn
    llm.continue_turn(turn.request_id, turn.index, obs_ids, max_tokens=32)   # appended, chunk-prefilled
    llm.end_trajectory(turn.request_id, turn.index)                # blocks freed; RequestOutput from step()

The lifecycle, in one place: a multi-turn sample that stops (a stop token, or its turn's max_tokens)
is paused by the output processor (Scheduler.pause: it keeps its blocks and row, and counts toward
max_num_seqs); continue_turn appends the observation (roles 0) and queues it (Scheduler.resume), and
the next prefill step runs only its last model token and the observation on top of its cached K/V
(attention/context_prefill.py); decoding resumes. The history is never prefilled again, unless the
trajectory was preempted while parked (memory pressure preempts parked ones first): then it is
recomputed whole. Token-in/token-out only: no detokenizer, stop strings or logit rules on trajectories
(the environment gets the text from the tokenizer; rl/env/ is the layer above). With async scheduling
the step launched before a turn's stop was read still samples for it: the output processor voids that
output (Sequence.void_outputs), whatever has happened to the trajectory since, and the chunk prefill
rewrites the one K/V slot that step wrote (the last model token's, with the same value).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class TurnOutput:
    """One model turn of a trajectory that just ended (LLM.take_turns)."""

    request_id: str
    index: int                  # sample index within the request
    token_ids: list[int]        # the turn's model tokens
    logprobs: list[float]       # their behaviour log-probs
    versions: list[int]         # weight version that sampled each
    finish_reason: str          # "stop" (a stop / EOS token) | "length" (the turn's max_tokens or max_model_len)
    num_tokens: int             # trajectory length so far: prompt, every turn and observation
    room: int                   # tokens max_model_len still leaves (0: the trajectory cannot continue)


def check_multi_turn(params, wants_text: bool, where: str) -> None:
    """ValueError naming why a multi-turn request cannot run on this engine."""
    if wants_text or params.has_rules or params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError(f"{where}: multi-turn requests are token-in/token-out: no text output, stop strings, "
                         "logprobs / prompt_logprobs records or logit rules (penalties, min_tokens, min_p)")


def take_turns(outputs, max_model_len: int) -> list[TurnOutput]:
    """The turns that ended since the last call, in the order they ended."""
    seqs, outputs.turns_ended = outputs.turns_ended, []
    out = []
    for seq in seqs:
        a = seq.turn_start - seq.num_prompt_tokens  # the turn's first generated token among roles
        model = sum(seq.roles[:a])  # model tokens before the turn: its offset in logprobs
        n = len(seq) - seq.turn_start
        out.append(TurnOutput(seq.request_id, seq.index, seq.token_ids[seq.turn_start:],
                              seq.logprobs[model:model + n], seq.versions[model:model + n], seq.finish_reason,
                              len(seq), max_model_len - len(seq)))
    return out


def paused_sequence(requests: dict, request_id: str, index: int, where: str) -> Sequence:
    state = requests.get(request_id)
    if state is None or not 0 <= index < len(state.seqs):
        raise ValueError(f"{where}: no trajectory {request_id!r}/{index} in flight")
    seq = state.seqs[index]
    if seq.status is not SequenceStatus.PAUSED:
        raise ValueError(f"{where}: trajectory {request_id!r}/{index} is {seq.status.value}, not waiting for an "
                         "observation")
    return seq


def append_observation(seq: Sequence, tokens: list[int], max_tokens: int, *, vocab_size: int, max_model_len: int,
                       max_blocks: int, blocks_for, where: str) -> None:
    """Validate and append an observation; the next turn may generate up to max_tokens (ValueError, seq untouched)."""
    if max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be >= 1, got {max_tokens}")
    bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{where}: observation token ids outside [0, vocab_size={vocab_size}): {bad[:5]}")
    n = len(seq) + len(tokens)
    if n >= max_model_len:
        raise ValueError(f"{where}: the trajectory would be {n} tokens with its observation, leaving no room to "
                         f"generate (max_model_len={max_model_len})")
    longest = min(n + max_tokens, max_model_len)
    if blocks_for(longest) > max_blocks:
        raise ValueError(f"{where}: the trajectory may reach {longest} tokens = {blocks_for(longest)} KV blocks, "
                         f"the cache has {max_blocks}")
    seq.token_ids.extend(tokens)
    seq.roles.extend([0] * len(tokens))
    seq.turn_start = len(seq)
    seq.max_len = longest
