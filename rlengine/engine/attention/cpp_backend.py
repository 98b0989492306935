"""CPU decode backend: the C++ paged-decode kernel from csrc/ (torch.ops.rlengine.paged_decode).

graph_safe: decode reads only the page-table tensors. There are no CUDA graphs on the CPU, but
the engine's graph replay stand-in (cuda_graph.StaticReplay) runs on it, so the graph contract
is tested here without a GPU.
"""

from __future__ import annotations

import torch

from rlengine import _ext
from rlengine.engine.attention.base import AttentionBackend


class CppBackend(AttentionBackend):
    name = "cpp"
    graph_safe = True

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"the cpp backend runs on the CPU only, the model is on {device}"
        if not _ext.has_op("paged_decode"):
            return f"the C++ extension with paged_decode is not built ({_ext.LOAD_ERROR or 'op missing'})"
        return None

    def __init__(self, kv_cache, num_heads, head_dim, max_num_seqs):
        super().__init__(kv_cache, num_heads, head_dim, max_num_seqs)
        self.out = torch.empty(max_num_seqs, num_heads, head_dim, dtype=kv_cache.data.dtype)

    def plan(self, batch) -> None:
        super().plan(batch)
        self.step_out = self.out[: batch.batch_size]  # sliced once per step, written by every layer

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        # q needs only a contiguous last dim (the op takes its other strides), which RoPE's output has
        torch.ops.rlengine.paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                        self.scale, self.step_out)
        return self.step_out
