"""Prefill on top of cached tokens: a trajectory's chunk (an observation) attends its whole context.

A multi-turn sequence keeps its KV blocks between turns; the chunk appended to it (its last model
token and the observation) runs as a prefill whose queries start at position `context_start` and
whose keys are every token of the sequence, read back from the paged cache after the step's K/V
were stored. Two ways, chosen by the backend's own prefill pass:
- PackedCausal (the fast path): one SDPA per sequence over its new queries, with a mask that lets
  query i see keys 0..start+i;
- any other pass (the batch-invariant InvariantCausal): that pass over each whole context, with
  zero queries at the cached positions, keeping only the new rows. Its reduction order depends on a
  row's own position alone, so the chunk's rows get the bits of a fresh prefill of the whole
  conversation. The cached rows' work is wasted (the invariant mode trades speed for exactness).
Sequences without cached tokens in the same step go through the same code with start 0.
Dimension legend: T new tokens in the step, S context tokens of the step's sequences, H / Hkv heads, D.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rlengine.engine.forward_batch import ForwardBatch
from rlengine.model.attention import PackedCausal, sdpa_causal


class ContextPrefill:
    """Per-step plan of a prefill with cached context: where each sequence's keys sit in the cache."""

    def __init__(self, batch: ForwardBatch, block_size: int, scale: float):
        self.scale, self.qo = scale, list(batch.qo_indptr)
        self.starts = batch.context_start.tolist()
        full = batch.context_lens.astype(np.int64)          # [B] context + new tokens
        self.full_cu = np.zeros(len(full) + 1, np.int64)
        np.cumsum(full, out=self.full_cu[1:])
        pos = np.arange(int(self.full_cu[-1])) - np.repeat(self.full_cu[:-1], full)  # [S] position in its sequence
        indptr = batch.kv_indptr_host.numpy().astype(np.int64)
        page_idx = np.repeat(indptr[:-1], full) + pos // block_size
        device = batch.kv_indices.device
        # [S] flat cache slot of every context token (a host-built index: this is not the decode hot path)
        self.slots = (batch.kv_indices.long()[torch.from_numpy(page_idx).to(device)] * block_size
                      + torch.from_numpy(pos % block_size).to(device))
        # [T] row of each new token in the [S] context layout
        new_rows = np.concatenate([np.arange(self.full_cu[b] + s, self.full_cu[b + 1])
                                   for b, s in enumerate(self.starts)])
        self.new_rows = torch.from_numpy(new_rows).to(device)
        self._full_pass = None

    def attend(self, prefill, layer_id: int, q_THD: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the step's new queries [T, H, D] over their sequences' cached + new keys."""
        Hkv, D = k_cache.shape[2], k_cache.shape[3]
        k_SKD = k_cache.view(-1, Hkv, D)[self.slots].to(q_THD.dtype)
        v_SKD = v_cache.view(-1, Hkv, D)[self.slots].to(q_THD.dtype)
        if not isinstance(prefill, PackedCausal):
            if self._full_pass is None:
                self._full_pass = type(prefill)(self.full_cu.tolist(), self.scale)
            q_SHD = q_THD.new_zeros(k_SKD.shape[0], *q_THD.shape[1:]).index_copy(0, self.new_rows, q_THD)
            return self._full_pass.attend(layer_id, q_SHD, k_SKD, v_SKD).index_select(0, self.new_rows)
        outs = []
        for b, start in enumerate(self.starts):
            q = q_THD[self.qo[b]:self.qo[b + 1]]
            k, v = k_SKD[self.full_cu[b]:self.full_cu[b + 1]], v_SKD[self.full_cu[b]:self.full_cu[b + 1]]
            if start == 0:
                outs.append(sdpa_causal(q, k, v, self.scale))
                continue
            n, S = q.shape[0], k.shape[0]
            mask = torch.arange(S, device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
            q_HND, k_HSD, v_HSD = (x.transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(q_HND, k_HSD, v_HSD, attn_mask=mask, scale=self.scale, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
