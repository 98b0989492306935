"""The attention-backend protocol: plan() once per step, attend() once per layer.

attend() writes the step's K/V into the paged cache (slot_mapping), then attends:
prefill steps attend causally within each new sequence (from position 0: forked samples never
prefill, preempted ones recompute from scratch; a trajectory's chunk on top of its cached tokens
reads its whole context back from the cache, attention/context_prefill.py), decode
steps run the backend's paged-decode kernel over the block tables. Subclasses implement
`decode()` and may override `plan()` to build per-step metadata outside the layer loop.

CUDA graphs (engine/cuda_graph.py): a backend sets `graph_safe = True` when its decode() reads
nothing but the ForwardBatch's device tensors and launches a fixed grid for a fixed batch size,
so a captured decode step replays correctly for any page tables written into the same buffers.
plan() always runs outside the graph, before each replay.

Shared-prefix decode: a backend that sets `supports_shared_prefix` runs a decode step whose batch
holds forked siblings (a GRPO group) as cascade attention, when the engine turns `shared_prefix`
on; plan() then finds the shared pages (attention/cascade.py) from the step's host page tables.
A graph bucket's batch (static) always runs plain decode: the cascade launch depends on the step.
With `min_shared_fraction` > 0 (the engine's default setting) a step runs cascade only where the plan
saves at least that fraction of its page reads; a batch whose rows are the same as at the last step
found not worth it skips the planner (the rows' shared pages are fixed at the fork and their own pages
only grow, so the fraction only falls until the batch changes).
"""

from __future__ import annotations

import numpy as np
import torch

from rlengine.model import ext as _ext
from rlengine.engine.attention.cascade import CascadePlan, plan_cascade
from rlengine.engine.attention.context_prefill import ContextPrefill
from rlengine.engine.kv_cache import KVCache
from rlengine.model.attention import PackedCausal
from rlengine.engine.forward_batch import ForwardBatch

_CPP_STORE = _ext.has_op("store_kvcache")
_CUDA_STORE = _ext.has_cuda_op("store_kvcache")


def store_kv(k_TKD, v_TKD, k_cache, v_cache, slot_mapping_T) -> None:
    """Write K/V rows [T, Hkv, D] into the paged cache at slot_mapping [T], in place.

    The extension's op when built for the device (csrc/kv_cache.cpp, csrc/cuda/kv_cache.cu: one
    call for K and V), else two index_copy_.
    """
    if (_CPP_STORE and k_cache.is_cpu) or (_CUDA_STORE and k_cache.is_cuda):
        torch.ops.rlengine.store_kvcache(k_TKD, v_TKD, k_cache, v_cache, slot_mapping_T)
        return
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping_T, k_TKD.to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping_T, v_TKD.to(v_cache.dtype))


# shared_prefix_decode=None: cascade where a step's plan saves at least this fraction of its page reads. Measured on
# the cpp backend (docs/RESULTS.md): 22% saved (the long-response job's 1 shared page of 4) ran the step at 0.91x
# plain, the planner's ~90 us included; 91% saved (512-token prompts) at 1.27-1.76x.
AUTO_SHARED_FRACTION = 0.5


