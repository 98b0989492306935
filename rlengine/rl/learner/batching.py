"""TrainBatch: scored rollout groups packed into one variable-length token batch.

Each response becomes one packed sequence: input = prompt + completion[:-1] (the final
token is never an input), target = the next token at every position, loss mask = 1 on the
positions that predict completion tokens. Behaviour log-probs from the engine and the
advantages are laid on the same positions. Micro-batches are contiguous runs of whole
sequences; every loss is normalised by the FULL batch's count (rlengine/rl/algo/losses.py), so
accumulating micro-batch gradients gives exactly the full-batch gradient.
A multi-turn trajectory (RolloutGroup.roles) packs as one sequence too; its loss mask (and advantage)
is 0 on observation tokens, so every loss and aggregation that reads the mask skips them.
Dimension legend: T packed tokens, B sequences (= B_train responses), P prompts, G group size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from rlengine.rl.algo.registry import ESTIMATORS
from rlengine.rl.rollout_group import RolloutGroup


@dataclass(slots=True, kw_only=True)
class TrainBatch:
    """One optimizer update's worth of responses, packed."""

    input_ids: torch.Tensor      # [T] int64
    targets: torch.Tensor        # [T] int64 next token at each position (0 where masked)
    loss_mask: torch.Tensor      # [T] float 1 on completion-predicting positions
    old_logprobs: torch.Tensor   # [T] float behaviour log-probs (0 where masked)
    advantages: torch.Tensor     # [T] float (GRPO: the response's advantage on each of its tokens)
    rewards: torch.Tensor        # [B] float sequence reward
    seq_ids: torch.Tensor        # [T] int64 sequence index of each token
    cu_seqlens: list[int]        # [B+1] host
    routing_ids: torch.Tensor | None = None  # [T, L_moe, K] recorded expert ids (replay) or None
    # Set by the learner before its passes (Learner.prepare), None otherwise:
    learner_old_logprobs: torch.Tensor | None = None  # [T] the learner's own log-probs before the update
    is_weights: torch.Tensor | None = None   # [T] truncated rollout importance weights (train.rollout_is)
    old_values: torch.Tensor | None = None   # [T] PPO critic values before the update
    returns: torch.Tensor | None = None      # [T] PPO value targets (GAE)
    token_select: torch.Tensor | None = None  # [T] bool tokens a loss treats apart (PolicyLoss.select), whole batch

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def micro_batches(self, size: int) -> list["TrainBatch"]:
        """Contiguous micro-batches of `size` whole sequences (size <= 0: the batch itself)."""
        if size <= 0 or size >= self.num_seqs:
            return [self]
        return [self.sequences(s, min(self.num_seqs, s + size)) for s in range(0, self.num_seqs, size)]

    def split(self, parts: int) -> list["TrainBatch"]:
        """`parts` contiguous mini-batches of whole sequences, sizes as even as possible (the first
        num_seqs % parts one larger); empty ones where the batch has fewer sequences than parts."""
        if parts <= 1:
            return [self]
        q, r = divmod(self.num_seqs, parts)
        bounds = [0]
        for i in range(parts):
            bounds.append(bounds[-1] + q + (1 if i < r else 0))
        return [self.sequences(s, e) for s, e in zip(bounds, bounds[1:])]

    def sequences(self, s: int, e: int) -> "TrainBatch":
        """Sequences s..e-1 as their own TrainBatch (views; seq_ids and cu_seqlens rebased to 0)."""
        a, b = self.cu_seqlens[s], self.cu_seqlens[e]
        cut = lambda t: None if t is None else t[a:b]  # noqa: E731
        return TrainBatch(
            input_ids=self.input_ids[a:b], targets=self.targets[a:b], loss_mask=self.loss_mask[a:b],
            old_logprobs=self.old_logprobs[a:b], advantages=self.advantages[a:b],
            rewards=self.rewards[s:e], seq_ids=self.seq_ids[a:b] - s,
            cu_seqlens=[c - a for c in self.cu_seqlens[s:e + 1]], routing_ids=cut(self.routing_ids),
            learner_old_logprobs=cut(self.learner_old_logprobs), is_weights=cut(self.is_weights),
            old_values=cut(self.old_values), returns=cut(self.returns), token_select=cut(self.token_select))

    @staticmethod
    def filler(device) -> "TrainBatch":
        """A one-token micro-batch with no trained position: its losses and gradients are exactly 0.
        A rank with fewer micro-batches runs these so every rank joins the same collectives."""
        z = torch.zeros(1, device=device)
        ids = torch.zeros(1, dtype=torch.long, device=device)
        return TrainBatch(input_ids=ids, targets=ids, loss_mask=z, old_logprobs=z, advantages=z,
                          rewards=z, seq_ids=ids, cu_seqlens=[0, 1])

    @staticmethod
    def random_tokens(vocab_size: int, sequences: int, seq_len: int, device, seed: int = 0) -> "TrainBatch":
        """`sequences` packed sequences of seq_len random input and target ids (a filler otherwise): the
        shape of a micro-batch for measuring the learner's memory or time, whose values do not matter."""
        gen = torch.Generator().manual_seed(seed)
        T = sequences * seq_len
        mb = TrainBatch.filler(device)
        mb.input_ids = torch.randint(0, vocab_size, (T,), generator=gen).to(device)
        mb.targets = torch.randint(0, vocab_size, (T,), generator=gen).to(device)
        mb.cu_seqlens = [i * seq_len for i in range(sequences + 1)]
        return mb

    def to(self, device) -> "TrainBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(input_ids=move(self.input_ids), targets=move(self.targets),
                          loss_mask=move(self.loss_mask), old_logprobs=move(self.old_logprobs),
                          advantages=move(self.advantages), rewards=move(self.rewards), seq_ids=move(self.seq_ids),
                          cu_seqlens=self.cu_seqlens, routing_ids=move(self.routing_ids),
                          learner_old_logprobs=move(self.learner_old_logprobs), is_weights=move(self.is_weights),
                          old_values=move(self.old_values), returns=move(self.returns),
                          token_select=move(self.token_select))


