"""LLM: the generation engine's public API (vLLM's names), on the shared model.

    llm = LLM("tiny", max_num_seqs=32)                # or LLM(model) to decode with a live nn.Module
    outs = llm.generate(prompt_token_ids, SamplingParams(n=8, temperature=1.0, max_tokens=64))
    outs[0].outputs[3].token_ids, .logprobs, .finish_reason;  outs.trace  # per-step records

When given an nn.Module, the engine decodes with that module's own parameters: no copy is
made, so a learner's optimizer step is visible at the next decode step. `weight_version`
is bumped by the learner and stamped on every generated token (policy lag).
Step-level API for streaming RL loops: add_request / step / has_unfinished / abort_request.
engine.step() is the usual three lines: schedule, run, postprocess.
On a GPU, decode steps replay CUDA graphs captured per batch bucket (cuda_graph.py) unless
enforce_eager=True or the backend / MoE implementation cannot be captured; `cuda_graphs_off`
says why they are off.
"""

from __future__ import annotations

import itertools
import operator
import time

import torch

from rlengine.config import DTYPES
from rlengine.engine.attention import resolve_backend
from rlengine.engine.block_manager import BlockManager
from rlengine.engine.cuda_graph import CudaGraph, DecodeGraphs, unsupported_reason
from rlengine.engine.kv_cache import KVCache, bytes_per_block
from rlengine.engine.model_runner import ModelRunner
from rlengine.engine.outputs import GenerateResult, RequestOutput, RequestState
from rlengine.engine.sampler import Sampler
from rlengine.engine.sampling_params import SamplingParams
from rlengine.engine.scheduler import Scheduler
from rlengine.engine.sequence import Sequence
from rlengine.model.factory import build_model
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.telemetry.records import StepRecord

DEFAULT_CPU_KV_BYTES = 2 * 2**30


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _build_model(model, dtype, device, moe_impl) -> Qwen3ForCausalLM:
    if isinstance(model, Qwen3ForCausalLM):
        return model  # shared weights: never copied, never moved
    return build_model(str(model), dtype=dtype or torch.float32, device=device, moe_impl=moe_impl)


