"""Decode steps replayed from CUDA graphs, one graph per padded batch-size bucket.

At small B_act a decode step is mostly kernel-launch and Python overhead (docs/METHOD.md: decode is
latency-bound there), so the engine captures the model forward of a decode step once per
batch bucket and replays it. The contract of a captured step:

- Inputs live in fixed buffers: a bucket's ForwardBatch is StepInputs.static_batch(bs), views of
  the runner's device input buffer at the offsets a decode step padded to bs always uses, so the
  step's ordinary prepare(batch, pad_to=bs) (the same one eager steps use) writes them.
- A batch of B sequences runs in the smallest bucket >= B. Rows B..bucket-1 are padding: token
  0 at position 0, one page (the cache's null block) of one token, so their K/V writes land in
  the null block and touch no sequence's cache.
- The attention backend's plan() runs outside the graph, before every replay, on the bucket's
  static ForwardBatch. Its host fields context_lens / max_num_pages are capture-time placeholders
  (the host page tables kv_indptr_host / kv_last_page_len_host are live, for FlashInfer's plan),
  so only a backend whose decode reads nothing but device tensors may be captured (`graph_safe`).
- Graphs per bucket are keyed by GraphKey: a page bound (a context class: the attention backend
  plans its KV splits from the bound, so a short context runs one split and no merge launch, and a
  long one the splits the SMs need; AttentionBackend.graph_page_bounds) and, when the step samples in
  the graph, the sampler's host flags. A step runs in the graph of the smallest bound >= its longest
  sequence's pages.
- With a sampler (the runner's plain steps: no penalties / min_p / min_tokens, no top-logprobs) the
  graph runs the LM head and the sampler over all bs rows and packs tokens and log-prob bits into an
  int32 buffer [2 * bs] (the runner copies it to the host as is); padding rows sample greedily
  (step_inputs writes neutral sampling rows) and are dropped. Otherwise the graph ends at the final
  norm's hidden states [bs, C] and the runner runs head and sampler eagerly on the B real rows.
  MoE routing ids (when recorded) are graph outputs too. Unseeded rows draw from the sampler's
  generator, registered with the capture (the same distribution as eager, not the same numbers when
  B < bs: the graph draws bs rows); seeded rows give the same tokens as eager.
- Weights are captured by address: in-place updates (optimizer steps, load_state_dict) are
  seen by the next replay; rebinding a parameter's .data is not.

- A capture rewrites the staging buffers (fill_padding): it first waits for the device, since under
  overlap (LLM(async_scheduling=True)) the step in flight may still be copying its inputs from them.

StaticReplay is the CPU stand-in for torch.cuda.CUDAGraph with the same contract (replay reads
only the fixed buffers and the capture-time batch), so the bucketing, padding and buffer logic
is tested on machines without a GPU; only the capture itself needs CUDA.
Dimension legend: B sequences in the step, bs bucket size, C hidden, V vocab, L MoE layers, K top-k.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from rlengine.engine.attention import AttentionBackend
from rlengine.engine.step_inputs import StepInputs
from rlengine.model.moe import engine_routing, recorded_routing
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.engine.forward_batch import ForwardBatch, SamplingBatch



@dataclasses.dataclass(frozen=True, slots=True)
class GraphKey:
    """Which graph of a bucket a step replays."""

    pages: int                          # page bound: the backend plans its splits from it
    sampling: tuple[int, int, int] | None = None  # (kinds_any, kinds_all, max_top_k) when head + sampler run inside


@dataclasses.dataclass(slots=True)
class GraphOutput:
    """A captured decode step's outputs (fixed buffers, overwritten by the next replay of the graph)."""

    hidden: torch.Tensor | None = None  # [bs, C] final-norm hidden states (graphs without the sampler)
    tokens: torch.Tensor | None = None  # [bs] int64 sampled tokens (graphs with the sampler)
    packed: torch.Tensor | None = None  # [2 * bs] int32: tokens | log-prob fp32 bits (graphs with the sampler)
    ids: torch.Tensor | None = None     # [bs, L, K] MoE routing ids, or None


