"""Reference decode backend: gather each sequence's K/V into a padded [B, S_max] batch and run SDPA.

The oracle of the engine: runs anywhere, no custom kernels. plan() builds the gather index
and padding mask once per step; every layer reuses them. Not graph-safe: the gather's shape
follows the step's longest context (a host value).
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
        s_max = int(batch.context_lens.max())
        pos = torch.arange(s_max, device=device)
        indptr = batch.kv_indptr.long()
        lens = torch.from_numpy(batch.context_lens).to(device)  # a host copy: the oracle is not a hot path
        # Padding positions re-read the sequence's own last token: masked out of the scores, but the
        # values must still be finite (0 * NaN from never-written cache memory would poison o = p @ V).
        pos_BS = torch.minimum(pos[None, :], lens[:, None] - 1)
        page_idx = indptr[:-1, None] + pos_BS // P
        self.slots = batch.kv_indices.long()[page_idx] * P + pos_BS % P            # [B, S_max]
        self.mask = (pos[None, :] < lens[:, None])[:, None, None, :]                # [B, 1, 1, S_max]

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        Hkv, D = k_cache.shape[2], k_cache.shape[3]
        k = k_cache.view(-1, Hkv, D)[self.slots].transpose(1, 2)   # [B, Hkv, S_max, D]
        v = v_cache.view(-1, Hkv, D)[self.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q_BHD.unsqueeze(2), k.to(q_BHD.dtype), v.to(q_BHD.dtype),
                                           attn_mask=self.mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)
