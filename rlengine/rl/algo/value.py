"""The PPO critic: a decoder trunk with a scalar value head, initialised from the policy.

The critic is a separate network (its own copy of the trunk), as in PPO for LLMs (verl,
OpenRLHF): values V(s_t) for every packed position, read on the positions that predict
completion tokens. It is the one weight copy rlengine keeps besides the shared policy, and
only PPO creates it. explained_variance() says how much of the returns' variance the values
explain (verl's critic/vf_explained_var), from sums a distributed caller can add over ranks.
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


def explained_variance_sums(values_T: torch.Tensor, returns_T: torch.Tensor, valid_T: torch.Tensor) -> list[float]:
    """[n, sum(d), sum(d^2), sum(R), sum(R^2)] over the valid tokens, d = R - V, in float64: the
    per-rank parts of explained_variance (summed over ranks by the caller). values_T, returns_T [T]."""
    v, r = values_T[valid_T].double(), returns_T[valid_T].double()
    d = r - v
    return [float(valid_T.sum()), float(d.sum()), float((d * d).sum()), float(r.sum()), float((r * r).sum())]


def explained_variance(sums: list[float]) -> float | None:
    """1 - Var(R - V) / Var(R) from explained_variance_sums (global); None when Var(R) is 0 (no signal).
    Both variances carry the same normalisation, so biased and unbiased estimates give the same ratio."""
    n, d1, d2, r1, r2 = sums
    if n < 1:
        return None
    var_d, var_r = d2 / n - (d1 / n) ** 2, r2 / n - (r1 / n) ** 2
    # constant returns: Var(R) is 0 up to the rounding of the one-pass sums, and the ratio meaningless
    return None if var_r <= 1e-12 * (r2 / n) else 1.0 - var_d / var_r
