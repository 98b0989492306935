"""Scoring responses: reward outcomes counted per batch, and the calls of whole engine outputs.

RewardScorer turns outcomes (rewards.py) into rewards and bounds the failures of one batch;
score_samples sends every sample of a batch of RequestOutputs through a reward runner
(reward_pool.py: this process or a worker pool) and gathers them in submission order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlengine.rl.data.reward_pool import InlineRunner
from rlengine.rl.data.rewards import RewardCall, RewardError, RewardFn, RewardOutcome, _takes_four, call_reward

if TYPE_CHECKING:
    from rlengine.engine.outputs import RequestOutput
    from rlengine.model.tokenizer import Tokenizer
    from rlengine.rl.data.tasks import Problem


class RewardScorer:
    """Counts the reward calls of one batch that fail and turns outcomes into rewards.

    A failure (an exception, a non-finite return value, a timeout) scores 0.0; the first one's
    formatted traceback is kept for the error message. check() raises RewardError when
    errors / total > max_error_frac. Use one scorer per batch. score() calls reward_fn here, in
    this process; record() accounts an outcome computed elsewhere (a worker process).
    """

    def __init__(self, reward_fn: RewardFn | None, max_error_frac: float):
        self.reward_fn = reward_fn
        self.four = None if reward_fn is None else _takes_four(reward_fn)
        self.max_error_frac = max_error_frac
        self.total = 0
        self.errors = 0
        self.first_error = ""          # formatted traceback of the first failure
        self.component_sums: dict[str, float] = {}

    def score(self, completion: str, answer: str, prompt: str = "", extra: dict | None = None) -> float:
        return self.record(call_reward(self.reward_fn, RewardCall(completion, answer, prompt, extra or {}),
                                       self.four))

    def record(self, outcome: RewardOutcome) -> float:
        self.total += 1
        if outcome.error:
            self.errors += 1
            if not self.first_error:
                self.first_error = outcome.error
            return 0.0
        for k, v in outcome.components.items():
            self.component_sums[k] = self.component_sums.get(k, 0.0) + v
        return outcome.score

    @property
    def error_frac(self) -> float:
        return self.errors / self.total if self.total else 0.0

    def component_means(self) -> dict[str, float]:
        """reward/<key>: the mean of each dict-returned component over this batch's calls."""
        return {f"reward/{k}": v / max(1, self.total) for k, v in sorted(self.component_sums.items())}

    def merge_ranks(self, dist) -> None:
        """Sum the counts of every rank (a Dist; all ranks call it) and keep the first rank's first
        traceback, so every rank decides alike and the failing rank's traceback is the one reported."""
        if dist is None or not dist.enabled:
            return
        parts = dist.all_gather_objects((self.errors, self.total, self.first_error))
        self.errors, self.total = sum(p[0] for p in parts), sum(p[1] for p in parts)
        self.first_error = next((p[2] for p in parts if p[2]), self.first_error)

    def check(self, where: str) -> None:
        """Raise RewardError when this batch's failure fraction is above the limit."""
        if self.error_frac > self.max_error_frac:
            raise RewardError(
                f"{where}: {self.errors} of {self.total} reward calls failed ({self.error_frac:.2%}), above "
                f"task.max_reward_error_frac = {self.max_error_frac}; the first failure was:\n{self.first_error}")


def score_samples(runner, scorer: RewardScorer, tokenizer: Tokenizer, problems: list[Problem],
                  outputs: list[RequestOutput]) -> list[list[float]]:
    """Rewards [len(problems)][n] of every sample of `outputs` (outputs[i] answers problems[i]) through
    `runner` (a reward_pool runner; all calls submitted at once, gathered in order), counted by `scorer`."""
    if len(problems) != len(outputs):
        raise ValueError(f"score_samples: {len(outputs)} outputs for {len(problems)} problems")
    tickets = [runner.submit([RewardCall(tokenizer.decode(c.token_ids), p.answer, p.prompt, dict(p.extra))
                              for c in out.outputs]) for p, out in zip(problems, outputs)]
    return [[scorer.record(o) for o in runner.gather(t)] for t in tickets]


def score_outputs(reward_fn: RewardFn, tokenizer: Tokenizer, problems: list[Problem], outputs: list[RequestOutput],
                  max_error_frac: float, where: str = "evaluation", dist=None) -> tuple[float, int]:
    """Mean reward over every sample of `outputs` (outputs[i] answers problems[i]) and the failure count,
    scored in this process.

    With a multi-rank `dist` (rlengine.rl.distributed.Dist), each rank passes its shard and gets the
    global mean and count. Raises RewardError when more than max_error_frac of the calls failed.
    """
    scorer = RewardScorer(reward_fn, max_error_frac)
    total = sum(sum(r) for r in score_samples(InlineRunner(reward_fn), scorer, tokenizer, problems, outputs))
    if dist is not None and dist.enabled:
        total = dist.all_sum([total])[0]
        scorer.merge_ranks(dist)
    scorer.check(where)
    return total / max(1, scorer.total), scorer.errors