def pack(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
         seq_advantages: list[float], rewards: list[float], routing: list | None = None,
         loss_weights: list[float] | None = None, token_advantages: list[list[float]] | None = None,
         roles: list[list[int] | None] | None = None) -> TrainBatch:
    """Pack B responses. loss_weights [B] (default all 1) scale each response's loss mask: 0 leaves it
    in the batch with no gradient (train.overlong = "mask"). roles [B] (multi-turn; None or a None
    entry: all model tokens): 1 model, 0 observation per completion token; observation tokens get mask
    and advantage 0. Raises ValueError for an empty completion or mismatched log-probs / roles."""
    ids, tgts, mask, old, adv, sid, cu = [], [], [], [], [], [], [0]
    weights = loss_weights or [1.0] * len(completions)
    for b, (p, c, lp, a) in enumerate(zip(prompts, completions, logprobs, seq_advantages)):
        if not c or len(lp) != len(c):
            raise ValueError(f"response {b}: {len(c)} tokens with {len(lp)} log-probs (need equal, >= 1)")
        seq = p + c
        n_in = len(seq) - 1
        ids.extend(seq[:-1])
        tgts.extend(seq[1:])
        pad = len(p) - 1
        role = roles[b] if roles else None
        if role is not None and len(role) != len(c):
            raise ValueError(f"response {b}: {len(c)} tokens with {len(role)} roles")
        token_adv = list(token_advantages[b]) if token_advantages else [a] * len(c)
        if role is None:
            mask.extend([0.0] * pad + [weights[b]] * len(c))
        else:
            mask.extend([0.0] * pad + [weights[b] * r for r in role])
            token_adv = [x * r for x, r in zip(token_adv, role)]
        old.extend([0.0] * pad + list(lp))
        adv.extend([0.0] * pad + token_adv)
        sid.extend([b] * n_in)
        cu.append(cu[-1] + n_in)
    route = None
    if routing:
        route = torch.cat([r[: cu[i + 1] - cu[i]] for i, r in enumerate(routing)])
    f32, i64 = torch.float32, torch.int64  # explicit: an empty batch (a rank with no groups) keeps its dtypes
    return TrainBatch(input_ids=torch.tensor(ids, dtype=i64), targets=torch.tensor(tgts, dtype=i64),
                      loss_mask=torch.tensor(mask, dtype=f32), old_logprobs=torch.tensor(old, dtype=f32),
                      advantages=torch.tensor(adv, dtype=f32), rewards=torch.tensor(rewards, dtype=f32),
                      seq_ids=torch.tensor(sid, dtype=i64), cu_seqlens=cu, routing_ids=route)


