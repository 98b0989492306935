"""GPU (or interpreter) decode backend: rlengine's own Triton split-KV paged-decode kernel.

graph_safe: the kernel reads the page tables from device tensors and each sequence splits its
own pages, so the launch depends only on the batch size and on max_num_pages, which a graph
bucket's batch fixes at capture (the per-sequence capacity).
"""

from __future__ import annotations

import os

import torch

from rlengine.engine.attention.base import AttentionBackend


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU correctness runs)"
        return None

    def __init__(self, kv_cache, num_heads, head_dim, max_num_seqs):
        super().__init__(kv_cache, num_heads, head_dim, max_num_seqs)
        from rlengine.kernels import paged_decode as pd

        self._pd = pd
        device = kv_cache.data.device
        # sized to the most splits the kernel's heuristic can pick for this many KV heads
        self.workspace = pd.alloc_workspace(max_num_seqs, num_heads, head_dim, pd.MAX_SPLITS, device,
                                            num_kv_heads=kv_cache.data.shape[4])
        self.out = torch.empty(max_num_seqs, num_heads, head_dim, dtype=kv_cache.data.dtype, device=device)

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        return self._pd.paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                     sm_scale=self.scale, max_num_pages=b.max_num_pages,
                                     out=self.out[: q_BHD.shape[0]], workspace=self.workspace)
