"""The critic (PPO, or any estimator whose advantages come from a learned value): a value model on the
policy's trunk, its optimizer, its GAE advantages and its value loss.

ValueModel (rl/algo/value.py) is a copy of the policy's trunk with a scalar head; its AdamW runs at
LearnerSpec.lr x train.critic_lr_mult with the policy's betas, weight decay and masters. Once per
rollout batch advantages() scores every response and runs GAE on the packed batch (update.packed_gae),
then whitens the advantages over all ranks; loss() is one micro-batch's clipped value loss.
"""

from __future__ import annotations

import torch

from rlengine.rl.algo.losses import value_loss
from rlengine.rl.algo.optim import LearnerOptimizer
from rlengine.rl.algo.value import ValueModel
from rlengine.rl.distributed import Dist
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.update import packed_gae, whiten


class Critic:
    """The value model (module), the module the learner calls (fwd: wrapped when parallel) and its optimizer."""

    def __init__(self, policy, *, options):
        self.options = options  # train.*: gamma, lam, kl_reward_coef, vf_clip, vf_coef, critic_lr_mult
        self.module = ValueModel(policy)
        self.fwd = self.module
        self.optim: LearnerOptimizer | None = None

    def start(self, fwd, *, lr: float, masters: bool) -> None:
        """After the parallel wrapper: the module to call, and the optimizer over the parameters as wrapped
        (FSDP2 replaces them with sharded ones)."""
        o = self.options
        self.fwd = fwd
        self.optim = LearnerOptimizer(self.module.parameters(), lr=lr * o.critic_lr_mult, betas=o.betas,
                                      weight_decay=o.weight_decay, masters=masters)

    @torch.no_grad()
    def advantages(self, batch: TrainBatch, kl_T: torch.Tensor | None, dist: Dist) -> tuple[torch.Tensor, torch.Tensor]:
        """Values and GAE on every response; writes whitened advantages into batch.advantages.

        A response's trained positions are the last n of its packed segment; the outcome reward sits
        on its last token, and with kl_T (train.kl_in_reward) every token's reward is also
        -kl_reward_coef * kl_t. Whitening uses the mean / std over the valid tokens of ALL ranks.
        Returns (old_values [T], returns [T]) for the value loss."""
        o = self.options
        values_T = self.fwd(batch.input_ids, batch.cu_seqlens)
        adv_T, ret_T = packed_gae(batch, values_T, kl_T, gamma=o.gamma, lam=o.lam, kl_coef=o.kl_reward_coef)
        batch.advantages = whiten(adv_T, batch.loss_mask > 0, dist)
        return values_T, ret_T

    def loss(self, mb: TrainBatch, filler: bool, agg: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(vf_coef x value loss, value loss) of one micro-batch (a filler: the values as their own targets)."""
        o = self.options
        values = self.fwd(mb.input_ids, mb.cu_seqlens, checkpoint_layers=o.activation_checkpointing)
        old = values.detach() if filler else mb.old_values
        returns = values.detach() if filler else mb.returns
        vl, _ = value_loss(values, old, returns, mb.loss_mask, mb.seq_ids, clip=o.vf_clip, **agg)
        return o.vf_coef * vl, vl
