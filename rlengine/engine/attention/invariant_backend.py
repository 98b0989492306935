"""Batch-invariant backend: the attention of model/batch_invariant.py on the engine's paged KV cache.

Prefill attends with the learner's own invariant causal pass (InvariantCausal); decode runs
csrc/batch_invariant.cpp's inv_paged_decode, which reads a sequence's keys page by page in the same
32-key chunks aligned to absolute positions and merges them in the same order, so a token's
attention output is the learner's bit for bit, whatever the batch, the page layout or a preemption.
There is no split-KV and no shared-prefix pass in this mode (each query reads its own prefix).
The LLM picks it whenever batch_invariant=True. graph_safe: decode reads only the page tables.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention.cpp_backend import CppBackend
from rlengine.model import batch_invariant as inv


class InvariantBackend(CppBackend):
    """The CPU backend's output buffer and graph contract, with the invariant prefill and decode."""

    name = "invariant"
    supports_shared_prefix = False  # each query reads its own prefix in the fixed chunk grid

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"the invariant backend runs on the CPU only, the model is on {device}"
        if not inv.AVAILABLE:
            return "the C++ extension lacks the batch-invariant ops (rebuild it)"
        return None

    def plan(self, batch) -> None:
        super().plan(batch)
        if batch.kind == "prefill":
            self._prefill = inv.InvariantCausal(batch.qo_indptr, self.scale)

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        torch.ops.rlengine.inv_paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                            self.scale, self.step_out)
        return self.step_out
