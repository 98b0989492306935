"""Output processing: a step's sampled tokens -> sequences, stops, text, log-prob objects, finished requests.

The engine core (core.py) hands every read step here. For each sample: append its token (with async
scheduling in place of the placeholder the next launch appended), its log-prob and weight version;
the top-k Logprob dicts when asked (vLLM's shape); per-sample stops (EOS / stop_token_ids, stop
strings through the incremental detokenizer, the length limit); MoE routing ids for replay. A
finished sample returns its blocks through `finish` (the scheduler's); a request whose samples have
all finished becomes a RequestOutput. A multi-turn sample (a trajectory) that stops is paused instead
(`pause`, the scheduler's: it keeps its blocks) and listed in `turns_ended` for the caller
(engine/turns.py). This is where stop handling and detokenisation live.
"""

from __future__ import annotations

from typing import Callable

from rlengine.engine.model_runner import StepOutput
from rlengine.engine.outputs import Logprob, RequestOutput, RequestState
from rlengine.engine.sampling_params import SamplingParams
from rlengine.engine.scheduler import ScheduledBatch
from rlengine.engine.sequence import SequenceStatus
from rlengine.model.tokenizer import Tokenizer

PENDING = -1  # async scheduling: token_ids placeholder of a token still being sampled (never a real token id)


class OutputProcessor:
    """The requests in flight and what turns their steps into outputs."""

    def __init__(self, tokenizer: Tokenizer | None, eos_ids: frozenset[int], finish: Callable):
        self.tokenizer, self.eos_ids, self.finish = tokenizer, eos_ids, finish  # finish(seq, reason)
        self.pause: Callable | None = None  # pause(seq, reason): a trajectory's turn ended (Scheduler.pause)
        self.turns_ended: list = []  # trajectories paused since the caller last took them (engine/turns.py)
        self.requests: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}  # Logprob.decoded_token cache

    def process(self, batch: ScheduledBatch, out: StepOutput, version: int) -> list[RequestOutput]:
        """Each sample takes its token (async: in place of its placeholder); finished samples leave the
        running set and their blocks return; returns the requests that finished."""
        done: dict[str, RequestState] = {}
        finished, pending = SequenceStatus.FINISHED, PENDING  # locals: this loop runs B times per step
        top = out.top
        if out.prompt is not None:
            self._record_prompt_logprobs(batch, out.prompt)
        void = None  # async: indices of samples whose token is past a trajectory's turn (skipped)
        for i, (seq, token, logprob) in enumerate(zip(batch.samples, out.tokens, out.logprobs)):
            if seq.status is finished:
                continue  # aborted, or (async) stopped at the step before: this token is past its end
            if seq.void_outputs:  # async: a step launched past the end of a trajectory's turn
                seq.void_outputs -= 1
                void = (void or set()) | {i}
                continue
            ids = seq.token_ids
            if ids[-1] != pending:
                ids.append(token)
                at = len(ids) - 1
            else:  # async: the step launched after this one may have appended a placeholder too
                at = len(ids) - 2 if ids[-2] == pending else len(ids) - 1
                ids[at] = token
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if seq.multi_turn:  # roles are a trajectory's only: no per-token append for the others
                seq.roles.append(1)
            if top is not None and seq.top_logprobs is not None:
                seq.top_logprobs.append(self._logprob_entry(top[0][i], top[1][i], seq.params.logprobs, token,
                                                            logprob, top[2][i], seq.params))
            stop = token in seq.stop_ids
            if seq.detok is not None and (not stop or seq.detok.include_stop):
                # vLLM: a stop token's own text is left out unless include_stop_str_in_output
                if seq.detok.add(token) and not stop:
                    stop, seq.stop_reason = True, seq.detok.stop_reason
            if stop or at + 1 >= seq.max_len:
                if seq.multi_turn:  # it stays alive: the steps launched past its stop must not feed it
                    seq.void_outputs = len(ids) - at - 1
                del ids[at + 1:]  # async: the placeholder of a step launched past the stop
                sp = seq.params
                if stop and seq.stop_reason is None and token in sp.stop_token_ids and (
                        sp.ignore_eos or token not in self.eos_ids):
                    seq.stop_reason = token  # vLLM: a stop_token_ids entry (not an EOS id) is the stop reason
                if seq.multi_turn:
                    self.pause(seq, "stop" if stop else "length")
                    self.turns_ended.append(seq)
                    continue
                self.finish(seq, "stop" if stop else "length")
                state = self.requests[seq.request_id]
                if state.finished:
                    done[seq.request_id] = state
        if out.routing is not None:
            for i, (seq, rows) in enumerate(zip(batch.samples, out.routing)):
                if void is not None and i in void:
                    continue
                if batch.kind == "prefill" and batch.starts and batch.starts[batch.sample_rows[i]]:
                    seq.routing_ids.append(rows)  # a trajectory's chunk: its history's rows stay
                elif batch.kind == "prefill":
                    seq.routing_ids = [rows]  # a recompute replaces what the preempted run recorded
                else:
                    seq.routing_ids.append(rows)
        outputs = []
        for rid, state in done.items():
            outputs.append(state.output())
            del self.requests[rid]
        return outputs

    def _decoded(self, token: int, params: SamplingParams) -> str | None:
        if self.tokenizer is None or params.detokenize is False:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _logprob_entry(self, ids: list[int], lps: list[float], k: int, token: int, logprob: float, rank: int,
                       params: SamplingParams) -> dict[int, Logprob]:
        """vLLM's per-position dict: the k most likely tokens (ranks 1..k; filtered-out -inf left out), then the
        chosen token with its own rank."""
        entry = {t: Logprob(lp, r + 1, self._decoded(t, params))
                 for r, (t, lp) in enumerate(zip(ids[:k], lps[:k])) if lp != float("-inf")}
        if token not in entry:
            entry[token] = Logprob(logprob, rank, self._decoded(token, params))
        return entry

    def _record_prompt_logprobs(self, batch: ScheduledBatch, prompt: dict) -> None:
        """RequestState.prompt_logprobs of the prefilled sequences the runner scored: [None, {...}, ...]."""
        for r, (ids, lps, tok_lps, ranks) in prompt.items():
            seq = batch.seqs[r]
            state = self.requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is not None:
                continue
            p = seq.params
            state.prompt_logprobs = [None] + [
                self._logprob_entry(ids[j], lps[j], p.prompt_logprobs, t, tok_lps[j], ranks[j], p)
                for j, t in enumerate(seq.token_ids[1:seq.num_prompt_tokens])]
