"""Greedy baselines (ReMax): one argmax response per prompt, decoded by the rollout engine beside the
prompt's sampled group, with the same weights, scored by the same reward: the group's advantage baseline.

Sits inside the rollout collector (collector.py). add() queues the greedy request right after its
group's (temperature 0, n = 1, the group's length cap and stop tokens); take() filters each engine
step's outputs: a finished baseline is sent to the reward runner at once, and a group's output reaches
the collector only once its baseline has finished too. So every group the collector scores carries its
baseline (finish() sets RolloutGroup.baseline and .baseline_ids), and the baseline's decode falls inside
collect(): the update's t_gen and its engine trace (gen_tokens) count it. Baseline responses are never
trained on; batching reads only their reward. Simplification: as in verl 0.9.1 (one generate call with a
do_sample = False copy of each prompt), the greedy request is a request of its own, not a fork of the
group: one more prefill of the prompt, and the engine's one-SamplingParams-per-request model unchanged.
A failing baseline reward scores 0 and counts in the group's reward_errors.
"""

from __future__ import annotations

import dataclasses

from rlengine.engine import LLM, SamplingParams
from rlengine.rl.data.rewards import RewardCall
from rlengine.rl.distributed import Dist
from rlengine.rl.rollout_group import RolloutGroup


class GreedyBaselines:
    """The greedy baseline requests of one rollout engine, each keyed by its group's request id."""

    def __init__(self, llm: LLM, tokenizer, runner, params: SamplingParams):
        """runner: the collector's reward runner (reward_pool.py); params: the group's sampling params."""
        self.llm, self.tok, self.runner = llm, tokenizer, runner
        self.params = dataclasses.replace(params, n=1, temperature=0.0, seed=None)  # argmax, no draw
        self.decoding: dict[str, str] = {}      # group request id -> its baseline's request id, still decoding
        self.group_of: dict[str, str] = {}      # baseline request id -> group request id
        self.problems: dict[str, object] = {}   # group request id -> its task Problem (the reward's inputs)
        self.scored: dict[str, tuple[int, list[int]]] = {}  # group request id -> (runner ticket, greedy ids)
        self.held: dict[str, object] = {}       # group request id -> its finished output, waiting for the baseline

    def add(self, rid: str, prompt: list[int], problem) -> None:
        """Queue the greedy baseline of group request `rid` (prompt token ids, its task Problem)."""
        brid = self.llm.add_request(prompt, self.params)
        self.decoding[rid], self.group_of[brid], self.problems[rid] = brid, rid, problem

    def take(self, outs: list) -> list:
        """An engine step's outputs minus the baselines; a group's output once its baseline is done too."""
        ready = []
        for out in outs:
            rid = self.group_of.pop(out.request_id, None)
            if rid is not None:  # a baseline finished: its reward call goes out now
                del self.decoding[rid]
                ids, p = list(out.outputs[0].token_ids), self.problems.pop(rid)
                call = RewardCall(self.tok.decode(ids), p.answer, p.prompt, dict(p.extra))
                self.scored[rid] = (self.runner.submit([call]), ids)
                if rid in self.held:
                    ready.append(self.held.pop(rid))
            elif out.request_id in self.decoding:  # the group finished first: it waits for its baseline
                self.held[out.request_id] = out
            else:
                ready.append(out)
        return ready

    def finish(self, group: RolloutGroup, rid: str) -> None:
        """Set the baseline of group request `rid` (returned by take()) on `group`, waiting for its reward."""
        ticket, group.baseline_ids = self.scored.pop(rid)
        (outcome,) = self.runner.gather(ticket)
        group.baseline = 0.0 if outcome.error else outcome.score
        group.reward_errors += bool(outcome.error)

    def abort(self, rid: str) -> None:
        """Forget group request `rid`'s baseline (its group was aborted or drained): abort or discard it."""
        brid = self.decoding.pop(rid, None)
        if brid is not None:
            self.llm.abort_request(brid)
            del self.group_of[brid]
        if rid in self.scored:
            self.runner.discard(self.scored.pop(rid)[0])
        self.held.pop(rid, None)
        self.problems.pop(rid, None)

    def drain(self) -> None:
        """Forget every baseline (the collector drains at checkpoints and at shutdown)."""
        for rid in {*self.decoding, *self.scored, *self.held}:
            self.abort(rid)


def baseline_metrics(groups: list[RolloutGroup], dist: Dist) -> dict:
    """remax/*: the update's greedy baselines over all ranks (every rank calls it): their mean reward, and
    their mean length and total tokens (decoded in the update, counted in gen_tokens, not trained on)."""
    rows = [r for part in dist.all_gather_objects([(g.baseline, len(g.baseline_ids)) for g in groups]) for r in part]
    if not rows:
        return {}
    return {"remax/baseline_reward_mean": sum(r for r, _ in rows) / len(rows),
            "remax/baseline_length_mean": sum(n for _, n in rows) / len(rows),
            "remax/baseline_tokens": sum(n for _, n in rows)}
