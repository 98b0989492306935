"""Reference decode backend: gather each sequence's K/V into a padded [B, S_max] batch and run SDPA.

The oracle of the engine: runs anywhere, no custom kernels. plan() builds the gather index
and padding mask once per step; every layer reuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlengine.engine.attention.base import AttentionBackend


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch) -> None:
        super().plan(batch)
        if batch.kind != "decode":
            return
        P = self.kv.block_size
        device = batch.input_ids.device
        s_max = max(batch.context_lens)
        pos = torch.arange(s_max, device=device)
        indptr = batch.kv_indptr.long()
        # page of each (sequence, position), clamped for padding rows (masked out below)
        lens = torch.tensor(batch.context_lens, device=device)
        page_idx = (indptr[:-1, None] + pos[None, :] // P).clamp(max=max(0, batch.kv_indices.numel() - 1))
        self.slots = batch.kv_indices.long()[page_idx] * P + pos[None, :] % P      # [B, S_max]
        self.mask = (pos[None, :] < lens[:, None])[:, None, None, :]                # [B, 1, 1, S_max]

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        Hkv, D = k_cache.shape[2], k_cache.shape[3]
        k = k_cache.view(-1, Hkv, D)[self.slots].transpose(1, 2)   # [B, Hkv, S_max, D]
        v = v_cache.view(-1, Hkv, D)[self.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q_BHD.unsqueeze(2), k.to(q_BHD.dtype), v.to(q_BHD.dtype),
                                           attn_mask=self.mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)
