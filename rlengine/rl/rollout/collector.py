"""Rollout collection: prompts -> engine -> scored groups, with dynamic sampling and partial rollouts.

The collector keeps up to B_gen responses in flight in the engine (max_num_seqs). Each
request is one prompt with n = G samples. Finished groups are scored by the task's reward;
with dynamic sampling (DAPO), groups whose responses all pass or all fail are dropped and
more prompts are sampled until B_train = P*G responses are retained. Asynchronous partial
rollouts: when B_gen > B_train, requests still unfinished at an update boundary stay in the
engine and continue under the new weights; each response records its policy lag (updates
between its oldest token and the update that consumes it). A request whose lag passes max_lag
is aborted as soon as the weights move on (its KV blocks freed, a fresh prompt submitted in
its place), not generated to the end and then dropped. Rewards go through a RewardScorer per
collect() call: failures score 0 and are counted; above max_reward_error_frac the call raises.
Scoring overlaps decoding: a finished request's calls go to the reward runner (reward_pool.py)
at once and its group waits in `pending`; groups are applied (sampler update, dynamic-sampling
filter, retained) strictly in submission order at fixed points — coupled: at the end of each
wave; async: after the next engine step, or at once when the pending ones could complete the
batch — so the run is the same whether rewards run in this process or in worker processes.
Multi-turn (env = a TrajectoryDriver, rl/env/): each sample is a trajectory resident in the engine;
after every engine step the driver hands ended turns to their environments, and a finished request's
rewards are its environments' (no reward calls); rollout/trajectories.py builds its group. With greedy
baselines (remax), each prompt's argmax response is decoded beside its group (rollout/baseline.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rlengine.engine import LLM, SamplingParams
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.distributed import Dist
from rlengine.rl.rollout_group import RolloutGroup
from rlengine.rl.data.reward_pool import InlineRunner
from rlengine.rl.data.rewards import RewardCall
from rlengine.rl.data.scoring import RewardScorer
from rlengine.rl.algo.advantages import token_credits_uniform
from rlengine.rl.data.tasks import Problem, Task, assign_token_credits
from rlengine.rl.rollout.baseline import GreedyBaselines
from rlengine.rl.rollout.trajectories import group_from_trajectories


class PrioritySampler:
    """Samples prompt indices, weighting each by p(1-p) + floor for its estimated pass rate p.

    p is the posterior mean of a Beta(1, 1) prior updated with every scored response, so new
    prompts start at 0.5 (highest weight) and prompts that always pass or always fail fade.
    """

    def __init__(self, num_prompts: int, seed: int, enabled: bool = True, floor: float = 0.02):
        self.passes = [0.0] * num_prompts
        self.trials = [0] * num_prompts
        self.enabled, self.floor = enabled, floor
        self.rng = random.Random(seed)

    def pass_rate(self, i: int) -> float:
        return (self.passes[i] + 1.0) / (self.trials[i] + 2.0)

    def sample(self) -> int:
        if not self.enabled:
            return self.rng.randrange(len(self.trials))
        weights = [self.pass_rate(i) * (1 - self.pass_rate(i)) + self.floor for i in range(len(self.trials))]
        return self.rng.choices(range(len(weights)), weights=weights)[0]

    def update(self, i: int, rewards: list[float]) -> None:
        self.passes[i] += sum(min(1.0, max(0.0, r)) for r in rewards)
        self.trials[i] += len(rewards)

    def state_dict(self) -> dict:
        return {"passes": self.passes, "trials": self.trials, "rng": _rng_state(self.rng)}

    def load_state_dict(self, d: dict) -> None:
        self.passes, self.trials = list(d["passes"]), list(d["trials"])
        self.rng.setstate(_rng_from(d["rng"]))


def _rng_state(rng: random.Random) -> list:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _rng_from(d: list) -> tuple:
    return (d[0], tuple(d[1]), d[2])


@dataclass(slots=True)
class CollectStats:
    groups_scored: int = 0
    groups_dropped: int = 0
    groups_stale: int = 0                # finished groups dropped for policy lag > max_lag
    stale_aborted: int = 0               # requests aborted in flight once their lag passed max_lag
    reward_errors: int = 0
    reward_components: dict = field(default_factory=dict)  # reward/<key> means of dict-returning rewards
    filter_fallback: bool = False        # dynamic sampling hit its budget and kept groups unfiltered
    rewards: list = field(default_factory=list)  # rewards of the batch's responses on ALL ranks, in order
    scores: list = field(default_factory=list)   # THIS rank's scored rewards, before the filter / lag check
    trajectory_counts: dict = field(default_factory=dict)  # multi-turn: TrajectoryDriver.snapshot() (running totals)
    greedy_baselines: bool = False       # the groups carry greedy baselines (remax; the same on every rank)

    @property
    def retained_fraction(self) -> float:
        return (self.groups_scored - self.groups_dropped) / max(1, self.groups_scored)


def request_seed(run_seed: int, request_index: int) -> int:
    """The sampling seed of global request `request_index`: a hash of (run seed, index), never
    seed + i (which collides across requests) and never the rank, so the same request samples the
    same tokens whichever rank serves it and whatever else is in its batch."""
    digest = hashlib.blake2b(f"{run_seed}:{request_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed


class RolloutCollector:
    """Prompts -> engine -> scored groups for one rank (Dist) of a job.

    Coupled mode (B_gen = B_train) has global semantics: every rank draws the same prompts (the
    priority sampler sees every rank's rewards), global request i runs on rank i mod K with seed
    request_seed(seed, i), and groups are retained in global request order, in waves of the
    still-missing count, so K ranks reproduce one process exactly. Async mode (B_gen > B_train)
    runs per rank, each consuming P / K groups per update: statistically, not exactly, equivalent.
    """

    def __init__(self, llm: LLM, tokenizer: Tokenizer, task: Task, *, group_size: int, b_train: int, b_gen: int,
                 params: SamplingParams, sampler: PrioritySampler, dynamic_sampling: bool, max_lag: int,
                 max_filter_factor: int = 8, max_reward_error_frac: float = 0.01, dist: Dist | None = None,
                 seed: int = 0, runner=None, encode_prompt: Callable[[str], list[int]] | None = None,
                 token_credit: bool = False, env=None, baselines: GreedyBaselines | None = None):
        """runner: where reward calls run (reward_pool.InlineRunner / RewardPool; default: in this process
        with task.reward_fn). encode_prompt: prompt text -> token ids (default tokenizer.encode; the
        trainer passes the chat-template encoder). token_credit (train.credit = "token"): groups carry
        their per-token credits, and dynamic sampling drops a group only when those give no signal.
        env: a rl.env.TrajectoryDriver for multi-turn rollouts (None: one completion per sample).
        baselines: greedy baselines over this engine (remax; single-turn only)."""
        self.dist = dist or Dist()
        self.seed = seed
        self.next_request = 0                         # global request index of the next coupled submission
        self.llm, self.tok, self.task = llm, tokenizer, task
        self.G, self.b_train, self.b_gen = group_size, b_train, b_gen
        self.params = params
        self.sampler = sampler
        self.dynamic_sampling = dynamic_sampling
        self.max_lag = max_lag
        self.max_filter_factor = max_filter_factor
        self.max_reward_error_frac = max_reward_error_frac
        self.token_credit = token_credit
        self.filtering = True
        self.in_flight: dict[str, int] = {}          # request id -> problem index
        self.request_index: dict[str, int] = {}      # request id -> global request index (coupled mode)
        self.ready: list[RolloutGroup] = []           # retained groups not yet consumed
        self.checked_version = -1                     # weight version of the last stale scan
        self.runner = runner if runner is not None else InlineRunner(task.reward_fn)
        self.encode = encode_prompt or tokenizer.encode
        self.pending: deque[_PendingGroup] = deque()  # finished, scoring submitted, not yet applied (async)
        self.applicable = 0                           # pending groups submitted before the last engine step
        self.env = env
        self.baselines = baselines

    @property
    def async_mode(self) -> bool:
        return self.b_gen > self.b_train

    def _submit(self) -> None:
        idx = self.sampler.sample()
        prompt = self.encode(self.task.train[idx].prompt)
        self.in_flight[self._add(prompt, self.params, idx)] = idx

    def _add(self, prompt: list[int], params: SamplingParams, idx: int) -> str:
        if self.env is None:
            rid = self.llm.add_request(prompt, params)
            if self.baselines is not None:  # remax: the prompt's greedy response, decoded beside its group
                self.baselines.add(rid, prompt, self.task.train[idx])
            return rid
        rid = self.llm.add_request(prompt, self.env.first_turn(params), multi_turn=True)
        self.env.add(rid, params.n, self.task.train[idx])
        return rid

    def _step(self) -> list:
        """One engine step; with environments, the turns it ended get their observations."""
        outs = self.llm.step()
        if self.env is not None:
            self.env.advance(self.llm)
        return outs if self.baselines is None else self.baselines.take(outs)

    def collect(self, stats: CollectStats) -> list[RolloutGroup]:
        """Step the engine until B_train responses (P groups) are retained; returns exactly P groups.

        Dynamic sampling gives up filtering once max_filter_factor * P groups were scored in this
        call (a policy that passes or fails everything would otherwise sample forever); the
        remaining groups are then kept unfiltered and the fallback is counted.
        Raises RewardError when more than max_reward_error_frac of the responses scored in this
        call had a failing reward.
        """
        stats.greedy_baselines = self.baselines is not None
        if not self.async_mode:
            return self._collect_coupled(stats)
        need = self.b_train // self.G // self.dist.world
        scored_at_start = stats.groups_scored
        scorer = RewardScorer(None, self.max_reward_error_frac)
        while True:
            self.abort_stale(stats)
            self._drop_stale(stats)
            # groups scored since before the last step are applied; all pending ones when they could
            # complete the batch (then decoding more would only make work the batch does not need)
            complete = len(self.ready) + len(self.pending) >= need
            self._apply_pending(len(self.pending) if complete else self.applicable, scorer, stats)
            if len(self.ready) >= need:
                break
            if self.dynamic_sampling and stats.groups_scored - scored_at_start >= self.max_filter_factor * need:
                self.filtering, stats.filter_fallback = False, True
            # async mode keeps this rank's share of B_gen in flight
            cap = self.b_gen // self.G // self.dist.world
            while len(self.in_flight) < cap:
                self._submit()
            self.applicable = len(self.pending)
            for out in self._step():
                self.pending.append(self._submit_scoring(out))
        scorer.check(f"rollout batch at weight version {self.llm.weight_version}")
        batch, self.ready = self.ready[:need], self.ready[need:]
        self.filtering = True
        stats.rewards = [r for g in batch for r in g.rewards]
        stats.reward_components = scorer.component_means()
        if self.env is not None:
            stats.trajectory_counts = self.env.snapshot()
        return batch

    def _apply_pending(self, count: int, scorer: RewardScorer, stats: CollectStats) -> None:
        """Apply the oldest `count` pending groups, in submission order (waiting for their rewards)."""
        for _ in range(count):
            self._score(self._finish(self.pending.popleft(), scorer), stats)
        self.applicable = max(0, self.applicable - count)

    def _collect_coupled(self, stats: CollectStats) -> list[RolloutGroup]:
        """Waves of the still-missing group count until P groups are retained over all ranks; returns
        this rank's share of them (possibly none). Every rank makes the same decisions."""
        need, d = self.b_train // self.G, self.dist
        scored_at_start, retained, kept = stats.groups_scored, 0, []
        scorer = RewardScorer(None, self.max_reward_error_frac)
        while retained < need:
            if self.dynamic_sampling and stats.groups_scored - scored_at_start >= self.max_filter_factor * need:
                self.filtering, stats.filter_fallback = False, True
            missing = need - retained
            indices = [self.sampler.sample() for _ in range(missing)]
            first, self.next_request = self.next_request, self.next_request + missing
            for g, idx in enumerate(indices, start=first):
                if g % d.world == d.rank:
                    params = dataclasses.replace(self.params, seed=request_seed(self.seed, g))
                    rid = self._add(self.encode(self.task.train[idx].prompt), params, idx)
                    self.in_flight[rid] = idx
                    self.request_index[rid] = g
            pending: dict[int, _PendingGroup] = {}
            while self.in_flight:  # each finished group's rewards are computed while the rest decode
                for out in self._step():
                    pending[self.request_index.pop(out.request_id)] = self._submit_scoring(out)
            local = {g: self._finish(pending[g], scorer) for g in sorted(pending)}
            wave = [(g, grp.problem_index, grp.rewards, grp.reward_errors, self._uniform(grp)) for g, grp in local.items()]
            for g, idx, rewards, errors, uniform in sorted(w for part in d.all_gather_objects(wave) for w in part):
                stats.groups_scored += 1
                stats.reward_errors += errors
                self.sampler.update(idx, rewards)
                if g in local:
                    stats.scores.extend(rewards)
                if self.filtering and self.dynamic_sampling and self.G > 1 and uniform:
                    stats.groups_dropped += 1
                    continue
                retained += 1
                stats.rewards.extend(rewards)
                if g in local:
                    kept.append(local[g])
        self._check_rewards(scorer)
        self.filtering = True
        stats.reward_components = scorer.component_means()
        if self.env is not None:
            stats.trajectory_counts = self.env.snapshot()
        return kept

    def _check_rewards(self, scorer: RewardScorer) -> None:
        """The reward-error limit over this call's responses on all ranks; the first traceback wins."""
        scorer.merge_ranks(self.dist)
        scorer.check(f"rollout batch at weight version {self.llm.weight_version}")

    def abort_stale(self, stats: CollectStats) -> None:
        """Abort in-flight requests whose policy lag already exceeds max_lag (async mode only).

        A request's lag is measured as RolloutGroup.lag: current weight version minus the
        version of its oldest generated token. Later tokens are never older, so a request past
        max_lag now would be dropped when it finishes; aborting it frees its KV blocks for a
        fresh prompt. A request with no tokens yet (waiting, not prefilled) will be sampled by
        the current weights and is kept. Lags only grow when the weight version changes, so
        the scan runs once per version.
        """
        version = self.llm.weight_version
        if not self.async_mode or version == self.checked_version:
            return
        self.checked_version = version
        for rid in list(self.in_flight):
            state = self.llm.requests.get(rid)
            if state is None:  # finished, its output not handed out yet: scored (and lag-checked) by _score
                continue
            # versions are appended in nondecreasing order: versions[0] is the oldest token
            oldest = min((s.versions[0] for s in state.seqs if s.versions), default=version)
            if version - oldest > self.max_lag:
                self.llm.abort_request(rid)
                del self.in_flight[rid]
                if self.baselines is not None:
                    self.baselines.abort(rid)
                if self.env is not None:
                    self.env.drop(rid)
                stats.stale_aborted += 1

    def _drop_stale(self, stats: CollectStats) -> None:
        """Retained groups wait in `ready` while the weights move on; drop those past max_lag."""
        if not self.async_mode:
            return
        fresh = [g for g in self.ready if g.lag(self.llm.weight_version) <= self.max_lag]
        stats.groups_stale += len(self.ready) - len(fresh)
        self.ready = fresh

    def _submit_scoring(self, out) -> "_PendingGroup":
        """A finished request: hand its G reward calls to the runner; the group waits for them."""
        idx = self.in_flight.pop(out.request_id)
        if self.env is not None:  # the environments' rewards: nothing to score
            return _PendingGroup(idx, out, -1, self.env.pop(out.request_id))
        problem: Problem = self.task.train[idx]
        calls = [RewardCall(self.tok.decode(c.token_ids), problem.answer, problem.prompt, dict(problem.extra))
                 for c in out.outputs]
        return _PendingGroup(idx, out, self.runner.submit(calls))

    def _uniform(self, group: RolloutGroup) -> bool:
        """No learning signal in the group: all rewards equal, or with token credit all slot credits."""
        if self.token_credit:
            return token_credits_uniform(group.token_credits)
        return len(set(group.rewards)) == 1

    def _finish(self, pending: "_PendingGroup", scorer: RewardScorer) -> RolloutGroup:
        """A pending group with its rewards (failures score 0 and are counted by `scorer`), and its
        per-token credits with token_credit."""
        out, errors_before = pending.out, scorer.errors
        if pending.trajectories is not None:
            return group_from_trajectories(pending.problem_index, out, pending.trajectories)
        outcomes = self.runner.gather(pending.ticket)
        rewards = [scorer.record(o) for o in outcomes]
        group = RolloutGroup(pending.problem_index, out.prompt_token_ids, [c.token_ids for c in out.outputs],
                            [c.token_logprobs for c in out.outputs], rewards, [c.policy_versions for c in out.outputs],
                            [c.finish_reason for c in out.outputs],
                            [c.routing_ids for c in out.outputs if c.routing_ids is not None],
                            scorer.errors - errors_before)
        if self.baselines is not None:
            self.baselines.finish(group, out.request_id)
        # a dict-returning reward's named components, per response (gdpo reads them; a failed call: 0.0)
        group.components = {k: [o.components.get(k, 0.0) for o in outcomes]
                            for k in sorted({k for o in outcomes for k in o.components})}
        if self.token_credit:
            assign_token_credits([group], self.task, self.tok)
        return group

    def _score(self, group: RolloutGroup, stats: CollectStats) -> None:
        rewards = group.rewards
        stats.groups_scored += 1
        stats.reward_errors += group.reward_errors
        stats.scores.extend(rewards)
        self.sampler.update(group.problem_index, rewards)
        if self.async_mode and group.lag(self.llm.weight_version) > self.max_lag:
            stats.groups_stale += 1
            return
        if self.filtering and self.dynamic_sampling and self.G > 1 and self._uniform(group):
            stats.groups_dropped += 1
            return
        self.ready.append(group)

    def drain(self) -> None:
        """Abort everything in flight (checkpoint boundaries in async mode, shutdown)."""
        for rid in list(self.in_flight):
            self.llm.abort_request(rid)
            if self.env is not None:  # a resumed run starts these prompts afresh (counted: dropped_in_flight)
                self.env.drop(rid)
        self.in_flight.clear()
        self.request_index.clear()
        if self.baselines is not None:
            self.baselines.drain()
        for p in self.pending:  # finished but not applied: like unconsumed `ready` groups, not saved
            if p.trajectories is None:
                self.runner.discard(p.ticket)
        self.pending.clear()
        self.applicable = 0


@dataclass(slots=True)
class _PendingGroup:
    """A finished request whose reward calls are with the runner."""

    problem_index: int                  # index in task.train
    out: object                         # the engine's RequestOutput
    ticket: int                         # runner ticket of its G calls (-1: multi-turn, no calls)
    trajectories: list | None = None    # multi-turn: its G rl.env.Trajectory records, rewards included
