"""Learner: the optimizer updates of one TrainBatch, on the weights the engine decodes with.

One rollout batch: prepare() once (PPO's GAE, KL in the reward, whitening, rollout IS weights:
learner/update.py), then train.ppo_epochs passes of train.mini_batches optimizer steps each (the
defaults, 1 x 1, are one update per batch, the paper's accounting), metrics merged over the passes.
GRPO: clipped surrogate (asymmetric clip, optional dual-clip) on group-relative advantages, optional
KL (train.kl_estimator) to a frozen reference, optional entropy bonus. PPO: the same policy loss on
GAE advantages from a critic (ValueModel, its own AdamW at lr * critic_lr_mult, value clipping);
critic-only warm-up updates leave the policy untouched. Micro-batches accumulate gradients with every
loss normalised by the full (mini-)batch's count, so any micro-batch size gives the same update.
Log-probs: learner/logprobs.py (the engine's definition). The learner also reports how far its
recomputed log-probs are from the engine's behaviour log-probs. Memory: train.activation_checkpointing
recomputes each decoder layer in the backward; train.ref_offload keeps the reference on the host.
A non-finite loss or gradient skips the update (reported), leaving weights and optimizer intact.
Precision: with a bf16 model the optimizer steps fp32 master weights and writes the rounded
result into the shared parameters in place (rlengine/rl/algo/optim.py).
"""

from __future__ import annotations

import math

import torch

from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.algo.losses import kl_penalty, masked_aggregate
from rlengine.rl.algo.optim import LearnerOptimizer, use_master_weights
from rlengine.rl.algo.rollout_correction import CorrectionSpec
from rlengine.rl.algo.rollout_is import rollout_is_weights
from rlengine.rl.algo.value import explained_variance, explained_variance_sums
from rlengine.plan.specs import LearnerSpec
from rlengine.rl.config import TrainSection
from rlengine.rl.distributed import Dist, full_tensor
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.metrics import PassSums
from rlengine.rl.learner.logprobs import processed_token_logprobs, token_logprobs
from rlengine.rl.learner.critic import Critic
from rlengine.rl.learner.parallel import no_sync, parallel_mode, parallelize
from rlengine.rl.learner.reference import KLReference
from rlengine.rl.learner.token_baseline import SumPiSquaredTap, token_baseline_advantages
from rlengine.rl.learner.update import (combine_passes, grpo_kl_advantages, packed_correction, rollout_is_stats,
                                        whiten)
from rlengine.telemetry.nvtx import PhaseRanges

__all__ = ["Learner", "token_logprobs", "processed_token_logprobs"]  # the log-prob functions: re-exported


