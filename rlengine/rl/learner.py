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
result into the shared parameters in place (rlengine/rl/optim.py).
"""

from __future__ import annotations

import copy
import math

import torch

from rlengine.model.qwen3 import Qwen3ForCausalLM, logits_fp32
from rlengine.rl.advantages import gae
from rlengine.rl.batching import TrainBatch
from rlengine.rl.config import TrainSection
from rlengine.rl.losses import kl_k3, masked_aggregate, policy_loss, value_loss
from rlengine.rl.optim import LearnerOptimizer, use_master_weights
from rlengine.rl.value import ValueModel


def token_logprobs(model: Qwen3ForCausalLM, mb: TrainBatch, temperature: float, fused: bool):
    """(logp [T], entropy [T]) of mb.targets under `model` (raw definition), fp32, differentiable.

    The learner's forward is the differentiable torch path (fast=False); its numbers agree with the
    engine's fused inference path to rounding (tests/test_logprob_parity.py measures the residual).
    """
    hidden = model.forward_packed(mb.input_ids, mb.cu_seqlens, return_hidden=True)
    if fused:
        from rlengine.kernels.fused_logprob import fused_logprob as fn
    else:
        from rlengine.kernels.fused_logprob import fused_logprob_ref as fn
    return fn(hidden, model.lm_head.weight, mb.targets, temperature=temperature, return_entropy=True)


def processed_token_logprobs(model: Qwen3ForCausalLM, mb: TrainBatch, temperature: float, top_k: int,
                             top_p: float):
    """(logp [T], entropy [T]) under the top-k / top-p filtered distribution at `temperature`.

    The same quantity the engine returns with logprobs_mode="processed" (sampler.sequence_logprobs);
    it needs the [T, V] logits (the filter sorts each row), so it is not fused. Entropy is that of
    the unfiltered distribution, as in raw mode.
    """
    from rlengine.engine.sampler import sequence_logprobs

    hidden = model.forward_packed(mb.input_ids, mb.cu_seqlens, return_hidden=True)
    logits_TV = logits_fp32(hidden, model.lm_head.weight)
    logp = sequence_logprobs(logits_TV, mb.targets, temperature=temperature, top_k=top_k, top_p=top_p,
                             mode="processed")
    full_TV = (logits_TV / temperature).log_softmax(dim=-1)
    return logp, -(full_TV.exp() * full_TV).sum(dim=-1)


class Learner:
    def __init__(self, model: Qwen3ForCausalLM, cfg: TrainSection, *, temperature: float = 1.0,
                 fused_logprob: bool | None = None, replay_routing: bool = False, logprobs_mode: str = "raw",
                 top_k: int = -1, top_p: float = 1.0):
        self.model, self.cfg = model, cfg
        self.temperature = temperature
        self.fused = model.device.type == "cuda" if fused_logprob is None else fused_logprob
        self.replay_routing = replay_routing
        self.logprobs_mode, self.top_k, self.top_p = logprobs_mode, top_k, top_p
        masters = use_master_weights(cfg.master_weights, model.dtype)
        self.optim = LearnerOptimizer(model.parameters(), lr=cfg.lr_effective, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay, masters=masters)
        self.opt, self.master_params = self.optim.opt, self.optim.master_params
        # The KL reference is the policy as it is NOW (the trainer builds the learner after the
        # format warm start, so this is the policy at update 0); checkpoints save and restore it.
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.critic = self.critic_opt = self.critic_optim = self.critic_master_params = None
        if cfg.algo == "ppo":
            self.critic = ValueModel(model)
            self.critic_optim = LearnerOptimizer(self.critic.parameters(), lr=cfg.lr_effective * cfg.critic_lr_mult,
                                                 betas=cfg.betas, weight_decay=cfg.weight_decay, masters=masters)
            self.critic_opt, self.critic_master_params = self.critic_optim.opt, self.critic_optim.master_params

    def token_logprobs(self, model: Qwen3ForCausalLM, mb: TrainBatch):
        """Log-probs of mb.targets under the learner's definition (= the engine's logprobs_mode)."""
        if self.logprobs_mode == "processed" and (self.top_k > 0 or self.top_p < 1.0):
            return processed_token_logprobs(model, mb, self.temperature, self.top_k, self.top_p)
        return token_logprobs(model, mb, self.temperature, self.fused)

    # ---- PPO advantages ---------------------------------------------------------------------
    @torch.no_grad()
    def ppo_advantages(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Critic values and GAE on every response; writes whitened advantages into batch.advantages.

        A response's trained positions are the last n of its packed segment; the outcome reward
        sits on its last token. Returns (old_values [T], returns [T]) for the value loss.
        """
        values_T = self.critic(batch.input_ids, batch.cu_seqlens)
        segs = list(zip(batch.cu_seqlens, batch.cu_seqlens[1:]))
        lens = [int(batch.loss_mask[a:e].sum()) for a, e in segs]
        B, L = len(segs), max(lens)
        v, m, r = (values_T.new_zeros(B, L) for _ in range(3))
        for b, ((a, e), n) in enumerate(zip(segs, lens)):
            v[b, :n], m[b, :n] = values_T[e - n:e], 1.0
            r[b, n - 1] = batch.rewards[b]
        adv_BL, ret_BL = gae(r, v, m, gamma=self.cfg.gamma, lam=self.cfg.lam)
        adv_T, ret_T = torch.zeros_like(values_T), torch.zeros_like(values_T)
        for b, ((a, e), n) in enumerate(zip(segs, lens)):
            adv_T[e - n:e], ret_T[e - n:e] = adv_BL[b, :n], ret_BL[b, :n]
        valid = batch.loss_mask > 0
        mu, sd = adv_T[valid].mean(), adv_T[valid].std(unbiased=False)
        batch.advantages = torch.where(valid, (adv_T - mu) / (sd + 1e-8), torch.zeros_like(adv_T))
        return values_T, ret_T

    # ---- the update -------------------------------------------------------------------------
    def _normalizer(self, batch: TrainBatch) -> float:
        if self.cfg.agg == "token-mean":
            return float(batch.loss_mask.sum())
        return float(len({int(s) for s in batch.seq_ids[batch.loss_mask > 0].tolist()}))

    def _set_replay(self, mb: TrainBatch | None) -> None:
        for i, block in enumerate(self.model.moe_blocks()):
            block.replay_ids = None if mb is None or mb.routing_ids is None else mb.routing_ids[:, i]

    def compute_grads(self, batch: TrainBatch, *, critic_only: bool = False) -> dict:
        """Zero grads, accumulate gradients over micro-batches; returns metrics (no optimizer step)."""
        cfg = self.cfg
        self.optim.zero_grad()
        old_values = returns = None
        if self.critic is not None:
            self.critic_optim.zero_grad()
            old_values, returns = self.ppo_advantages(batch)
        norm = self._normalizer(batch)
        sums = {"clip_frac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_ref": 0.0, "logprob_diff": 0.0,
                "loss": 0.0, "value_loss": 0.0, "routing_disagreement": 0.0}
        ntok = max(1.0, float(batch.loss_mask.sum()))
        start = 0
        for mb in batch.micro_batches(cfg.micro_batch):
            a, b = mb.cu_seqlens[0] + start, mb.cu_seqlens[-1] + start
            start = b
            w = float(mb.loss_mask.sum()) / ntok
            loss = torch.zeros((), device=mb.input_ids.device)
            if not critic_only:
                if self.replay_routing:
                    self._set_replay(mb)
                logp, ent = self.token_logprobs(self.model, mb)
                self._set_replay(None)
                pl, m = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, mb.seq_ids,
                                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.agg, normalizer=norm)
                loss = loss + pl
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
                sums["clip_frac"] += float(m["clip_frac"]) * w
                sums["approx_kl"] += float(m["approx_kl"]) * w
                blocks = self.model.moe_blocks()
                if self.replay_routing and blocks and blocks[0].last_disagreement is not None:
                    sums["routing_disagreement"] += sum(float(bk.last_disagreement) for bk in blocks) / len(blocks) * w
            if self.critic is not None:
                values = self.critic(mb.input_ids, mb.cu_seqlens)
                vl, _ = value_loss(values, old_values[a:b], returns[a:b], mb.loss_mask, mb.seq_ids,
                                   clip=cfg.vf_clip, agg=cfg.agg, normalizer=norm)
                loss = loss + cfg.vf_coef * vl
                sums["value_loss"] += float(vl.detach())
            loss.backward()
            self.optim.accumulate()
            if self.critic_optim is not None:
                self.critic_optim.accumulate()
            sums["loss"] += float(loss.detach())
        sums["logprob_diff"] /= ntok
        sums["entropy"] /= ntok
        return sums

    def step(self, batch: TrainBatch, *, critic_only: bool = False, phases=None) -> dict:
        """One full update: gradients, clipping, non-finite check, optimizer step(s). Returns metrics.

        `phases` (optional, e.g. telemetry.NvmlSampler) gets set_phase("forward-backward" / "optimizer").
        """
        if phases is not None:
            phases.set_phase("forward-backward")
        metrics = self.compute_grads(batch, critic_only=critic_only)
        if phases is not None:
            phases.set_phase("optimizer")
        actor_norm = torch.nn.utils.clip_grad_norm_(self.optim.grad_params, self.cfg.max_grad_norm)
        critic_norm = None
        if self.critic is not None:
            critic_norm = torch.nn.utils.clip_grad_norm_(self.critic_optim.grad_params, self.cfg.max_grad_norm)
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
        if not critic_only:
            self.optim.step()
        if self.critic_optim is not None:
            self.critic_optim.step()
        return metrics
