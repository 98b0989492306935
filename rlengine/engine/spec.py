"""EngineSpec: what one engine will run, resolved from LLM's keywords (or the job's plan) once.

LLM(model, **vLLM keywords) resolves them with resolve_engine_spec against the built model (its
max_position_embeddings gives max_model_len, that gives max_num_batched_tokens) and hands the spec
to EngineCore (core.py), which builds the KV pool, attention backend, scheduler, step inputs, model
runner and decode graphs from it and nothing else. The trainer's plan stage builds the same record
for its rollout and eval engines (rlengine/plan/job.py) and calls LLM.from_spec. The spec is frozen:
a reader can tell from it alone what an engine does; the choices made later by measurement (CPU
kernels, the shared-prefix default, graphs that cannot be captured) are reported by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine's sizes, kernels and modes."""

    max_num_seqs: int = 64                 # B_gen: sequences in flight
    max_num_batched_tokens: int | None = None  # tokens per step; None: max(max_model_len, 2048)
    block_size: int = 16                   # P tokens per KV page
    num_kv_blocks: int | None = None       # the pool's blocks (None: kv_cache_memory, or sized from the device)
    kv_cache_memory: int | None = None     # bytes for the pool (None: see num_kv_blocks)
    gpu_memory_utilization: float | None = None  # vLLM's meaning: this engine's share of the device
    max_model_len: int | None = None       # prompt + response; None: the model's max_position_embeddings
    attention_backend: str = "auto"        # auto | torch | cpp | triton | flashinfer | invariant
    seed: int = 0                          # the sampler's seed for requests without one
    moe_impl: str = "auto"                 # ref | triton | auto (a model the engine builds); a plan records invariant
    record_routing: bool = False           # MoE: record expert ids for replay in the learner
    enforce_eager: bool = False            # no decode CUDA graphs
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode graph buckets (None: the default ladder)
    async_scheduling: bool | None = None   # overlap the host's step t+1 with the device's step t (None: on CUDA)
    cpu_kernels: str = "cache"             # measure | cache | torch | skinny | a saved table's .json
    batch_invariant: bool = False          # one fixed-order kernel per op (bitwise learner = engine)
    shared_prefix_decode: bool | None = None  # None: the backend's measured default
    decode_kernels: str = "torch"          # torch | fused: the GPU decode layer path (model/fused_decode.py)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs (B_gen) must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        from rlengine.model.fused_decode import check_decode_kernels

        check_decode_kernels(self.decode_kernels)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


def resolve_engine_spec(spec: EngineSpec, max_position_embeddings: int, *, shared_pool: bool,
                        device: torch.device | None = None) -> EngineSpec:
    """spec with max_model_len, max_num_batched_tokens and async_scheduling (None: on for a CUDA device,
    where the host's work then hides behind the device's) made concrete for a model on `device`, checked
    (ValueError); shared_pool: the engine reads another engine's KV pool, which keeps its own size."""
    from dataclasses import replace

    max_model_len = spec.max_model_len or max_position_embeddings
    if not 2 <= max_model_len <= max_position_embeddings:
        raise ValueError(f"max_model_len must be in [2, max_position_embeddings={max_position_embeddings}], "
                         f"got {max_model_len}")
    tokens = spec.max_num_batched_tokens or max(max_model_len, 2048)
    if tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_model_len "
                         f"({max_model_len}): a preempted sequence is recomputed in one prefill step")
    if shared_pool and (spec.num_kv_blocks is not None or spec.kv_cache_memory is not None):
        raise ValueError("kv_pool: a shared pool keeps its own size; drop num_kv_blocks / kv_cache_memory")
    overlap = spec.async_scheduling
    if overlap is None:
        overlap = device is not None and torch.device(device).type == "cuda"
    return replace(spec, max_model_len=max_model_len, max_num_batched_tokens=tokens, async_scheduling=overlap)
