"""The PPO critic: a decoder trunk with a scalar value head, initialised from the policy.

The critic is a separate network (its own copy of the trunk), as in PPO for LLMs (verl,
OpenRLHF): values V(s_t) for every packed position, read on the positions that predict
completion tokens. It is the one weight copy rlengine keeps besides the shared policy, and
only PPO creates it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlengine.model.attention import PackedCausal
from rlengine.model.qwen3 import Qwen3ForCausalLM


class ValueModel(nn.Module):
    def __init__(self, policy: Qwen3ForCausalLM):
        super().__init__()
        self.trunk = copy.deepcopy(policy.model)
        for block in self.trunk.modules():  # the critic never replays or records routing
            if hasattr(block, "replay_ids"):
                block.replay_ids, block.record_ids = None, False
        self.head = nn.Linear(policy.config.hidden_size, 1, bias=True, device=policy.device, dtype=policy.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.scale = policy.config.head_dim ** -0.5

    def forward(self, input_ids_T: torch.Tensor, cu_seqlens: list[int], *, checkpoint_layers: bool = False
                ) -> torch.Tensor:
        """Packed values: input_ids [T] with boundaries cu_seqlens [B+1] -> [T] fp32 (checkpoint_layers:
        recompute each trunk layer in the backward, Qwen3Model.forward)."""
        positions = torch.cat([torch.arange(b - a, device=input_ids_T.device)
                               for a, b in zip(cu_seqlens, cu_seqlens[1:])])
        hidden = self.trunk(input_ids_T, positions, PackedCausal(list(cu_seqlens), self.scale),
                            checkpoint_layers=checkpoint_layers)
        return self.head(hidden).squeeze(-1).float()
