"""The KL reference: the frozen policy the KL term (train.kl_coef) and the KL in the reward
(train.kl_in_reward) are measured against.

It is the policy as it is when the learner is built (the trainer builds the learner after the format
warm start: the policy at update 0), a deep copy with no gradients; checkpoints save and restore it.
train.ref_offload keeps its decoder layers on the host and streams them per forward (ref_offload.py),
turned on after the parallel wrapper, whose broadcast needs the reference on the device.
"""

from __future__ import annotations

import copy

from torch import nn

from rlengine.rl.learner.ref_offload import HostStreamedLayers


class KLReference:
    """The frozen reference policy (module) and, with train.ref_offload, its host stream."""

    def __init__(self, policy: nn.Module):
        self.module = copy.deepcopy(policy).eval().requires_grad_(False)
        self.stream: HostStreamedLayers | None = None

    def offload(self) -> None:
        """Keep the decoder layers on the host from now on, streamed per forward."""
        self.stream = HostStreamedLayers(self.module)
