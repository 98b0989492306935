"""The paged KV cache: one [num_blocks, P, Hkv, D] K and V tensor per layer (FlashInfer NHD).

All layers live in one allocation [L, 2, num_blocks, P, Hkv, D] so a copy-on-write block copy
is a single indexed copy across every layer. Sizing from a memory budget follows PAPER.md's
m_KV: bytes per block = 2 * L * P * Hkv * D * element size.
One extra block, `null_block` (the last index), is allocated beyond the block manager's
num_blocks: padding rows of a CUDA-graph decode bucket write their K/V there, so they never
touch a sequence's cache.
"""

from __future__ import annotations

import torch

from rlengine.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.null_block = num_blocks  # never handed out by the block manager
        # zeros, not empty: the torch backend gathers padding slots that are masked in the scores, and
        # 0 * NaN from never-written memory would still poison the weighted sum over V
        self.data = torch.zeros(cfg.num_hidden_layers, 2, num_blocks + 1, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, dtype=dtype, device=device)
        self.k = [self.data[i, 0] for i in range(cfg.num_hidden_layers)]
        self.v = [self.data[i, 1] for i in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """data[:, :, dst] = data[:, :, src] for every (src, dst): copy-on-write of shared blocks."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