def bucket_sizes(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8, then max_bs itself (as vLLM)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return sizes + [max_bs]


class CudaGraph:
    """One captured decode step on the current CUDA stream, in a memory pool shared by all buckets."""

    @staticmethod
    def wait_device() -> None:
        """Wait for all queued work (before a capture rewrites the staging buffers a queued copy reads)."""
        torch.cuda.synchronize()

    def __init__(self, pool, generators: tuple = ()):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        # a non-default generator drawn from inside the graph must be registered, so each replay
        # advances its Philox offset (torch >= 2.5; untested on a device here)
        for gen in generators:
            self.graph.register_generator_state(gen)
        self.out: GraphOutput | None = None

    def capture(self, fn: Callable[[], GraphOutput]) -> None:
        fn()  # warm-up outside the graph: Triton JIT, cuBLAS workspaces, lazy allocations
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()
        torch.cuda.synchronize()

    def replay(self) -> GraphOutput:
        self.graph.replay()
        return self.out


class StaticReplay:
    """CPU stand-in for CudaGraph: replay() re-runs the captured function on the fixed buffers.

    Like a CUDA graph it sees the step only through the buffers fill() wrote and the batch
    object planned at capture, so a host value that leaked into decode would show up as wrong
    tokens in the tests. It cannot detect a host sync inside the captured region: only a real
    capture does (tests/gpu/test_model_and_engine_gpu.py).
    """

    @staticmethod
    def wait_device() -> None:
        """Nothing is queued on a CPU: every launch has run to its end."""

    def __init__(self, pool=None, generators: tuple = ()):
        self.fn: Callable[[], GraphOutput] | None = None
        self.out: GraphOutput | None = None

    def capture(self, fn: Callable[[], GraphOutput]) -> None:
        self.fn = fn
        self.out = fn()

    def replay(self) -> GraphOutput:
        self.out = self.fn()
        return self.out


def unsupported_reason(model: Qwen3ForCausalLM, backend: AttentionBackend) -> str | None:
    """Why decode steps of this model and backend cannot be captured, or None if they can."""
    if not backend.graph_safe:
        return f"the {backend.name} attention backend is not graph-safe (its decode reads host values)"
    ref = [b for b in model.moe_blocks() if b.impl == "ref"]
    if ref:
        return ("the MoE experts run the plain-torch reference (moe_impl='ref'), which syncs with the host; "
                "use moe_impl='triton'")
    return None


class DecodeGraphs:
    """Per-bucket captured decode forwards over the runner's input buffers; captured lazily on first use."""

    def __init__(self, model: Qwen3ForCausalLM, backend: AttentionBackend, inputs: StepInputs, *,
                 max_bs: int, record_routing: bool = False, sizes: list[int] | None = None,
                 graph_cls: type = CudaGraph):
        reason = unsupported_reason(model, backend)
        if reason:
            raise ValueError(f"decode CUDA graphs: {reason}")
        self.sizes = sorted(set(sizes)) if sizes else bucket_sizes(max_bs)
        if self.sizes[0] < 1 or self.sizes[-1] > max_bs:
            raise ValueError(f"decode CUDA graph sizes must lie in [1, max_num_seqs={max_bs}], got {self.sizes}")
        self.model, self.backend, self.inputs = model, backend, inputs
        self.record_routing = record_routing
        self.moe_blocks = model.moe_blocks()
        self.graph_cls = graph_cls
        self.pool = torch.cuda.graph_pool_handle() if graph_cls is CudaGraph else None
        # bucket -> GraphKey -> captured graph, and the batch each was captured (and is planned) with
        self.graphs: dict[int, dict[GraphKey, object]] = {}
        self.batches: dict[tuple[int, GraphKey], ForwardBatch] = {}
        self.num_replays = 0

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size >= batch_size, or None if the batch is larger than every bucket."""
        for bs in self.sizes:
            if bs >= batch_size:
                return bs
        return None

    def key(self, bs: int, num_pages: int, sampling: tuple[int, int, int] | None = None) -> GraphKey:
        """The GraphKey of a step in bucket bs whose longest sequence holds num_pages pages."""
        bounds = self.backend.graph_page_bounds(bs, self.inputs.max_pages)
        return GraphKey(next((b for b in bounds if b >= num_pages), bounds[-1]), sampling)

    def has(self, bs: int, key: GraphKey) -> bool:
        return key in self.graphs.get(bs, {})

    def _forward(self, fb: ForwardBatch, sampler=None, sb=None, packed=None) -> GraphOutput:
        hidden_TC = self.model.hidden_states(fb.input_ids, fb.positions, self.backend, fast=True)
        ids = recorded_routing(self.moe_blocks) if self.record_routing else None
        if sampler is None:
            return GraphOutput(hidden=hidden_TC, ids=ids)
        tokens_B, logprobs_B = sampler(self.model.compute_logits(hidden_TC), sb)
        bs = tokens_B.shape[0]
        packed[:bs].copy_(tokens_B)
        packed[bs:].view(torch.float32).copy_(logprobs_B)
        return GraphOutput(tokens=tokens_B, packed=packed, ids=ids)

    @torch.inference_mode()
    def capture(self, bs: int, key: GraphKey | None = None, sampler=None) -> None:
        """Capture the decode step of bucket bs and key (default: the capacity bound, no sampler) on buffers
        holding padding rows only. key.sampling set: head and sampler inside (sampler: the runner's)."""
        key = key or GraphKey(self.inputs.max_pages)
        if self.has(bs, key):
            return
        # Under overlap the step in flight may still be copying its inputs from the pinned staging slot
        # fill_padding rewrites: wait for it first (a capture synchronizes anyway, so this costs nothing).
        self.graph_cls.wait_device()
        self.inputs.fill_padding(bs)
        fb = dataclasses.replace(self.inputs.static_batch(bs), max_num_pages=key.pages)
        engine_routing(self.moe_blocks, self.record_routing)
        self.backend.plan(fb)
        args, gens = (), ()
        if key.sampling is not None:
            v = self.inputs.bucket_views(bs)
            any_, all_, max_top_k = key.sampling
            sb = SamplingBatch(num_samples=bs, logits_rows=None, temperature=v["temperature"], top_k=v["top_k"],
                               top_p=v["top_p"], seed_keys=v["seed_keys"], kind=v["kind"], kinds_any=any_,
                               kinds_all=all_, max_top_k=max_top_k)
            packed = torch.zeros(2 * bs, dtype=torch.int32, device=fb.input_ids.device)
            args, gens = (sampler, sb, packed), (sampler.generator,)
        graph = self.graph_cls(self.pool, gens)
        graph.capture(lambda: self._forward(fb, *args))
        self.graphs.setdefault(bs, {})[key] = graph
        self.batches[bs, key] = fb

    def capture_all(self) -> None:
        """Capture every bucket (capacity bound, head outside), largest first (smaller graphs reuse the pool)."""
        for bs in reversed(self.sizes):
            self.capture(bs)

    def replay(self, bs: int, prepared: ForwardBatch, key: GraphKey | None = None) -> GraphOutput:
        """Replay graph `key` of bucket bs on what prepare(batch, pad_to=bs) wrote (`prepared`, its batch).
        The graph must be captured (capture() rewrites the buffers, so the runner captures before preparing).
        plan() sees the captured batch with the prepared batch's live host page tables."""
        key = key or GraphKey(self.inputs.max_pages)
        engine_routing(self.moe_blocks, self.record_routing)  # read again only by StaticReplay
        self.backend.plan(dataclasses.replace(self.batches[bs, key], kv_indptr_host=prepared.kv_indptr_host,
                                              kv_last_page_len_host=prepared.kv_last_page_len_host))
        out = self.graphs[bs][key].replay()
        self.num_replays += 1
        return out
