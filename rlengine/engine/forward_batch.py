"""Stage-to-stage objects of the engine's forward: what the model runner hands to attention and sampling.

Names follow vLLM / FlashInfer (slot_mapping, kv_indptr, kv_indices, kv_last_page_len,
qo_indptr) so readers move freely between rlengine and its dependencies. Every tensor here is
a view of the step's one staging copy (engine/step_inputs.py): building a batch allocates
nothing on the device and never syncs.
Dimension legend: T tokens in the step, B sequences in the forward, N samples (sequences that
receive a token: B in a decode step, every member of each admitted group in a prefill step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, kw_only=True)
class ForwardBatch:
    """Device tensors and host metadata of one engine step (prefill or decode)."""

    kind: str                       # "prefill" | "decode"
    input_ids: torch.Tensor         # [T] int64 token ids
    positions: torch.Tensor         # [T] int64 absolute positions
    slot_mapping: torch.Tensor      # [T] int64 flat KV slot each token's K/V is written to
    qo_indptr: Sequence[int]        # [B+1] host: token range of each sequence in T (cu_seqlens)
    kv_indptr: torch.Tensor         # [B+1] int32 page-table CSR offsets
    kv_indices: torch.Tensor        # [>= kv_indptr[-1]] int32 block ids
    kv_last_page_len: torch.Tensor  # [B] int32 tokens in each sequence's last page, 1..P
    kv_indptr_host: torch.Tensor    # [B+1] int32 the same values on the host (pinned): FlashInfer's plan()
    kv_last_page_len_host: torch.Tensor  # [B] int32 on the host (pinned)
    context_lens: np.ndarray        # [B] host: tokens attended to (including this step's)
    logits_indices: torch.Tensor | None  # [B] int64 row of each sequence's last token in T; None: all rows (decode)
    max_num_pages: int              # host: the most pages any sequence in the batch uses
    # True for a CUDA-graph bucket's batch: the tensors are the graph's fixed input buffers, and the
    # host fields context_lens / max_num_pages are capture-time placeholders that decode must not
    # read. kv_indptr_host / kv_last_page_len_host stay live (plan() runs before every replay).
    static: bool = False
    # decode: [>= kv_indptr[-1]] int32 the page tables on the host (numpy view of the staging buffer),
    # read by plan() for shared-prefix decode; None when the step has none
    kv_indices_host: np.ndarray | None = None
    # prefill: [B] host tokens of each sequence already in the cache, this step's tokens come after them (a
    # trajectory's chunk, engine/turns.py); None: every sequence starts at position 0
    context_start: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(slots=True, kw_only=True)
class SamplingBatch:
    """Per-sample sampling inputs of one step: device views of the staging copy plus host flags."""

    num_samples: int                # N
    logits_rows: torch.Tensor | None  # [N] int64 logits row each sample draws from; None: sample i <- row i
    temperature: torch.Tensor       # [N] fp32 (1.0 on greedy rows)
    top_k: torch.Tensor             # [N] int64, <= 0: off
    top_p: torch.Tensor             # [N] fp32, 1.0: off
    seed_keys: torch.Tensor         # [N] int64 (uint64 bits) draw key of each seeded sample (sampler.draw_keys)
    kind: torch.Tensor              # [N] int32 sampler.SAMPLED | FILTERED | PROCESSED | SEEDED bits
    kinds_any: int                  # host: OR of kind over the samples
    kinds_all: int                  # host: AND of kind over the samples
    max_top_k: int                  # host: largest top_k below V (the CPU filter's candidate count)
