"""Batch-invariant backend on CUDA: the Triton attention of kernels/invariant_attention.py on the
engine's paged KV cache, the GPU twin of invariant_backend.py.

Prefill attends with the learner's own invariant causal pass (InvariantCausal, which dispatches CUDA
tensors to invariant_attention_varlen); decode runs invariant_paged_decode, the same kernel body
reading a sequence's keys through its pages in the same 32-key chunks aligned to absolute positions
and merged in the same order, so a token's attention output is the learner's bit for bit, whatever
the batch, the page layout or a preemption. No split-KV and no shared-prefix pass in this mode.
graph_safe: decode reads only the page-table tensors and launches a (B, Hkv) grid.
resolve_backend picks it for attention_backend="invariant" on a CUDA device.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention.base import AttentionBackend
from rlengine.model import batch_invariant as inv


class InvariantTritonBackend(AttentionBackend):
    """A preallocated output buffer and the invariant prefill and decode, on CUDA."""

    name = "invariant"
    graph_safe = True
    supports_shared_prefix = False  # each query reads its own prefix in the fixed chunk grid

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"the invariant Triton backend runs on CUDA, the model is on {device}"
        if not inv.triton_available():
            return "triton is not installed"
        return None

    def __init__(self, kv_cache, num_heads, head_dim, max_num_seqs):
        super().__init__(kv_cache, num_heads, head_dim, max_num_seqs)
        from rlengine.kernels.invariant_attention import invariant_paged_decode

        self._decode = invariant_paged_decode
        self.out = torch.empty(max_num_seqs, num_heads, head_dim, dtype=kv_cache.data.dtype,
                               device=kv_cache.data.device)

    def plan(self, batch) -> None:
        super().plan(batch)
        self.step_out = self.out[: batch.batch_size]  # sliced once per step, written by every layer
        if batch.kind == "prefill":
            self._prefill = inv.InvariantCausal(batch.qo_indptr, self.scale)

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        return self._decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len, self.scale,
                            self.step_out)
