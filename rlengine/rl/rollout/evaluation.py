"""Evaluation over named eval sets: mean@k and pass@k per set, J from the primary set.

Sits beside the trainer's loop: Trainer.evaluate() -> Evaluator.run() -> metrics. eval.sets maps
names to JSONL files ({name = "path.jsonl"}); with none, one set "heldout" is the task's own
held-out split (the behaviour before named sets existed, seeds and all). Every set is decoded in
one engine call (k samples per prompt at eval.temperature) and scored with the task's reward
through the job's reward runner. Per set:
    mean@k = mean reward over all prompts x k samples
    pass@k = fraction of prompts with at least one of their k samples correct (reward >=
             eval.pass_threshold). With exactly k samples drawn this equals the unbiased estimator
             1 - C(n-c, k) / C(n, k) of Chen et al. (2021) at n = k.
J (what N*, the tuner and the accounting read) is the mean@k of eval.primary (default: the first
set). Several ranks: prompt i of the concatenated sets runs on rank i mod K with seed
request_seed(run seed + 1, i), so the numbers are global and independent of K.
With an environment (env: a TrajectoryDriver over the eval engine, [env]) each sample is a multi-turn
episode run exactly as in training, and its reward is the environment's: J is measured on episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.engine import SamplingParams
from rlengine.rl.config import EvalSection
from rlengine.rl.data.scoring import RewardScorer, score_samples
from rlengine.rl.rollout.collector import request_seed
from rlengine.rl.data.tasks import Problem, Task, data_path, read_jsonl


@dataclass(slots=True)
class EvalSet:
    """One named list of held-out problems."""

    name: str
    problems: list[Problem]


def build_eval_sets(task: Task, section: EvalSection) -> list[EvalSet]:
    """eval.sets read from their JSONL files (DatasetError naming the file and line), or the task's split."""
    if not section.sets:
        return [EvalSet("heldout", list(task.eval))]
    return [EvalSet(name, read_jsonl(data_path(path))) for name, path in section.sets.items()]


class Evaluator:
    """Decodes and scores every eval set; run() returns the metrics of one evaluation."""

    def __init__(self, llm, encode, runner, tok, sets: list[EvalSet], section: EvalSection, *, max_tokens: int,
                 seed: int, max_error_frac: float, dist, env=None):
        self.llm, self.encode, self.runner, self.tok, self.env = llm, encode, runner, tok, env
        self.sets, self.cfg = sets, section
        self.max_tokens, self.seed, self.max_error_frac, self.dist = max_tokens, seed, max_error_frac, dist

    @property
    def problems(self) -> list[Problem]:
        return [p for s in self.sets for p in s.problems]

    def run(self) -> dict:
        """{"J", "eval_reward_errors", "eval/<name>/mean@k", "eval/<name>/pass@k", ...}; raises RewardError
        when more than task.max_reward_error_frac of the calls failed. Decodes on self.llm (the caller
        makes sure it reads the current weights)."""
        e, d, k = self.cfg, self.dist, self.cfg.k
        owner = [(s, p) for s, es in enumerate(self.sets) for p in es.problems]
        mine = [(i, s, p) for i, (s, p) in enumerate(owner) if i % d.world == d.rank]
        params = [SamplingParams(n=k, temperature=e.temperature, seed=request_seed(self.seed + 1, i),
                                 max_tokens=self.max_tokens) for i, _, _ in mine]
        scorer = RewardScorer(None, self.max_error_frac)
        if self.env is not None:
            rewards = self._episodes([p for _, _, p in mine], params)
        else:
            outs = self.llm.generate([self.encode(p.prompt) for _, _, p in mine], params) if mine else []
            rewards = score_samples(self.runner, scorer, self.tok, [p for _, _, p in mine], outs)
        # per set: reward sum, sample count, prompts passed, prompts -- summed over ranks
        sums = [0.0] * (4 * len(self.sets))
        for (_, s, _), r in zip(mine, rewards):
            sums[4 * s] += sum(r)
            sums[4 * s + 1] += len(r)
            sums[4 * s + 2] += float(any(x >= e.pass_threshold for x in r))
            sums[4 * s + 3] += 1.0
        if d.enabled:
            sums = d.all_sum(sums)
            scorer.merge_ranks(d)
        scorer.check("evaluation")
        metrics = {}
        for s, es in enumerate(self.sets):
            total, count, passed, prompts = sums[4 * s: 4 * s + 4]
            metrics[f"eval/{es.name}/mean@{k}"] = total / max(1.0, count)
            metrics[f"eval/{es.name}/pass@{k}"] = passed / max(1.0, prompts)
        metrics["J"] = metrics[f"eval/{e.primary_set}/mean@{k}"]
        metrics["eval_reward_errors"] = scorer.errors
        return metrics

    def _episodes(self, problems: list[Problem], params: list[SamplingParams]) -> list[list[float]]:
        """Rewards [len(problems)][k] of multi-turn episodes: the environment's, as in training (collector.py)."""
        drv, rids = self.env, []
        for p, sp in zip(problems, params):
            rids.append(self.llm.add_request(self.encode(p.prompt), drv.first_turn(sp), multi_turn=True))
            drv.add(rids[-1], sp.n, p)
        done: dict[str, list[float]] = {}
        while len(done) < len(rids):
            for out in self.llm.step():
                done[out.request_id] = [t.reward for t in drv.pop(out.request_id)]
            drv.advance(self.llm)
        return [done[r] for r in rids]
