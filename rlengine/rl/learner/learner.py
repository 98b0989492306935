"""Learner: one optimizer update per TrainBatch, on the weights the engine decodes with.

GRPO: clipped surrogate (asymmetric clip) on group-relative advantages, optional k3 KL to a
frozen reference, optional entropy bonus. PPO: the same policy loss on GAE advantages from
a critic (ValueModel, its own AdamW at lr * critic_lr_mult, value clipping); critic-only
warm-up updates leave the policy untouched. Micro-batches accumulate gradients with every
loss normalised by the full batch's count, so any micro-batch size gives the same update.
Log-probs: log_softmax(logits / temperature) at the target tokens — the engine's definition —
through the fused Triton kernel on GPU and its torch reference on CPU. The learner also
reports how far its recomputed log-probs are from the engine's behaviour log-probs.
A non-finite loss or gradient skips the update (reported), leaving weights and optimizer intact.
Precision: with a bf16 model the optimizer steps fp32 master weights and writes the rounded
result into the shared parameters in place (rlengine/rl/algo/optim.py).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from rlengine.model.qwen3 import Qwen3ForCausalLM, logits_fp32
from rlengine.rl.algo.advantages import gae
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.config import TrainSection
from rlengine.rl.algo.losses import kl_k3, masked_aggregate, policy_loss, value_loss
from rlengine.rl.distributed import Dist, full_tensor
from rlengine.rl.algo.optim import LearnerOptimizer, use_master_weights
from rlengine.rl.algo.value import ValueModel, explained_variance, explained_variance_sums
from rlengine.telemetry.nvtx import PhaseRanges


def token_logprobs(module, mb: TrainBatch, temperature: float, fused: bool):
    """(logp [T], entropy [T]) of mb.targets under `module` (raw definition), fp32, differentiable.

    `module` is the model or its DDP / FSDP wrapper: the call goes through its forward(), so the
    wrappers' hooks run. The learner's forward is the differentiable torch path (fast=False); it
    agrees with the engine's fused inference path to rounding (tests/rl/test_logprob_parity.py).
    """
    if fused:
        from rlengine.kernels.fused_logprob import fused_logprob as fn
    else:
        from rlengine.kernels.fused_logprob import fused_logprob_ref as fn

    def head(hidden_TC, w_VC):
        return fn(hidden_TC, w_VC, mb.targets, temperature=temperature, return_entropy=True)
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head)


def processed_token_logprobs(module, mb: TrainBatch, temperature: float, top_k: int, top_p: float):
    """(logp [T], entropy [T]) under the top-k / top-p filtered distribution at `temperature`.

    The same quantity the engine returns with logprobs_mode="processed" (sampler.sequence_logprobs);
    it needs the [T, V] logits (the filter sorts each row), so it is not fused. Entropy is that of
    the unfiltered distribution, as in raw mode.
    """
    from rlengine.engine.sampler import sequence_logprobs

    def head(hidden_TC, w_VC):
        logits_TV = logits_fp32(hidden_TC, w_VC)
        logp = sequence_logprobs(logits_TV, mb.targets, temperature=temperature, top_k=top_k, top_p=top_p,
                                 mode="processed")
        full_TV = (logits_TV / temperature).log_softmax(dim=-1)
        return logp, -(full_TV.exp() * full_TV).sum(dim=-1)
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head)


class Learner:
    def __init__(self, model: Qwen3ForCausalLM, cfg: TrainSection, *, temperature: float = 1.0,
                 fused_logprob: bool | None = None, replay_routing: bool = False, logprobs_mode: str = "raw",
                 top_k: int = -1, top_p: float = 1.0, dist: Dist | None = None):
        self.model, self.cfg = model, cfg
        self.dist = dist or Dist()
        self.temperature = temperature
        self.fused = model.device.type == "cuda" if fused_logprob is None else fused_logprob
        self.replay_routing = replay_routing
        self.logprobs_mode, self.top_k, self.top_p = logprobs_mode, top_k, top_p
        # The KL reference is the policy as it is NOW (the trainer builds the learner after the
        # format warm start, so this is the policy at update 0); checkpoints save and restore it.
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        self.critic = ValueModel(model) if cfg.algo == "ppo" else None
        self.parallel = cfg.parallel if cfg.parallel != "auto" else ("ddp" if self.dist.enabled else "none")
        self.actor_fwd, self.critic_fwd = self._parallelize()
        masters = use_master_weights(cfg.master_weights, model.dtype)
        self.ranges = PhaseRanges.for_device(model.device)  # learner.forward-backward / learner.optimizer
        self.optim = LearnerOptimizer(model.parameters(), lr=cfg.lr_effective, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay, masters=masters)
        self.critic_optim = None
        if self.critic is not None:
            self.critic_optim = LearnerOptimizer(self.critic.parameters(), lr=cfg.lr_effective * cfg.critic_lr_mult,
                                                 betas=cfg.betas, weight_decay=cfg.weight_decay, masters=masters)

    def set_lr_factor(self, factor: float) -> None:
        """LR of the next step(s) = lr_effective * factor (critic: * critic_lr_mult); rlengine/rl/algo/schedule.py."""
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr_effective * factor
        if self.critic_optim is not None:
            for group in self.critic_opt.param_groups:
                group["lr"] = self.cfg.lr_effective * self.cfg.critic_lr_mult * factor

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

    def _parallelize(self):
        """Wrap for the parallel mode; returns the modules the learner calls (actor, critic)."""
        if self.parallel == "none" or not self.dist.enabled:
            return self.model, self.critic
        from torch.nn.parallel import DistributedDataParallel as DDP

        from rlengine.rl.distributed import fp32_allreduce_hook, fsdp_shard

        for m in (self.model, self.critic, self.ref):  # identical replicas to start from (warm start)
            if m is not None:
                for t in m.state_dict().values():
                    torch.distributed.broadcast(t, 0)
        if self.parallel == "ddp":
            ids = None if self.model.device.type == "cpu" else [self.model.device.index]
            # MoE: experts no token was routed to get no gradient in a step
            actor = DDP(self.model, device_ids=ids, forward_sync_buffers=False,
                        find_unused_parameters=self.model.config.is_moe)
            actor.register_comm_hook(None, fp32_allreduce_hook)
            critic = None
            if self.critic is not None:
                critic = DDP(self.critic, device_ids=ids, forward_sync_buffers=False)
                critic.register_comm_hook(None, fp32_allreduce_hook)
            return actor, critic
        # fsdp: the policy, the reference and the critic trunk are sharded per decoder layer
        one = torch.zeros(1, dtype=torch.long, device=self.model.device)
        for m in (self.model, self.ref):
            if m is not None:
                fsdp_shard(m, list(m.model.layers), lambda mod: mod(one[None]))
        if self.critic is not None:
            fsdp_shard(self.critic, list(self.critic.trunk.layers), lambda mod: mod(one, [0, 1]))
        return self.model, self.critic

    def token_logprobs(self, module, mb: TrainBatch):
        """Log-probs of mb.targets under the learner's definition (= the engine's logprobs_mode)."""
        if self.logprobs_mode == "processed" and (self.top_k > 0 or self.top_p < 1.0):
            return processed_token_logprobs(module, mb, self.temperature, self.top_k, self.top_p)
        return token_logprobs(module, mb, self.temperature, self.fused)

    # ---- PPO advantages ---------------------------------------------------------------------
    @torch.no_grad()
    def ppo_advantages(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Critic values and GAE on every response; writes whitened advantages into batch.advantages.

        A response's trained positions are the last n of its packed segment; the outcome reward
        sits on its last token. Whitening uses the mean / std over the valid tokens of ALL ranks.
        Returns (old_values [T], returns [T]) for the value loss.
        """
        values_T = self.critic_fwd(batch.input_ids, batch.cu_seqlens)
        segs = list(zip(batch.cu_seqlens, batch.cu_seqlens[1:]))
        lens = [int(batch.loss_mask[a:e].sum()) for a, e in segs]
        B, L = len(segs), max(lens, default=0)
        v, m, r = (values_T.new_zeros(B, L) for _ in range(3))
        for b, ((a, e), n) in enumerate(zip(segs, lens)):
            v[b, :n], m[b, :n] = values_T[e - n:e], 1.0
            if n:  # a masked (over-long) response has no trained token; with every one masked L = 0
                r[b, n - 1] = batch.rewards[b]
        adv_BL, ret_BL = gae(r, v, m, gamma=self.cfg.gamma, lam=self.cfg.lam)
        adv_T, ret_T = torch.zeros_like(values_T), torch.zeros_like(values_T)
        for b, ((a, e), n) in enumerate(zip(segs, lens)):
            adv_T[e - n:e], ret_T[e - n:e] = adv_BL[b, :n], ret_BL[b, :n]
        valid = batch.loss_mask > 0
        a_valid = adv_T[valid].double()
        n, s1, s2 = self.dist.all_sum([float(valid.sum()), float(a_valid.sum()), float((a_valid ** 2).sum())])
        mu = s1 / max(n, 1.0)
        sd = math.sqrt(max(s2 / max(n, 1.0) - mu * mu, 0.0))
        batch.advantages = torch.where(valid, (adv_T - mu) / (sd + 1e-8), torch.zeros_like(adv_T))
        return values_T, ret_T

    # ---- the update -------------------------------------------------------------------------
    def _global_counts(self, batch: TrainBatch) -> tuple[float, float]:
        """(loss normaliser, valid tokens) over the GLOBAL batch (all ranks, one reduction): the
        normaliser is the valid-token count (token-mean) or the valid-sequence count (seq-mean)."""
        tokens = float(batch.loss_mask.sum())
        seqs = tokens if self.cfg.agg == "token-mean" else float(
            len({int(s) for s in batch.seq_ids[batch.loss_mask > 0].tolist()}))
        seqs, tokens = self.dist.all_sum([seqs, tokens])
        # >= 1: a batch with no trained token (every response masked as over-long) has loss 0, not 0/0
        return max(1.0, seqs), max(1.0, tokens)

    def _set_replay(self, mb: TrainBatch | None) -> None:
        for i, block in enumerate(self.model.moe_blocks()):
            block.replay_ids = None if mb is None or mb.routing_ids is None else mb.routing_ids[:, i]

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch | None]:
        """This rank's micro-batches, padded with None (a no-op micro-batch) to the most any rank has:
        every rank runs the same number of forwards and backwards, so the collectives line up."""
        mbs = batch.micro_batches(self.cfg.micro_batch) if batch.num_seqs else []
        count = int(self.dist.all_max([len(mbs)])[0]) if self.dist.enabled else len(mbs)
        return mbs + [None] * (count - len(mbs))

    def compute_grads(self, batch: TrainBatch, *, critic_only: bool = False) -> dict:
        """Zero grads, accumulate gradients over micro-batches; returns GLOBAL metrics (no optimizer step).

        Every loss is normalised by the global count, and multiplied by the world size because DDP
        and FSDP average gradients over ranks: the summed gradient equals one process's full-batch
        gradient. A rank with fewer (or no) micro-batches runs zero-weight ones (TrainBatch.filler).
        """
        cfg, world = self.cfg, self.dist.world
        self.optim.zero_grad()
        old_values = returns = None
        if self.critic is not None:
            self.critic_optim.zero_grad()
            old_values, returns = self.ppo_advantages(batch)
        norm, ntok = self._global_counts(batch)
        sums = {"clip_frac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_ref": 0.0, "logprob_diff": 0.0,
                "loss": 0.0, "pg_loss": 0.0, "value_loss": 0.0, "routing_disagreement": 0.0}
        mbs = self._micro_batches(batch)
        start = 0
        for i, mb in enumerate(mbs):
            # DDP: forward and backward of every micro-batch but the last inside no_sync, so the
            # gradients are all-reduced once per update, not once per micro-batch
            with self._no_sync(last=i == len(mbs) - 1):
                filler = mb is None
                if filler:
                    mb = TrainBatch.filler(self.model.device)
                    a = b = 0
                else:
                    a, b = mb.cu_seqlens[0] + start, mb.cu_seqlens[-1] + start
                    start = b
                w = float(mb.loss_mask.sum()) / ntok
                loss = torch.zeros((), device=mb.input_ids.device)
                if not critic_only:
                    if self.replay_routing:
                        self._set_replay(mb)
                    logp, ent = self.token_logprobs(self.actor_fwd, mb)
                    self._set_replay(None)
                    pl, m = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, mb.seq_ids,
                                        clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.agg, normalizer=norm)
                    loss = loss + pl
                    sums["pg_loss"] += float(pl.detach())
                    if cfg.entropy_coef:
                        loss = loss - cfg.entropy_coef * masked_aggregate(ent, mb.loss_mask, mb.seq_ids, agg=cfg.agg,
                                                                          normalizer=norm)
                    if self.ref is not None:
                        with torch.no_grad():
                            ref_logp, _ = self.token_logprobs(self.ref, mb)
                        kl = masked_aggregate(kl_k3(logp, ref_logp), mb.loss_mask, mb.seq_ids, agg=cfg.agg,
                                              normalizer=norm)
                        loss = loss + cfg.kl_coef * kl
                        sums["kl_ref"] += float(kl.detach())
                    valid = mb.loss_mask > 0
                    sums["logprob_diff"] += float((logp.detach() - mb.old_logprobs)[valid].abs().sum())
                    sums["entropy"] += float((ent.detach() * mb.loss_mask).sum())
                    if not filler:
                        sums["clip_frac"] += float(m["clip_frac"]) * w
                        sums["approx_kl"] += float(m["approx_kl"]) * w
                    blocks = self.model.moe_blocks()
                    if self.replay_routing and blocks and blocks[0].last_disagreement is not None and not filler:
                        sums["routing_disagreement"] += sum(float(bk.last_disagreement) for bk in blocks) / len(blocks) * w
                critic_loss = None
                if self.critic is not None:
                    values = self.critic_fwd(mb.input_ids, mb.cu_seqlens)
                    ov = values.detach() if filler else old_values[a:b]
                    rt = values.detach() if filler else returns[a:b]
                    vl, _ = value_loss(values, ov, rt, mb.loss_mask, mb.seq_ids, clip=cfg.vf_clip, agg=cfg.agg,
                                       normalizer=norm)
                    critic_loss = cfg.vf_coef * vl
                    sums["value_loss"] += float(vl.detach())
                # actor and critic share no parameters: two backward passes (FSDP2 finalises one root's
                # gradients per backward), the same gradients as one pass over their sum
                if loss.requires_grad:
                    (loss * world).backward()
                if critic_loss is not None:
                    (critic_loss * world).backward()
                    loss = loss + critic_loss.detach()
            self.optim.accumulate()
            if self.critic_optim is not None:
                self.critic_optim.accumulate()
            sums["loss"] += float(loss.detach())
        keys = list(sums)
        sums = dict(zip(keys, self.dist.all_sum([sums[k] for k in keys])))
        sums["logprob_diff"] /= ntok
        sums["entropy"] /= ntok
        sums["vf_explained_var"] = None if returns is None else explained_variance(
            self.dist.all_sum(explained_variance_sums(old_values, returns, batch.loss_mask > 0)))
        return sums

    def _no_sync(self, *, last: bool):
        """DDP without master weights: gradients accumulate locally and are reduced once, at the last
        micro-batch. With masters every micro-batch is reduced (in fp32) before it moves into them."""
        if last or self.parallel != "ddp" or self.master_params is not None or not self.dist.enabled:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in (self.actor_fwd, self.critic_fwd):
            if m is not None:
                stack.enter_context(m.no_sync())
        return stack

    def step(self, batch: TrainBatch, *, critic_only: bool = False, phases=None) -> dict:
        """One full update: gradients, clipping, non-finite check, optimizer step(s). Returns metrics.

        `phases` (optional, e.g. telemetry.NvmlSampler) gets set_phase("forward-backward" / "optimizer").
        """
        if phases is not None:
            phases.set_phase("forward-backward")
        with self.ranges("learner.forward-backward"):
            metrics = self.compute_grads(batch, critic_only=critic_only)
        if phases is not None:
            phases.set_phase("optimizer")
        with self.ranges("learner.optimizer"):
            return self._apply(metrics, critic_only)

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
        if self.critic_optim is not None:
            self.critic_optim.step()
        return metrics

