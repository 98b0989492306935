"""The RL stage-to-stage record that several layers share: a scored group of responses.

rollout/collector.py produces RolloutGroups; algo/overlong.py shapes their rewards and
learner/batching.py packs them into a TrainBatch. Kept here, below all three, so the algorithm
layer never imports the rollout layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RolloutGroup:
    """G responses to one prompt (G trajectories in multi-turn rollouts), scored."""

    problem_index: int                  # index in task.train
    prompt_ids: list[int]
    completions: list[list[int]]        # [G] generated token ids
    logprobs: list[list[float]]         # [G] behaviour log-probs per generated token
    rewards: list[float]                # [G]
    versions: list[list[int]]           # [G] weight version that sampled each token
    finish_reasons: list[str]
    routing_ids: list = field(default_factory=list)   # [G] tensors [len-1, L_moe, K] or empty
    reward_errors: int = 0
    scores: list[float] = field(default_factory=list)        # [G] task rewards before shaping ([] = rewards)
    loss_weights: list[float] = field(default_factory=list)  # [G] 0 excludes a response from the loss; [] = all 1
    token_credits: list[list[float]] = field(default_factory=list)  # [G][len] per-token credit (train.credit = token)
    # multi-turn (rl/env/): [G][len] role of each completion token, 1 model, 0 observation; [] = all model. The
    # completion then holds every token after the prompt, logprobs 0.0 on observation tokens, versions the
    # model tokens' only; the learner's loss mask is 0 on observation tokens (learner/batching.py)
    roles: list[list[int]] = field(default_factory=list)
    turns: list[list[tuple[str, int, int]]] = field(default_factory=list)  # [G] (role, start, end) segments
    end_reasons: list[str] = field(default_factory=list)  # [G] "env" or the limit that cut the trajectory
    components: dict = field(default_factory=dict)  # key -> [G] named components of a dict-returning reward
    # remax (rollout/baseline.py): the prompt's greedy response, decoded beside the group, and its reward,
    # the advantage baseline; never trained on. None / []: no greedy baseline
    baseline: float | None = None
    baseline_ids: list[int] = field(default_factory=list)

    def lag(self, version: int) -> int:
        """Policy lag: updates between the oldest token of the group and the consuming update."""
        return version - min((min(v) for v in self.versions if v), default=version)