def _token_ids(prompt, where: str) -> list[int]:
    """A prompt as a list of Python ints (lists, tuples, 1-D int tensors, numpy ints accepted)."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"{where}: token ids must be integers (a list[int]), got a {type(prompt).__name__}")
    ids = []
    for t in prompt:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"{where}: token ids must be integers, got {type(t).__name__} {t!r}") from None
    return ids


class LLM:
    def __init__(self, model: str | Qwen3ForCausalLM, *, dtype: str | torch.dtype | None = None, device=None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 max_model_len: int | None = None, attention_backend: str = "auto", seed: int = 0,
                 moe_impl: str = "ref", record_routing: bool = False, enforce_eager: bool = False,
                 cuda_graph_sizes: list[int] | None = None):
        self.model = _build_model(model, _as_dtype(dtype), device, moe_impl)
        cfg = self.model.config
        self.config = cfg
        self.device = self.model.device
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs (B_gen) must be >= 1, got {max_num_seqs}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not 2 <= self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, max_position_embeddings={cfg.max_position_embeddings}], "
                             f"got {self.max_model_len}")
        self.max_num_batched_tokens = max_num_batched_tokens or max(self.max_model_len, 2048)
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}): a preempted sequence is recomputed in one prefill step")
        kv_dtype = self.model.dtype
        per_block = bytes_per_block(cfg, block_size, kv_dtype)
        if num_kv_blocks is None:
            num_kv_blocks = self._default_num_blocks(kv_cache_memory, per_block, max_num_seqs, block_size)
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        self.kv_cache = KVCache(cfg, num_kv_blocks, block_size, kv_dtype, self.device)
        backend_cls = resolve_backend(attention_backend, self.device)
        self.backend = backend_cls(self.kv_cache, cfg.num_attention_heads, cfg.head_dim, max_num_seqs)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.backend, Sampler(self.device, seed), block_size,
                                  record_routing and cfg.is_moe)
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        self.eos_ids = set(cfg.eos_token_ids)
        self.weight_version = 0
        # Optional phase listener (e.g. telemetry.NvmlSampler): set_phase(kind) per step, an attribute write.
        self.phase_listener = None
        self._stashed: list[RequestOutput] = []  # outputs of other requests that finished inside generate()
        self.trace: list[StepRecord] = []
        self.requests: dict[str, RequestState] = {}
        self._request_ids = itertools.count()
        if enforce_eager:
            self.cuda_graphs_off = "enforce_eager=True"
        elif self.device.type != "cuda":
            self.cuda_graphs_off = f"CUDA graphs need a CUDA device, the model is on {self.device}"
        else:
            self.cuda_graphs_off = unsupported_reason(self.model, self.backend)
        if self.cuda_graphs_off is None:
            self._use_decode_graphs(CudaGraph, cuda_graph_sizes)

    def _use_decode_graphs(self, graph_cls: type, sizes: list[int] | None = None) -> DecodeGraphs:
        """Route decode steps that fit a bucket through captured graphs (graph_cls: CudaGraph, or
        cuda_graph.StaticReplay to exercise the same path on a CPU)."""
        self.runner.graphs = DecodeGraphs(
            self.model, self.backend, self.kv_cache, max_bs=self.max_num_seqs,
            max_pages_per_seq=-(-self.max_model_len // self.block_size), record_routing=self.runner.record_routing,
            sizes=sizes, graph_cls=graph_cls)
        self.cuda_graphs_off = None
        return self.runner.graphs

    def capture_decode_graphs(self) -> None:
        """Capture every decode bucket now (otherwise each is captured on first use, inside a step)."""
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()

    def _default_num_blocks(self, budget, per_block, max_num_seqs, block_size) -> int:
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        if budget is None:
            need = max_num_seqs * -(-self.max_model_len // block_size)
            return max(1, min(need, DEFAULT_CPU_KV_BYTES // per_block))
        return budget // per_block

    @property
    def attention_backend(self) -> str:
        return self.backend.name

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- requests ------------------------------------------------------------------------
    def _validate(self, prompt: list[int], params: SamplingParams, where: str) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"{where}: the prompt is empty (at least one token is needed)")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"{where}: prompt of {len(prompt)} tokens leaves no room to generate "
                             f"(max_model_len={self.max_model_len})")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids outside [0, vocab_size={self.config.vocab_size}): {bad[:5]}")
        if params.n > self.max_num_seqs:
            raise ValueError(f"{where}: n={params.n} samples exceed max_num_seqs={self.max_num_seqs} "
                             f"(a request's samples are admitted together)")
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_for(longest) > self.block_manager.num_blocks:
            raise ValueError(f"{where}: one sample may reach {longest} tokens = "
                             f"{self.block_manager.blocks_for(longest)} KV blocks, but the cache has only "
                             f"{self.block_manager.num_blocks}; raise num_kv_blocks / kv_cache_memory")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request (n samples); raises ValueError for bad input without touching other requests."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        prompt = _token_ids(prompt_token_ids, f"request {request_id}")
        self._validate(prompt, params, f"request {request_id}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seqs.append(Sequence(request_id, i, prompt, params, gen))
        seqs[0].fork_children = seqs[1:]
        self.requests[request_id] = RequestState(request_id, prompt, seqs)
        self.scheduler.add(seqs[0])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """True while requests run or finished outputs wait to be returned by step()."""
        return self.scheduler.has_work or bool(self._stashed)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it.

        The step's record times all of it: schedule, copy-on-write, forward + sampling (which
        ends with a host read of the tokens, so the device is synced) and postprocess.
        """
        t0 = time.perf_counter()
        stashed, self._stashed = self._stashed, []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return stashed
        if self.phase_listener is not None:
            self.phase_listener.set_phase(batch.kind)
        self.kv_cache.copy_blocks(batch.copies)
        seqs, tokens, logprobs = self.runner.run(batch)
        prefill = batch.kind == "prefill"
        b_act = len(batch.seqs)
        num_tokens = sum(len(s) for s in batch.seqs) if prefill else b_act
        outputs = stashed + self._postprocess(batch, seqs, tokens, logprobs)
        # forked siblings sample from their leader's prefill too
        self.trace.append(StepRecord(batch.kind, b_act, num_tokens, time.perf_counter() - t0,
                                     len(seqs) if prefill else 0))
        return outputs

    def _postprocess(self, batch, seqs, tokens, logprobs) -> list[RequestOutput]:
        if batch.kind == "prefill":
            for leader in batch.seqs:
                self.scheduler.after_prefill(leader, leader.fork_children)
                leader.fork_children = []
        done: dict[str, RequestState] = {}
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.num_cached_tokens = len(seq)
            seq.append(token, logprob, self.weight_version)
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                state = self.requests[seq.request_id]
                if state.finished:
                    done[seq.request_id] = state
        outputs = []
        for rid, state in done.items():
            outputs.append(state.output())
            del self.requests[rid]
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    # ---- batch API ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> GenerateResult:
        """Generate for every prompt; returns RequestOutputs in prompt order (+ .trace, .stats).

        All prompts are validated before any is queued: a bad one raises ValueError naming its
        index and leaves the engine (and requests already in flight) untouched.
        """
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            raise TypeError("generate() takes a list of prompts (list[list[int]]), got a single flat list")
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(plist) != len(prompt_token_ids):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompt_token_ids)} prompts")
        for i, (prompt, p) in enumerate(zip(prompt_token_ids, plist)):
            self._validate(_token_ids(prompt, f"prompt {i}"), p, f"prompt {i}")
        trace_start, preempt_start = len(self.trace), self.scheduler.num_preemptions
        recompute_start = self.scheduler.num_recomputed_tokens
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompt_token_ids, plist)]
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        others: list[RequestOutput] = []
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    finished[out.request_id] = out
                    pending.discard(out.request_id)
                else:  # a request added with add_request(): handed out by the next step()
                    others.append(out)
        self._stashed.extend(others)
        stats = {"preemptions": self.scheduler.num_preemptions - preempt_start,
                 "recomputed_tokens": self.scheduler.num_recomputed_tokens - recompute_start}
        return GenerateResult([finished[i] for i in ids], self.trace[trace_start:], stats)