class AttentionBackend:
    name = "base"
    graph_safe = False
    supports_shared_prefix = False
    shared_prefix_by_default = False  # LLM(shared_prefix_decode=None): on only where measured faster than plain
    cascade_max_rows = 64  # most batch rows one prefix work item scores together
    decode_kernels = "torch"  # the model's decode layer path (EngineSpec.decode_kernels; model/fused_decode.py)

    def __init__(self, kv_cache: KVCache, num_heads: int, head_dim: int, max_num_seqs: int):
        self.kv = kv_cache
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim ** -0.5
        self.max_num_seqs = max_num_seqs
        self.batch: ForwardBatch | None = None
        self._prefill: PackedCausal | None = None  # set for prefill steps, None for decode steps
        self._context: ContextPrefill | None = None  # a prefill step with cached context (trajectory chunks)
        self.shared_prefix = False  # the engine sets it (LLM(shared_prefix_decode=...)) where supported
        self.min_shared_fraction = 0.0  # cascade only where the plan saves at least this fraction of page reads
        self._rows_not_worth: np.ndarray | None = None  # first page per row of the last batch found not worth it
        self.num_cascade_steps = 0  # decode steps that ran as cascade attention

    def configure_shared_prefix(self, setting: bool | None) -> None:
        """LLM(shared_prefix_decode=setting): None takes this backend's measured default and the
        AUTO_SHARED_FRACTION rule; True runs cascade wherever a whole page is shared; False never."""
        auto = setting is None
        on = self.shared_prefix_by_default if auto else setting
        self.shared_prefix = on and self.supports_shared_prefix
        self.min_shared_fraction = AUTO_SHARED_FRACTION if auto else 0.0

    def graph_page_bounds(self, bs: int, max_pages: int) -> list[int]:
        """Ascending page bounds of the context classes a graph bucket of bs rows captures one graph for
        (the last is max_pages, the capacity): a backend whose launch depends on max_num_pages (split
        counts) returns more than one, so short contexts do not pay for the capacity's splits."""
        return [max_pages]

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self._prefill = PackedCausal(batch.qo_indptr, self.scale) if batch.kind == "prefill" else None
        self._context = None
        if batch.kind == "prefill" and batch.context_start is not None:
            self._context = ContextPrefill(batch, self.kv.block_size, self.scale)

    def plan_shared_prefix(self, batch: ForwardBatch) -> CascadePlan | None:
        """This decode step's cascade plan, or None: plain decode (sharing off, a graph bucket, no two
        rows sharing a whole page). Host work on the step's host page tables."""
        if not self.shared_prefix or batch.kind != "decode" or batch.static or batch.kv_indices_host is None:
            return None
        # page counts from the host context lengths (the same rule step_inputs lays the tables out by)
        indptr = np.zeros(batch.batch_size + 1, np.int64)
        np.cumsum(-(-batch.context_lens // self.kv.block_size), out=indptr[1:])
        first_pages = batch.kv_indices_host[indptr[:-1]]
        if self._rows_not_worth is not None and np.array_equal(first_pages, self._rows_not_worth):
            return None
        plan = plan_cascade(indptr, batch.kv_indices_host[:indptr[-1]], self.cascade_max_rows)
        if plan is None or plan.shared_pages < self.min_shared_fraction * indptr[-1]:
            self._rows_not_worth = first_pages.copy() if self.min_shared_fraction > 0 else None
            return None
        self._rows_not_worth = None
        self.num_cascade_steps += 1
        return plan

    def attend(self, layer_id: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer_id], self.kv.v[layer_id]
        store_kv(k_TKD, v_TKD, k_cache, v_cache, self.batch.slot_mapping)
        if self._prefill is not None:
            if self._context is not None:
                return self._context.attend(self._prefill, layer_id, q_THD, k_cache, v_cache)
            return self._prefill.attend(layer_id, q_THD, k_TKD, v_TKD)
        return self.decode(layer_id, q_THD, k_cache, v_cache)

    def fused_kv_target(self, layer_id: int, dtype: torch.dtype):
        """(k_cache, v_cache, slot_mapping) for a decode step whose q/k-norm + RoPE kernel also writes the
        step's K/V (kernels/fused_norm.py kv_cache=; then attend_stored), or None: prefill steps, a cache
        in another dtype, or a backend whose attend() is its own store and attend in attend()."""
        if self.batch is None or self.batch.kind != "decode" or type(self).attend is not AttentionBackend.attend:
            return None
        k_cache, v_cache = self.kv.k[layer_id], self.kv.v[layer_id]
        return (k_cache, v_cache, self.batch.slot_mapping) if k_cache.dtype == dtype else None

    def attend_stored(self, layer_id: int, q_BHD: torch.Tensor) -> torch.Tensor:
        """Decode attention of a step whose K/V a fused kernel already stored (fused_kv_target)."""
        return self.decode(layer_id, q_BHD, self.kv.k[layer_id], self.kv.v[layer_id])

    def decode(self, layer_id: int, q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
