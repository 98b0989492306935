"""EngineCore: the step loop behind LLM, built from an EngineSpec.

    schedule -> launch (prepare, forward, sample) -> read -> process outputs -> record

EngineCore owns what an engine is made of, built from its spec alone: the KV pool (its own, or one
shared with another engine on the device), the attention backend, the block manager, the scheduler,
the step inputs' staging buffer, the model runner and the decode CUDA graphs. LLM (llm.py) keeps the
API: it turns vLLM's keywords into the spec, prompts into sequences, and hands finished requests
back. Output handling (tokens, stops, text, log-prob objects) is output_processor.py's.
Async scheduling (spec.async_scheduling): step t+1 is scheduled, prepared and launched before step
t's tokens are read; each sample gets a PENDING placeholder so the next schedule sees its length.
Every step appends a StepRecord (kind, B_act, tokens, seconds, context): the trace the asymmetry fits and
the device clock read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from rlengine.engine.attention import resolve_backend
from rlengine.engine.block_manager import BlockManager, BlockPool
from rlengine.engine.cuda_graph import CudaGraph, DecodeGraphs, unsupported_reason
from rlengine.engine.kv_cache import KVCache, KVPool, bytes_per_block
from rlengine.engine.llm_args import batch_invariant_backend, default_num_blocks
from rlengine.engine.model_runner import LaunchedStep, ModelRunner
from rlengine.engine.output_processor import PENDING, OutputProcessor
from rlengine.engine.outputs import RequestOutput
from rlengine.engine.sampler import Sampler
from rlengine.engine.scheduler import ScheduledBatch, Scheduler
from rlengine.engine.spec import EngineSpec
from rlengine.engine.step_inputs import StepInputs
from rlengine.model import fused_decode
from rlengine.model import ops as op_dispatch
from rlengine.model.kernel_choice import configure_from_setting
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.telemetry.nvtx import PhaseRanges
from rlengine.telemetry.records import StepRecord


@dataclass(slots=True)
class _Launched:
    """A launched step and what its output processing and record need."""

    step: LaunchedStep
    version: int          # weight version the step samples with
    num_tokens: int       # StepRecord.tokens
    started: float        # perf_counter() when the step() that launched it began


class EngineCore:
    def __init__(self, model: Qwen3ForCausalLM, spec: EngineSpec, outputs: OutputProcessor, *,
                 kv_pool: KVPool | None = None):
        """spec: resolved (resolve_engine_spec: max_model_len and max_num_batched_tokens set)."""
        self.model, self.spec, self.outputs = model, spec, outputs
        self.config, self.device = model.config, model.device
        if self.device.type == "cpu":  # which CPU kernels run the projections (model/kernel_choice.py)
            configure_from_setting(op_dispatch.KERNELS, spec.cpu_kernels)
        self.kv_pool = kv_pool or self._new_kv_pool()
        self._check_pool(self.kv_pool)
        self.kv_cache = self.kv_pool.cache
        cfg, B = self.config, spec.max_num_seqs
        backend_cls = resolve_backend(batch_invariant_backend(model, spec.batch_invariant, spec.attention_backend),
                                      self.device)
        self.backend = backend_cls(self.kv_cache, cfg.num_attention_heads, cfg.head_dim, B)
        self.backend.configure_shared_prefix(spec.shared_prefix_decode)
        self.backend.decode_kernels = spec.decode_kernels  # the model's decode layer path (model/fused_decode.py)
        if spec.decode_kernels == "fused" and self.device.type == "cuda":
            fused_decode.prepare(model.model)  # its split-K workspace, before any graph capture
        max_pages = -(-spec.max_model_len // spec.block_size)
        self.block_manager = BlockManager(0, spec.block_size, max_seqs=B, max_pages_per_seq=max_pages,
                                          pool=self.kv_pool.blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=B, max_num_batched_tokens=spec.max_num_batched_tokens)
        inputs = StepInputs(self.block_manager, self.device, max_num_seqs=B,
                            max_num_batched_tokens=spec.max_num_batched_tokens, max_pages_per_seq=max_pages,
                            null_block=self.kv_cache.null_block, vocab_size=cfg.vocab_size,
                            overlap=spec.async_scheduling)
        self.runner = ModelRunner(model, self.backend, Sampler(self.device, spec.seed, model.batch_invariant),
                                  self.kv_cache, inputs, max_num_seqs=B,
                                  max_num_batched_tokens=spec.max_num_batched_tokens,
                                  record_routing=spec.record_routing and cfg.is_moe)
        self.weight_version = 0
        self.phase_listener = None  # e.g. telemetry.NvmlSampler: set_phase(kind) per step, an attribute write
        # engine.* NVTX / profiler ranges (telemetry/nvtx.py): on for a CUDA device, inert on a CPU
        self.ranges = self.runner.ranges = PhaseRanges.for_device(self.device)
        self.trace: list[StepRecord] = []
        self.in_flight: _Launched | None = None  # async: the launched, unread step
        self._last_read = 0.0  # perf_counter() of the last read (step records start no earlier)
        if spec.enforce_eager:
            self.cuda_graphs_off = "enforce_eager=True"
        elif self.device.type != "cuda":
            self.cuda_graphs_off = f"CUDA graphs need a CUDA device, the model is on {self.device}"
        else:
            self.cuda_graphs_off = unsupported_reason(model, self.backend)
        if self.cuda_graphs_off is None:
            self.use_decode_graphs(CudaGraph, list(spec.cuda_graph_sizes) if spec.cuda_graph_sizes else None)

    # ---- what the spec builds --------------------------------------------------------------
    def _new_kv_pool(self) -> KVPool:
        s = self.spec
        per_block = bytes_per_block(self.config, s.block_size, self.model.dtype)
        num = s.num_kv_blocks
        if num is None:
            num = default_num_blocks(self.device, s.gpu_memory_utilization, s.max_model_len, s.kv_cache_memory,
                                     per_block, s.max_num_seqs, s.block_size)
        if num < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num}")
        return KVPool(KVCache(self.config, num, s.block_size, self.model.dtype, self.device), BlockPool(num))

    def _check_pool(self, pool: KVPool) -> None:
        """A shared pool must be laid out for this model: same block size, dtype, device and K/V shape."""
        c, cfg = pool.cache, self.config
        want = (cfg.num_hidden_layers, 2, self.spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
        got = (c.data.shape[0], c.data.shape[1], c.data.shape[3], c.data.shape[4], c.data.shape[5])
        if got != want or c.data.dtype != self.model.dtype or c.data.device != self.device:
            raise ValueError(f"kv_pool: the cache is [L, 2, P, Hkv, D] = {list(got)} {c.data.dtype} on "
                             f"{c.data.device}, this engine needs {list(want)} {self.model.dtype} on {self.device}")

    def use_decode_graphs(self, graph_cls: type, sizes: list[int] | None = None) -> DecodeGraphs:
        """Route decode steps that fit a bucket through captured graphs (graph_cls: CudaGraph, or
        cuda_graph.StaticReplay to exercise the same path on a CPU)."""
        self.runner.graphs = DecodeGraphs(
            self.model, self.backend, self.runner.inputs, max_bs=self.spec.max_num_seqs,
            record_routing=self.runner.record_routing, sizes=sizes, graph_cls=graph_cls)
        self.cuda_graphs_off = None
        return self.runner.graphs

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it.

        Synchronous: schedule, launch, read (the step's one host read of the sampled tokens) and process
        the outputs; the step's record times all of it. Async: schedule and launch the next step, then
        read and process the one launched before it."""
        t0 = time.perf_counter()
        with self.ranges("engine.schedule"):
            batch = self.scheduler.schedule()  # async: lengths count the tokens in flight
        prev, self.in_flight = self.in_flight, None
        if batch.seqs:
            launched = self._launch(batch, prev, t0)
            if not self.spec.async_scheduling:
                return self._complete(launched)
            self.in_flight = launched
        elif prev is None:
            self._check_stall()
            return []
        return self._complete(prev) if prev is not None else []

    def _check_stall(self) -> None:
        """Nothing could be scheduled although requests wait: the shared pool's blocks are held elsewhere."""
        sched, bm = self.scheduler, self.block_manager
        # parked trajectories hold blocks until their caller continues or ends them: not a stall
        if sched.waiting and not sched.running and not any(s.block_table for s in (*sched.parked, *sched.resuming)):
            need = bm.blocks_for(len(sched.waiting[0][0]))
            raise RuntimeError(f"KV pool exhausted: the next request needs {need} KV blocks, {bm.num_free} of "
                               f"{bm.num_blocks} are free and this engine holds none; the rest are held by another "
                               "engine sharing the pool (LLM(kv_pool=...)): finish or abort its requests first")

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None, started: float) -> _Launched:
        """Queue the batch on the device; async: each sample gets a PENDING placeholder for its token."""
        if self.phase_listener is not None:
            self.phase_listener.set_phase(batch.kind)
        num_tokens = len(batch.seqs)
        if batch.kind == "prefill":  # a trajectory's chunk counts only its new tokens (its history is cached)
            num_tokens = sum(len(s.token_ids) for s in batch.seqs) - sum(batch.starts or ())
        step = self.runner.launch(batch, None if prev is None else prev.step)
        if self.spec.async_scheduling:
            for seq in batch.samples:
                seq.token_ids.append(PENDING)
        return _Launched(step, self.weight_version, num_tokens, started)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step (the one wait), process its outputs and record it."""
        batch = launched.step.batch
        live = None
        if self.spec.async_scheduling:  # samples preempted or finished since the launch no longer own their rows
            live = np.fromiter((s.row for s in batch.samples), np.int64, len(batch.samples))
            live = live == launched.step.prep.sample_rows
        out = self.runner.read(launched.step, live)
        with self.ranges("engine.postprocess"):
            outputs = self.outputs.process(batch, out, launched.version)
        now = time.perf_counter()
        b = len(batch.seqs)
        if batch.kind == "prefill":  # the device clock costs a prefill by its tokens
            context = launched.num_tokens
        else:  # mean tokens attended: the prepared step's [B] host context lengths (one numpy sum)
            context = int(launched.step.prep.fb.context_lens[:b].sum()) // max(b, 1)
        # forked siblings sample from their leader's prefill too
        self.trace.append(StepRecord(batch.kind, b, launched.num_tokens, now - max(launched.started, self._last_read),
                                     len(batch.samples) if batch.kind == "prefill" else 0, context))
        self._last_read = now
        return outputs
