"""Stage-to-stage objects of the engine's forward: what the model runner hands to attention.

Names follow vLLM / FlashInfer (slot_mapping, kv_indptr, kv_indices, kv_last_page_len,
qo_indptr) so readers move freely between rlengine and its dependencies.
Dimension legend: T tokens in the step, B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, kw_only=True)
class ForwardBatch:
    """Device tensors and host metadata of one engine step (prefill or decode)."""

    kind: str                       # "prefill" | "decode"
    input_ids: torch.Tensor         # [T] int64 token ids
    positions: torch.Tensor         # [T] int64 absolute positions
    slot_mapping: torch.Tensor      # [T] int64 flat KV slot each token's K/V is written to
    qo_indptr: list[int]            # [B+1] host: token range of each sequence in T (cu_seqlens)
    kv_indptr: torch.Tensor         # [B+1] int32 page-table CSR offsets
    kv_indices: torch.Tensor        # [kv_indptr[-1]] int32 block ids
    kv_last_page_len: torch.Tensor  # [B] int32 tokens in each sequence's last page, 1..P
    context_lens: list[int]         # [B] host: tokens attended to (including this step's)
    logits_indices: torch.Tensor | None  # [B] int64 row of each sequence's last token in T; None: all rows (decode)
    max_num_pages: int              # host: the most pages any sequence in the batch uses
    # True for a CUDA-graph bucket's batch: the tensors are the graph's fixed input buffers, and the
    # host fields (context_lens, max_num_pages) are capture-time placeholders that decode must not read.
    static: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
