"""Attention contexts: how one decoder forward attends, chosen by the caller.

The model computes q, k, v for the packed tokens of a batch and hands them to
`ctx.attend(layer_id, q, k, v)`. The learner and the parity tests use the causal contexts
here (no cache); the engine passes its paged-KV attention backend (rlengine/engine/attention),
which writes k/v into the cache and reads the context from it. Step metadata lives on the
context object, never in module globals.

Dimension legend: T packed tokens, B sequences, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def attend(self, layer_id: int, q_THD: torch.Tensor, k_TKD: torch.Tensor,
               v_TKD: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> o [T, H, D] (same dtype as q)."""
        ...


def sdpa_causal(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence laid out [T, heads, D]; GQA by head grouping."""
    o = F.scaled_dot_product_attention(q_THD.transpose(0, 1), k_TKD.transpose(0, 1), v_TKD.transpose(0, 1),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


class DenseCausal:
    """B equal-length sequences packed row-major from a [B, S] input: one batched SDPA call."""

    def __init__(self, batch: int, seqlen: int, scale: float):
        self.batch, self.seqlen, self.scale = batch, seqlen, scale

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        B, S = self.batch, self.seqlen
        q = q_THD.view(B, S, *q_THD.shape[1:]).transpose(1, 2)
        k = k_TKD.view(B, S, *k_TKD.shape[1:]).transpose(1, 2)
        v = v_TKD.view(B, S, *v_TKD.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(q_THD.shape)


class PackedCausal:
    """Variable-length sequences packed along T, boundaries in cu_seqlens [B+1] (host list).

    Attends each sequence separately with SDPA: exact, and the learner's batches are few
    sequences of many tokens, so the per-sequence loop is not the bottleneck on CPU.
    """

    def __init__(self, cu_seqlens: list[int], scale: float):
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        self.scale = scale

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        if len(self.bounds) == 1:
            return sdpa_causal(q_THD, k_TKD, v_TKD, self.scale)
        return torch.cat([sdpa_causal(q_THD[a:b], k_TKD[a:b], v_TKD[a:b], self.scale) for a, b in self.bounds])
