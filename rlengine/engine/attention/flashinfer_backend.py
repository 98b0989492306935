"""FlashInfer decode backend (BatchDecodeWithPagedKVCacheWrapper), used when installed on a GPU.

plan() hands FlashInfer the step's page tables once; run() per layer. Untested in CI (no GPU,
FlashInfer not installed there); the torch backend is its oracle when it runs.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention.base import AttentionBackend


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"flashinfer needs a CUDA device, the model is on {device}"
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "flashinfer is not installed (pip install flashinfer-python)"
        return None

    def __init__(self, kv_cache, num_heads, head_dim, max_num_seqs):
        super().__init__(kv_cache, num_heads, head_dim, max_num_seqs)
        import flashinfer

        device = kv_cache.data.device
        self.workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")

    def plan(self, batch) -> None:
        super().plan(batch)
        if batch.kind == "decode":
            k = self.kv.k[0]
            self.wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, self.num_heads,
                              k.shape[2], self.head_dim, k.shape[1], q_data_type=k.dtype, sm_scale=self.scale)

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        return self.wrapper.run(q_BHD.contiguous(), (k_cache, v_cache))
