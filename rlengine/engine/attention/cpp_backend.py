"""CPU decode backend: the C++ paged-decode kernel from csrc/ (torch.ops.rlengine.paged_decode).

graph_safe: decode reads only the page-table tensors. There are no CUDA graphs on the CPU, but
the engine's graph replay stand-in (cuda_graph.StaticReplay) runs on it, so the graph contract
is tested here without a GPU. Shared-prefix decode: a step with forked siblings runs
torch.ops.rlengine.cascade_decode (csrc/cascade_decode.cpp) on plan()'s cascade tables instead.
"""

from __future__ import annotations

import torch

from rlengine.model import ext as _ext
from rlengine.engine.attention.base import AttentionBackend


class CppBackend(AttentionBackend):
    name = "cpp"
    graph_safe = True
    supports_shared_prefix = _ext.has_op("cascade_decode")
    # docs/RESULTS.md: the attention op 3-4x and the 512-token GRPO step 1.27-1.76x faster; no cost without sharing
    shared_prefix_by_default = True

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
        # the prefix level's normalised outputs and log-sum-exps (cascade decode scratch)
        self.prefix_out = torch.empty(max_num_seqs * num_heads * head_dim, dtype=torch.float32)
        self.prefix_lse = torch.empty(max_num_seqs * num_heads, dtype=torch.float32)
        self.cascade: tuple[torch.Tensor, ...] | None = None

    def plan(self, batch) -> None:
        super().plan(batch)
        self.step_out = self.out[: batch.batch_size]  # sliced once per step, written by every layer
        plan = self.plan_shared_prefix(batch)
        self.cascade = None if plan is None else tuple(torch.from_numpy(a) for a in (
            plan.chunk_indptr, plan.prefix_indptr, plan.prefix_indices, plan.suffix_indptr, plan.suffix_indices))

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        if self.cascade is not None:
            torch.ops.rlengine.cascade_decode(q_BHD, k_cache, v_cache, *self.cascade, b.kv_last_page_len, self.scale,
                                              self.prefix_out, self.prefix_lse, self.step_out)
            return self.step_out
        # q needs only a contiguous last dim (the op takes its other strides), which RoPE's output has
        torch.ops.rlengine.paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                        self.scale, self.step_out)
        return self.step_out
