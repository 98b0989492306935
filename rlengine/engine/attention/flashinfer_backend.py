"""FlashInfer decode backend (BatchDecodeWithPagedKVCacheWrapper), used when installed on a GPU.

plan() hands FlashInfer the step's page tables once; run() per layer. FlashInfer's plan() works
on the host: indptr and last_page_len go in as the batch's pinned host tensors (given device
tensors it would copy them back, two syncs per step), kv_indices as the device view. Under CUDA
graphs each batch bucket gets its own wrapper built with use_cuda_graph=True over the bucket's
fixed page-table buffers (FlashInfer's own graph mode), re-planned outside the graph before every
replay. Opt-in (attention_backend="flashinfer"; `auto` never picks it) until a GPU run has checked
it against the torch oracle: tests/gpu/test_engine_sync_and_backends_gpu.py does when flashinfer is installed.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention.base import AttentionBackend

_WORKSPACE_BYTES = 128 * 2**20


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    graph_safe = True

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

        # zeros: recent FlashInfer versions require the workspace zeroed before its first use
        self._flashinfer = flashinfer
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=kv_cache.data.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_wrappers: dict[int, object] = {}  # batch bucket -> wrapper over that bucket's buffers
        self.active = self.wrapper

    def _graph_wrapper(self, batch):
        bs = batch.batch_size
        if bs not in self.graph_wrappers:
            # One workspace per bucket: a wrapper's plan writes its scheduling data there, and each
            # captured graph reads its own wrapper's.
            workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.workspace.device)
            self.graph_wrappers[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=batch.kv_indptr,
                paged_kv_indices_buffer=batch.kv_indices, paged_kv_last_page_len_buffer=batch.kv_last_page_len)
        return self.graph_wrappers[bs]

    def plan(self, batch) -> None:
        super().plan(batch)
        if batch.kind == "decode":
            self.active = self._graph_wrapper(batch) if batch.static else self.wrapper
            k = self.kv.k[0]
            self.active.plan(batch.kv_indptr_host, batch.kv_indices, batch.kv_last_page_len_host, self.num_heads,
                             k.shape[2], self.head_dim, k.shape[1], q_data_type=k.dtype, sm_scale=self.scale)

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        return self.active.run(q_BHD.contiguous(), (k_cache, v_cache))
