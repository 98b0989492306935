"""The KL reference: the frozen policy the KL term (train.kl_coef) and the KL in the reward
(train.kl_in_reward) are measured against.

It is the policy as it is when the learner is built (the trainer builds the learner after the format
warm start: the policy at update 0), a deep copy with no gradients; checkpoints save and restore it.
With LoRA adapters (model/lora.py) the reference is the base model: the policy itself run with every
adapter switched off (BaseView), no second copy of the weights, nothing to save or offload.
train.ref_offload keeps its decoder layers on the host and streams them per forward (ref_offload.py),
turned on after the parallel wrapper, whose broadcast needs the reference on the device.
"""

from __future__ import annotations

import copy

from torch import nn

from rlengine.model.lora import adapters_disabled, lora_spec
from rlengine.rl.learner.ref_offload import HostStreamedLayers


class BaseView(nn.Module):
    """Calls the policy with its adapters off: the base model, as a module with no parameters of its
    own (the policy is held outside the module tree, so state_dict, broadcasts and checkpoints see none)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self._policy = (policy,)

    @property
    def policy(self) -> nn.Module:
        return self._policy[0]

    @property
    def batch_invariant(self) -> bool:
        return self.policy.batch_invariant

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)


class KLReference:
    """The frozen reference policy (module) and, with train.ref_offload, its host stream."""

    def __init__(self, policy: nn.Module):
        self.shared = lora_spec(policy) is not None
        self.module = BaseView(policy) if self.shared else copy.deepcopy(policy).eval().requires_grad_(False)
        self.stream: HostStreamedLayers | None = None

    def offload(self) -> None:
        """Keep the decoder layers on the host from now on, streamed per forward (a BaseView has none)."""
        if not self.shared:
            self.stream = HostStreamedLayers(self.module)
