"""The paged KV cache: one [num_blocks, P, Hkv, D] K and V tensor per layer (FlashInfer NHD).

All layers live in one allocation [L, 2, num_blocks, P, Hkv, D] so a copy-on-write block copy
is a single indexed copy across every layer. Sizing from a memory budget follows docs/METHOD.md's
m_KV: bytes per block = 2 * L * P * Hkv * D * element size.
One extra block, `null_block` (the last index), is allocated beyond the block manager's
num_blocks: padding rows of a CUDA-graph decode bucket write their K/V there, so they never
touch a sequence's cache.
A KVPool is a cache plus the free list / reference counts of its blocks (BlockPool): engines
on one device share it (LLM(kv_pool=...)), so the eval engine never allocates a second cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlengine.model.config import ModelConfig
from rlengine.engine.block_manager import BlockPool


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

    def copy_blocks(self, src_C: torch.Tensor, dst_C: torch.Tensor) -> None:
        """data[:, :, dst] = data[:, :, src] for block ids src, dst [C] int64 on the cache's device:
        the step's copy-on-write of shared blocks, in place, one indexed copy for every layer (no sync:
        index_select + index_copy_ with device indices)."""
        self.data.index_copy_(2, dst_C, self.data.index_select(2, src_C))


@dataclass(frozen=True, slots=True)
class KVPool:
    """A KV cache and its blocks' free list and reference counts: what engines sharing memory share."""

    cache: KVCache
    blocks: BlockPool