def estimate_batch(groups: list[RolloutGroup], estimator, opts, *, token_credit: bool = False) -> TrainBatch:
    """The update's TrainBatch under an advantage estimator (rl/algo/registry.py): an outcome estimator's
    advantages, one per response broadcast over its tokens (with token_credit, one per token from the
    groups' token_credits through estimator.token_fn); a critic estimator's batch carries zeros, which
    the learner replaces with its GAE advantages. opts: the train.* options the estimator reads."""
    if estimator.critic or estimator.needs:  # the learner computes these (GAE; learner/token_baseline.py)
        return ppo_batch(groups)
    if not groups:  # this rank's share of the update can be empty
        return _flatten(groups, torch.zeros(0, 0))
    if estimator.token_level_fn is not None:
        fn = estimator.token_level_fn
        if estimator.components:  # gdpo: the named reward components, [B] per key in packing order
            keys = {k for g in groups for k in g.components}
            fn = functools.partial(fn, components_B={k: torch.tensor(
                [v for g in groups for v in g.components.get(k, [0.0] * len(g.completions))]) for k in keys})
        if estimator.greedy_baseline:  # remax: each response gets its prompt's greedy reward, [B] packing order
            fn = functools.partial(fn, baseline_B=greedy_baselines(groups))
        return _token_level(groups, fn, opts)
    rewards_PG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    token_adv = [a for g in groups for a in estimator.token_fn(g.token_credits, opts)] if token_credit else None
    return _flatten(groups, estimator.fn(rewards_PG, opts), token_adv)


def greedy_baselines(groups: list[RolloutGroup]) -> torch.Tensor:
    """[B] float32: each response's group baseline (RolloutGroup.baseline), in packing order; ValueError
    naming the group when the rollout decoded none (the collector was built without greedy baselines)."""
    missing = [g.problem_index for g in groups if g.baseline is None]
    if missing:
        raise ValueError(f"the estimator needs each prompt's greedy baseline, but groups of problems {missing} "
                         "have none (RolloutCollector needs baselines=GreedyBaselines(...))")
    return torch.tensor([g.baseline for g in groups for _ in g.completions], dtype=torch.float32)


def _token_level(groups: list[RolloutGroup], fn, opts) -> TrainBatch:
    """A token-level estimator's batch: each response as a row that starts at its first trained token
    (right-padded to the longest), its reward on its last trained token, mask = the loss mask (0 on
    observation tokens), index = its group; the [B, L] advantages go back onto the packed positions."""
    batch = _flatten(groups, torch.zeros(len(groups), max(len(g.completions) for g in groups)))
    starts, ends = [], []
    for a, e in zip(batch.cu_seqlens, batch.cu_seqlens[1:]):
        trained = (batch.loss_mask[a:e] > 0).nonzero().flatten()
        starts.append(a + int(trained[0]) if len(trained) else e)
        ends.append((a + int(trained[-1]) + 1) if len(trained) else e)
    L = max((e - s for s, e in zip(starts, ends)), default=0)
    rewards_BL, mask_BL = torch.zeros(batch.num_seqs, L), torch.zeros(batch.num_seqs, L)
    for b, (s, e) in enumerate(zip(starts, ends)):
        mask_BL[b, :e - s] = (batch.loss_mask[s:e] > 0).float()
        if e > s:
            rewards_BL[b, e - s - 1] = batch.rewards[b]
    index_B = torch.tensor([p for p, g in enumerate(groups) for _ in g.completions])
    adv_BL = fn(rewards_BL, mask_BL, index_B, opts)
    for b, (s, e) in enumerate(zip(starts, ends)):
        batch.advantages[s:e] = adv_BL[b, :e - s]
    return batch


def grpo_batch(groups: list[RolloutGroup], *, normalize_std: bool, token_credit: bool = False) -> TrainBatch:
    """GRPO: group-relative advantages, one per response, broadcast over its tokens; with
    token_credit, one per token from the groups' token_credits (estimate_batch with the grpo estimator)."""
    return estimate_batch(groups, ESTIMATORS["grpo"], SimpleNamespace(normalize_std=normalize_std),
                          token_credit=token_credit)


def ppo_batch(groups: list[RolloutGroup]) -> TrainBatch:
    """PPO: every response of every group (P x G sequences); advantages come later from the critic (GAE)."""
    return _flatten(groups, torch.zeros(len(groups), len(groups[0].completions) if groups else 0))


def _flatten(groups: list[RolloutGroup], adv_PG: torch.Tensor, token_adv: list[list[float]] | None = None) -> TrainBatch:
    """Pack the responses of `groups` in group order, response i of group p with advantage adv_PG[p, i]."""
    prompts, comps, lps, advs, rews, routing, weights, roles = [], [], [], [], [], [], [], []
    for g, adv_G in zip(groups, adv_PG.tolist()):
        for i, c in enumerate(g.completions):
            prompts.append(g.prompt_ids)
            comps.append(c)
            lps.append(g.logprobs[i])
            advs.append(adv_G[i])
            rews.append(g.rewards[i])
            weights.append(g.loss_weights[i] if g.loss_weights else 1.0)
            roles.append(g.roles[i] if g.roles else None)
            if g.routing_ids:
                routing.append(g.routing_ids[i])
    return pack(prompts, comps, lps, advs, rews, routing if len(routing) == len(comps) else None, weights, token_adv,
                roles if any(r is not None for r in roles) else None)
