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
    """Causal attention of one sequence laid out [T, heads, D]; GQA by head grouping.

    As a batch of one: SDPA's flash kernels take 4-D inputs only, and 3-D ones fall back to the math
    path, which keeps the [heads, T, T] fp32 probabilities for the backward (quadratic in T)."""
    o = F.scaled_dot_product_attention(q_THD.transpose(0, 1)[None], k_TKD.transpose(0, 1)[None],
                                       v_TKD.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


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

    Two layouts, the same result:
    - padded: right-pad the sequences into one [B, S_max] batch and run a single causal SDPA.
      With the padding at the end, causality alone keeps every real query off the padding keys,
      so no mask is needed; padded query rows are dropped on the way back.
    - loop: one SDPA call per sequence.
    Padded is used when gradients flow (the learner) or on a GPU (one flash kernel instead of
    B launches), as long as padding at most doubles the work (B * S_max <= 2T). On the CPU,
    bench/bench_packed_attention.py measured padded forward + backward 1.0-5.2x faster than the
    loop (B 8-128, L 64-256; the gain grows with B) and a whole qwen3-30m GRPO step 1.24-1.28x
    faster. A forward alone (the engine's prefill) was 0.72-1.38x, so CPU inference keeps the loop.
    layout="padded" / "loop" forces one (benchmarks, tests).
    """

    MAX_PAD_FACTOR = 2.0
    LAYOUTS = ("auto", "padded", "loop")

    def __init__(self, cu_seqlens: list[int], scale: float, layout: str = "auto"):
        if layout not in self.LAYOUTS:
            raise ValueError(f"PackedCausal layout must be one of {self.LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        self.scale = scale
        lens = [b - a for a, b in self.bounds]
        self.max_len = max(lens, default=0)
        total = cu_seqlens[-1] - cu_seqlens[0]
        self.can_pad = len(lens) > 1 and len(lens) * self.max_len <= self.MAX_PAD_FACTOR * total
        self._flat: torch.Tensor | None = None  # [T] row of each token in the padded [B * S_max] layout

    def _flat_index(self, device: torch.device) -> torch.Tensor:
        if self._flat is None or self._flat.device != device:
            S = self.max_len
            idx = torch.cat([torch.arange(i * S, i * S + (b - a)) for i, (a, b) in enumerate(self.bounds)])
            if device.type == "cuda":  # pinned: the copy is queued without a wait on pageable memory
                idx = idx.pin_memory()
            self._flat = idx.to(device, non_blocking=True)  # built once per step, shared by every layer
        return self._flat

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        if len(self.bounds) == 1:
            return sdpa_causal(q_THD, k_TKD, v_TKD, self.scale)
        if self.layout == "auto":
            padded = self.can_pad and (q_THD.requires_grad or q_THD.is_cuda)
        else:
            padded = self.layout == "padded"
        if not padded:
            return torch.cat([sdpa_causal(q_THD[a:b], k_TKD[a:b], v_TKD[a:b], self.scale) for a, b in self.bounds])
        B, S = len(self.bounds), self.max_len
        flat = self._flat_index(q_THD.device)

        def pad(x_TND):  # [T, heads, D] -> [B, heads, S, D], zeros in the padding
            out = x_TND.new_zeros(B * S, *x_TND.shape[1:]).index_copy(0, flat, x_TND)
            return out.view(B, S, *x_TND.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(pad(q_THD), pad(k_TKD), pad(v_TKD), is_causal=True, scale=self.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(B * S, *q_THD.shape[1:]).index_select(0, flat)