class Learner:
    def __init__(self, model: Qwen3ForCausalLM, spec: LearnerSpec | TrainSection, *, temperature: float = 1.0,
                 fused_logprob: bool | None = None, replay_routing: bool = False, logprobs_mode: str = "raw",
                 top_k: int = -1, top_p: float = 1.0, dist: Dist | None = None):
        """spec: the plan's LearnerSpec (the trainer), or train.* alone (benches, tests: the keywords then
        give the log-prob definition, and train.micro_batch / train.loss_norm_len are taken as written)."""
        if isinstance(spec, TrainSection):
            spec = LearnerSpec.from_options(spec, temperature=temperature, replay_routing=replay_routing,
                                            logprobs_mode=logprobs_mode, top_k=top_k, top_p=top_p)
        self.model, self.spec, self.cfg = model, spec, spec.options  # cfg: train.* as the user wrote them
        cfg = self.cfg
        self.dist = dist or Dist()
        self.temperature = spec.temperature
        self.fused = model.device.type == "cuda" if fused_logprob is None else fused_logprob
        self.replay_routing = spec.replay_routing
        self.logprobs_mode, self.top_k, self.top_p = spec.logprobs_mode, spec.top_k, spec.top_p
        # The KL reference is the policy as it is NOW (the trainer builds the learner after the
        # format warm start, so this is the policy at update 0); checkpoints save and restore it.
        self.reference = KLReference(model) if cfg.kl_coef > 0 or cfg.kl_in_reward else None
        # the estimator, the policy loss, whether a critic trains: train.algo with train.adv_estimator /
        # train.policy_loss applied (TrainSection.algorithm)
        self.algo = cfg.algorithm
        self.correction = CorrectionSpec.from_options(cfg)  # train.rollout_is* / rollout_rs*, parsed once
        self.masters = use_master_weights(cfg.master_weights, model.dtype)
        self.value = Critic(model, options=cfg) if self.algo.critic else None
        self.parallel = parallel_mode(cfg.parallel, self.dist)
        self.actor_fwd, critic_fwd = parallelize(self.parallel, self.dist, model, self.critic, self.ref)
        if self.value is not None:
            self.value.start(critic_fwd, lr=spec.lr, masters=self.masters)
        if cfg.ref_offload and self.reference is not None:  # after parallelize, whose broadcast needs it on the device
            self.reference.offload()
        self.last_passes: list[dict] = []  # the last step()'s per-pass metrics (epochs x mini-batches)
        # what the device clock re-costs (rl/trainer/trace_file.py empties it each update): ("fwd_bwd" |
        # "forward", packed tokens) per micro-batch pass, ("optimizer", 0) per optimizer step
        self.steps: list[tuple[str, int]] = []
        self.ranges = PhaseRanges.for_device(model.device)  # learner.forward-backward / learner.optimizer
        self.optim = LearnerOptimizer(model.parameters(), lr=spec.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay, masters=self.masters)

    # The roles' parts under the names checkpoints and tests use.
    ref = property(lambda self: None if self.reference is None else self.reference.module)
    ref_stream = property(lambda self: None if self.reference is None else self.reference.stream)
    critic = property(lambda self: None if self.value is None else self.value.module)
    critic_fwd = property(lambda self: None if self.value is None else self.value.fwd)
    critic_optim = property(lambda self: None if self.value is None else self.value.optim)

    def set_lr_factor(self, factor: float) -> None:
        """LR of the next step(s) = lr_effective * factor (critic: * critic_lr_mult); rlengine/rl/algo/schedule.py."""
        for group in self.opt.param_groups:
            group["lr"] = self.spec.lr * factor
        if self.critic_optim is not None:
            for group in self.critic_opt.param_groups:
                group["lr"] = self.spec.lr * self.cfg.critic_lr_mult * factor

    # What checkpoints save: the torch optimizers and the fp32 masters (None without them).
    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.optim.opt

    @property
    def master_params(self) -> list[torch.Tensor] | None:
        return self.optim.master_params

    @property
    def critic_opt(self) -> torch.optim.Optimizer | None:
        return None if self.critic_optim is None else self.critic_optim.opt

    @property
    def critic_master_params(self) -> list[torch.Tensor] | None:
        return None if self.critic_optim is None else self.critic_optim.master_params

    def token_logprobs(self, module, mb: TrainBatch, *, checkpoint_layers: bool = False):
        """Log-probs of mb.targets under the learner's definition (= the engine's logprobs_mode)."""
        if self.logprobs_mode == "processed" and (self.top_k > 0 or self.top_p < 1.0):
            return processed_token_logprobs(module, mb, self.temperature, self.top_k, self.top_p, checkpoint_layers)
        return token_logprobs(module, mb, self.temperature, self.fused, checkpoint_layers)

    # ---- once per rollout batch, before the passes -------------------------------------------
    def ppo_advantages(self, batch: TrainBatch, kl_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values and GAE on every response (Critic.advantages); (old_values [T], returns [T])."""
        return self.value.advantages(batch, kl_T, self.dist)

    @torch.no_grad()
    def batch_logprobs(self, module, batch: TrainBatch, *, sum_pi_squared: bool = False):
        """No-grad log-probs [T] of batch.targets under `module`, micro-batch by micro-batch (every rank
        runs the same number of forwards, as in the passes); with sum_pi_squared, (log-probs [T],
        sum_v pi_v^2 [T]) from the same forwards (learner/token_baseline.py)."""
        pi2: list = []
        fwd = SumPiSquaredTap(module, self.temperature, pi2) if sum_pi_squared else module
        parts = [self.token_logprobs(fwd, mb)[0] for mb in self._micro_batches(batch) if mb is not None]
        self.steps += [("forward", int(mb.input_ids.numel())) for mb in self._micro_batches(batch) if mb is not None]
        for _ in range(len(self._micro_batches(batch)) - len(parts)):  # fillers: the collectives line up
            self.token_logprobs(module, TrainBatch.filler(self.model.device))
        logp = torch.cat(parts) if parts else batch.old_logprobs.new_zeros(0)
        return (logp, torch.cat(pi2) if pi2 else logp.clone()) if sum_pi_squared else logp

    @torch.no_grad()
    def prepare(self, batch: TrainBatch, *, critic_only: bool = False) -> dict:
        """What every pass over `batch` shares, computed once: the learner's own pre-update log-probs with
        the rollout correction (train.rollout_is*: IS weights; train.rollout_rs*: rejected tokens leave the
        loss mask), the KL folded into the reward (train.kl_in_reward), PPO's values, returns and GAE
        advantages, GRPO's batch whitening (train.adv_whiten), the loss's token pick (clip_cov, kl_cov).
        Writes them into `batch`; returns their GLOBAL statistics."""
        cfg, stats = self.cfg, {}
        token_baseline = bool(self.algo.estimator.needs) and not critic_only  # optimal_token_baseline
        if (self.correction.enabled or token_baseline) and not critic_only:
            out = self.batch_logprobs(self.actor_fwd, batch, sum_pi_squared=token_baseline)
            batch.learner_old_logprobs, pi2 = out if token_baseline else (out, None)
        if self.correction.enabled and not critic_only:
            stats.update(self._correct(batch))
        if token_baseline:
            batch.advantages = token_baseline_advantages(batch, self.algo.estimator, cfg, group_size=self.spec.group_size,
                                                         learner_old_T=batch.learner_old_logprobs, sum_pi2_T=pi2,
                                                         is_weights_T=batch.is_weights)
        valid = batch.loss_mask > 0
        kl_T = None
        if cfg.kl_in_reward:
            old = batch.old_logprobs if batch.learner_old_logprobs is None else batch.learner_old_logprobs
            kl_T = torch.where(valid, kl_penalty(old, self.batch_logprobs(self.ref, batch), cfg.kl_estimator), 0.0)
            n, total = self.dist.all_sum([float(valid.sum()), float(kl_T.sum())])
            stats["kl_reward"] = total / max(n, 1.0)
        if self.critic is not None:
            batch.old_values, batch.returns = self.ppo_advantages(batch, kl_T)
        elif kl_T is not None:
            batch.advantages = grpo_kl_advantages(batch, kl_T, coef=cfg.kl_reward_coef, group_size=self.spec.group_size,
                                                  estimator=self.algo.estimator, opts=cfg)
        if cfg.adv_whiten == "batch":
            batch.advantages = whiten(batch.advantages, valid, self.dist)
        if self.algo.loss.select is not None and not critic_only:
            self._select_tokens(batch)
        return stats

    def _correct(self, batch: TrainBatch) -> dict:
        """Rollout correction (train.rollout_is*, train.rollout_rs*) against the learner's pre-update log-probs:
        the IS weights on the loss, rejected tokens out of the loss mask; the statistics under rlengine's
        names (rollout_is_mean / _max / _capped_frac of the untruncated weights) and verl's (rollout_corr/*)."""
        spec, valid, stats = self.correction, batch.loss_mask > 0, {}
        if spec.level is not None:
            _, raw = rollout_is_weights(batch.learner_old_logprobs, batch.old_logprobs, batch.loss_mask, batch.seq_ids,
                                        level=spec.level, cap=max(spec.upper, 1.0))
            stats.update(rollout_is_stats(raw, valid, spec.upper, self.dist))
        weights, batch.loss_mask, corr = packed_correction(batch, batch.learner_old_logprobs, spec, self.dist)
        if spec.level is not None:
            batch.is_weights = torch.ones_like(batch.loss_mask) if weights is None else weights
        return {**stats, **corr}

    def _select_tokens(self, batch: TrainBatch) -> None:
        """The loss's token pick (clip_cov, kl_cov: PolicyLoss.select) over the whole batch, once, from the
        pre-update log-probs against the ratio's denominator: the same pick for any micro-batch split (the
        later passes of train.ppo_epochs / mini_batches keep it). Over this rank's share with several ranks."""
        cur = batch.learner_old_logprobs
        cur = self.batch_logprobs(self.actor_fwd, batch) if cur is None else cur
        old = batch.old_logprobs if batch.learner_old_logprobs is None else batch.learner_old_logprobs
        batch.token_select = self.algo.loss.select(cur, old, batch.advantages, batch.loss_mask, **self._loss_options())

    def _loss_options(self) -> dict:
        """The policy loss's keywords from train.*: the clip range and the loss's own options (verl's names)."""
        cfg = self.cfg
        return dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c,
                    **{k: getattr(cfg, k) for k in self.algo.loss.options})

    # ---- one gradient pass ---------------------------------------------------------------------
    def _global_counts(self, batch: TrainBatch, agg: str) -> tuple[float, float]:
        """(loss normaliser, valid tokens) over the GLOBAL batch (all ranks, one reduction): the
        normaliser is the valid-token count (token-mean), the valid-sequence count (seq-mean) or the
        sequence count (seq-mean-token-sum-norm: Dr. GRPO's constant, whatever the responses' masks)."""
        tokens = float(batch.loss_mask.sum())
        if agg == "token-mean":
            seqs = tokens
        elif agg == "seq-mean-token-sum-norm":
            seqs = float(batch.num_seqs)
        else:
            seqs = float(len({int(s) for s in batch.seq_ids[batch.loss_mask > 0].tolist()}))
        seqs, tokens = self.dist.all_sum([seqs, tokens])
        # >= 1: a batch with no trained token (every response masked as over-long) has loss 0, not 0/0
        return max(1.0, seqs), max(1.0, tokens)

    def _set_replay(self, mb: TrainBatch | None) -> None:
        for i, block in enumerate(self.model.moe_blocks()):
            block.replay_ids = None if mb is None or mb.routing_ids is None else mb.routing_ids[:, i]

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch | None]:
        """This rank's micro-batches, padded with None (a no-op micro-batch) to the most any rank has:
        every rank runs the same number of forwards and backwards, so the collectives line up."""
        mbs = batch.micro_batches(self.spec.micro_batch) if batch.num_seqs else []
        count = int(self.dist.all_max([len(mbs)])[0]) if self.dist.enabled else len(mbs)
        return mbs + [None] * (count - len(mbs))

    def compute_grads(self, batch: TrainBatch, *, critic_only: bool = False) -> dict:
        """prepare(batch), then one gradient pass over all of it (grads only, no optimizer step)."""
        stats = self.prepare(batch, critic_only=critic_only)
        return {**self.pass_grads(batch, critic_only=critic_only), **stats}

    def pass_grads(self, batch: TrainBatch, *, critic_only: bool = False) -> dict:
        """Zero grads, accumulate gradients over micro-batches of a prepared batch; returns GLOBAL metrics.

        Every loss is normalised by the global count, and multiplied by the world size because DDP
        and FSDP average gradients over ranks: the summed gradient equals one process's full-batch
        gradient. A rank with fewer (or no) micro-batches runs zero-weight ones (TrainBatch.filler).
        """
        self.optim.zero_grad()
        if self.critic is not None:
            self.critic_optim.zero_grad()
        norm, ntok = self._global_counts(batch, self.cfg.agg)
        # a loss with its own aggregation (sapo, geo_mean: PolicyLoss.agg) divides by its own count
        forced = self.algo.loss.agg
        pg_agg = (forced, self._global_counts(batch, forced)[0]) if forced and forced != self.cfg.agg else (
            self.cfg.agg, norm)
        sums = PassSums()
        mbs = self._micro_batches(batch)
        for i, mb in enumerate(mbs):
            # DDP: forward and backward of every micro-batch but the last inside no_sync, so the
            # gradients are all-reduced once per update, not once per micro-batch
            with self._no_sync(last=i == len(mbs) - 1):
                filler = mb is None
                if not filler:
                    self.steps.append(("fwd_bwd", int(mb.input_ids.numel())))
                mb = TrainBatch.filler(self.model.device) if filler else mb
                loss, critic_loss, mb_max = self._micro_losses(mb, filler, norm, ntok, sums, critic_only, pg_agg)
                sums.ratio_max = max(sums.ratio_max, mb_max)
                # actor and critic share no parameters: two backward passes (FSDP2 finalises one root's
                # gradients per backward), the same gradients as one pass over their sum
                if loss.requires_grad:
                    (loss * self.dist.world).backward()
                if critic_loss is not None:
                    (critic_loss * self.dist.world).backward()
                    loss = loss + critic_loss.detach()
                self._set_replay(None)
            self.optim.accumulate()
            if self.critic_optim is not None:
                self.critic_optim.accumulate()
            sums.loss += float(loss.detach())
        out = sums.reduce(self.dist, ntok)
        out["vf_explained_var"] = None if batch.returns is None else explained_variance(
            self.dist.all_sum(explained_variance_sums(batch.old_values, batch.returns, batch.loss_mask > 0)))
        return out

    def _micro_losses(self, mb: TrainBatch, filler: bool, norm: float, ntok: float, sums: PassSums, critic_only: bool,
                      pg_agg: tuple[str, float]):
        """(actor loss, critic loss or None, ratio max) of one micro-batch; adds its metrics into `sums`."""
        cfg = self.cfg
        agg = dict(agg=cfg.agg, normalizer=norm, norm_len=self.spec.loss_norm_len)
        loss, ratio_max = torch.zeros((), device=mb.input_ids.device), 0.0
        if not critic_only:
            loss, ratio_max = self._policy_loss(mb, filler, agg, ntok, sums, pg_agg)
        critic_loss = None
        if self.value is not None:
            critic_loss, vl = self.value.loss(mb, filler, agg)
            sums.value_loss += float(vl.detach())
        return loss, critic_loss, ratio_max

    def _policy_loss(self, mb: TrainBatch, filler: bool, agg: dict, ntok: float, sums: PassSums,
                     pg_agg: tuple[str, float]):
        """The policy's loss on one micro-batch (surrogate, entropy bonus, KL term) and its ratio max."""
        cfg = self.cfg
        w = float(mb.loss_mask.sum()) / ntok
        if self.replay_routing:
            self._set_replay(mb)
        # replayed routing stays set until pass_grads' backward: with activation checkpointing the
        # backward runs each MoE layer again and must route as the forward did
        logp, ent = self.token_logprobs(self.actor_fwd, mb, checkpoint_layers=cfg.activation_checkpointing)
        # the ratio's denominator: the learner's own pre-update log-probs when prepare() made them (rollout
        # IS), else the engine's behaviour log-probs (one pass: ratio = 1 up to the engine-learner gap)
        old = mb.old_logprobs if mb.learner_old_logprobs is None else mb.learner_old_logprobs
        sel = {} if self.algo.loss.select is None else {"selected": mb.token_select}  # picked in prepare()
        pl, m = self.algo.loss.fn(logp, old, mb.advantages, mb.loss_mask, mb.seq_ids, weights=mb.is_weights,
                                  **{**agg, "agg": pg_agg[0], "normalizer": pg_agg[1]}, **self._loss_options(), **sel)
        loss = pl
        sums.pg_loss += float(pl.detach())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * masked_aggregate(ent, mb.loss_mask, mb.seq_ids, **agg)
        if self.ref is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _ = self.token_logprobs(self.ref, mb)
            kl = masked_aggregate(kl_penalty(logp, ref_logp, cfg.kl_estimator), mb.loss_mask, mb.seq_ids, **agg)
            loss = loss + cfg.kl_coef * kl
            sums.kl_ref += float(kl.detach())
        valid = mb.loss_mask > 0
        sums.logprob_diff += float((logp.detach() - mb.old_logprobs)[valid].abs().sum())
        sums.entropy += float((ent.detach() * mb.loss_mask).sum())
        if filler:
            return loss, 0.0
        sums.add_policy_stats(m, w)
        blocks = self.model.moe_blocks()
        if self.replay_routing and blocks and blocks[0].last_disagreement is not None:
            sums.routing_disagreement += sum(float(bk.last_disagreement) for bk in blocks) / len(blocks) * w
        return loss, float(m["ratio_max"]) if bool(valid.any()) else 0.0

    def _no_sync(self, *, last: bool):
        """parallel.no_sync over the policy and the critic (DDP without masters: one all-reduce per update)."""
        return no_sync(self.parallel, self.dist, (self.actor_fwd, self.critic_fwd), last=last,
                       masters=self.master_params is not None)

    def step(self, batch: TrainBatch, *, critic_only: bool = False, phases=None) -> dict:
        """All updates of one rollout batch: prepare(), then train.ppo_epochs passes over its
        train.mini_batches parts, each gradients, clipping, non-finite check, optimizer step(s).
        Returns the metrics merged over the passes (update.combine_passes; self.last_passes keeps each).

        `phases` (optional, e.g. telemetry.NvmlSampler) gets set_phase("forward-backward" / "optimizer").
        """
        passes, stats, parts = [], {}, None
        for _ in range(self.cfg.ppo_epochs):
            for i in range(self.cfg.mini_batches):
                if phases is not None:
                    phases.set_phase("forward-backward")
                with self.ranges("learner.forward-backward"):
                    if parts is None:  # once per rollout batch, inside the first pass's range; split
                        stats = self.prepare(batch, critic_only=critic_only)  # after it rewrote the batch
                        parts = batch.split(self.cfg.mini_batches)
                    metrics = self.pass_grads(parts[i], critic_only=critic_only)
                if phases is not None:
                    phases.set_phase("optimizer")
                with self.ranges("learner.optimizer"):
                    passes.append(self._apply(metrics, critic_only))
        self.last_passes = passes
        return {**combine_passes(passes), **stats}

    def _apply(self, metrics: dict, critic_only: bool) -> dict:
        """Clip, check for non-finite values, step the optimizer(s): the tail of step()."""
        actor_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.optim.grad_params, self.cfg.max_grad_norm))
        critic_norm = None
        if self.critic is not None:
            critic_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.critic_optim.grad_params, self.cfg.max_grad_norm))
        finite = math.isfinite(metrics["loss"]) and (critic_only or math.isfinite(float(actor_norm))) and (
            critic_norm is None or math.isfinite(float(critic_norm)))
        metrics.update(actor_grad_norm=float(actor_norm) if not critic_only else None,
                       critic_grad_norm=None if critic_norm is None else float(critic_norm),
                       skipped=not finite)
        if not finite:
            self.optim.zero_grad()
            if self.critic_optim is not None:
                self.critic_optim.zero_grad()
            return metrics
        # train.skip_zero_grad: a zero policy gradient carries no signal, so no step (Adam's momentum
        # alone would keep moving the weights: the drift of a run whose groups all score alike)
        if not critic_only and not (self.cfg.skip_zero_grad and float(actor_norm) == 0.0):
            self.optim.step()
            self.steps.append(("optimizer", 0))
        if self.critic_optim is not None:
            self.critic_optim.step()
        return metrics

