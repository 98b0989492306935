"""LLM: the generation engine's public API (vLLM's names), on the shared model.

    llm = LLM("tiny", max_num_seqs=32)                # or LLM(model) to decode with a live nn.Module
    outs = llm.generate(prompt_token_ids, SamplingParams(n=8, temperature=1.0, max_tokens=64))
    outs[0].outputs[3].token_ids, .token_logprobs, .finish_reason;  outs.trace  # per-step records
    LLM(model=CHECKPOINT_DIR).generate(["Hello, my name is"], params)[0].outputs[0].text   # text in, text out
    LLM("Qwen/Qwen3-0.6B", revision="main")               # a Hugging Face hub id (model/hub.py; a preset wins)
    llm.chat([{"role": "user", "content": "Hi"}], params)    # the checkpoint's chat template

Prompts: list[int] token ids (the trainer's form), a str, or vLLM's {"prompt_token_ids": [...]} /
{"prompt": "..."}. Text needs a tokenizer: a checkpoint directory's own, the built-in one for presets,
or LLM(module, tokenizer=...). Text prompts are encoded with add_special_tokens=True (vLLM's rule),
rendered chats with False (transformers'). Samples of requests that came as text (or ask for text /
stop strings) carry an incremental detokenizer (detokenizer.py); token-id requests pay nothing for it.
A sequence stops at the model config's EOS ids (a checkpoint's config.json + generation_config.json,
model/factory.py) and, when the tokenizer is the checkpoint's or given, at the tokenizer's too.

When given an nn.Module, the engine decodes with that module's own parameters: no copy is
made, so a learner's optimizer step is visible at the next decode step. `weight_version`
is bumped by the learner and stamped on every generated token (policy lag).
Step-level API for streaming RL loops: add_request / step / has_unfinished / abort_request.
engine.step() is the usual three lines: schedule, run (one host read per step), postprocess.
LLM(async_scheduling=True) overlaps the host with the device: step t+1 is scheduled, prepared and
launched before step t's tokens are read (its inputs that step t is still sampling are gathered on
the device), and step t is postprocessed while t+1 runs. A sequence that stops at step t has run
one step too many, whose token is dropped; length limits are known in advance and never overrun.
Opt-in until a GPU run has measured it (it gives nothing on a CPU, where a launch runs to the end).
StepRecord.seconds: in the synchronous engine a step's own wall time; with overlap, the time from
the later of its launch and the previous step's read to its own read, so a run's records still add
up to its wall-clock generation time (the asymmetry fits rely on that).
Engines on one device share one KV pool: LLM(model, kv_pool=other.kv_pool) decodes in the other
engine's cache and blocks (the trainer's eval engine). Pool size: for training, memory_plan's
num_kv_blocks; alone on a GPU 0.8 x the free memory, or what gpu_memory_utilization=u (vLLM's meaning)
leaves of u x the total after what is allocated; on a CPU max_num_seqs x max_model_len, capped at
DEFAULT_CPU_KV_BYTES (256 MiB; ask for more with num_kv_blocks / kv_cache_memory).
vLLM arguments with one possible value here: tensor_parallel_size=1 and trust_remote_code=False (the
model code is rlengine's own, one device); others are refused with the reason.
On a GPU, decode steps replay CUDA graphs per batch bucket (cuda_graph.py) unless enforce_eager=True
or the backend / MoE implementation cannot be captured; `cuda_graphs_off` says why they are off.
On a CPU, cpu_kernels picks how the projections and the LM head run (model/kernel_choice.py): "cache"
(default: timed per shape class at first use, kept per machine in ~/.cache/rlengine), "measure" (no
disk), "torch" / "skinny" (one rule), or a saved table's .json (pinned).
batch_invariant=True (CPU; model/batch_invariant.py) runs one fixed-order kernel per op
instead, so each token's log-prob equals the learner's recomputation bit for bit at any batch size.
shared_prefix_decode: decode attends a GRPO group's shared prompt pages once per group (engine/attention/
cascade.py); None follows the backend's measured choice (AttentionBackend.configure_shared_prefix).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from rlengine.engine.attention import resolve_backend
from rlengine.engine.block_manager import BlockManager, BlockPool
from rlengine.engine.cuda_graph import CudaGraph, DecodeGraphs, unsupported_reason
from rlengine.engine.detokenizer import Detokenizer
from rlengine.engine.kv_cache import KVCache, KVPool, bytes_per_block
from rlengine.engine.llm_args import (DEFAULT_CPU_KV_BYTES, _as_dtype, _build_model, _check_vllm_args,
                                     _progress_bar, _resolve, _tokenizer, batch_invariant_backend,
                                     default_num_blocks)
from rlengine.engine.model_runner import LaunchedStep, ModelRunner, StepOutput
from rlengine.engine.outputs import GenerateResult, Logprob, RequestOutput, RequestState
from rlengine.engine.prompts import Prompt, chat_prompts, parse_prompt, prompt_list
from rlengine.engine.sampler import Sampler
from rlengine.engine.sampling_params import SamplingParams, sample_seed
from rlengine.engine.scheduler import ScheduledBatch, Scheduler
from rlengine.engine.sequence import Sequence, SequenceStatus
from rlengine.engine.step_inputs import StepInputs
from rlengine.model import ops as op_dispatch
from rlengine.model.kernel_choice import configure_from_setting
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.telemetry.nvtx import PhaseRanges
from rlengine.telemetry.records import StepRecord

PENDING = -1  # overlap: token_ids placeholder of a token still being sampled (never a real token id)


@dataclass(slots=True)
class _Launched:
    """A launched step and what its postprocess and record need."""

    step: LaunchedStep
    version: int          # weight version the step samples with
    num_tokens: int       # StepRecord.tokens
    started: float        # perf_counter() when the step() that launched it began


class LLM:
    def __init__(self, model: str | Qwen3ForCausalLM, *, tokenizer: Tokenizer | str | None = None,
                 dtype: str | torch.dtype | None = None, device=None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None, kv_pool: KVPool | None = None,
                 max_model_len: int | None = None, attention_backend: str = "auto", seed: int = 0,
                 moe_impl: str = "auto", record_routing: bool = False, enforce_eager: bool = False,
                 cuda_graph_sizes: list[int] | None = None, async_scheduling: bool = False,
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, cpu_kernels: str = "cache", batch_invariant: bool = False,
                 shared_prefix_decode: bool | None = None, revision: str | None = None):
        _check_vllm_args(tensor_parallel_size, trust_remote_code, gpu_memory_utilization)
        model = _resolve(model, revision)  # a hub id -> its cached snapshot directory (model/hub.py)
        if gpu_memory_utilization is not None and (num_kv_blocks is not None or kv_cache_memory is not None
                                                   or kv_pool is not None):
            raise ValueError("gpu_memory_utilization sizes the KV pool; drop num_kv_blocks / kv_cache_memory / "
                             "kv_pool, or it")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tokenizer, tokenizer_eos = _tokenizer(model, tokenizer)  # before the weights: a bad file fails fast
        self.model = _build_model(model, _as_dtype(dtype, model), device, moe_impl)
        if self.model.device.type == "cpu":  # which CPU kernels run the projections (model/kernel_choice.py)
            configure_from_setting(op_dispatch.KERNELS, cpu_kernels)
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
        if kv_pool is not None and (num_kv_blocks is not None or kv_cache_memory is not None):
            raise ValueError("kv_pool: a shared pool keeps its own size; drop num_kv_blocks / kv_cache_memory")
        self.kv_pool = kv_pool or self._new_kv_pool(num_kv_blocks, kv_cache_memory, max_num_seqs, block_size)
        self._check_pool(self.kv_pool, block_size)
        self.kv_cache = self.kv_pool.cache
        attention_backend = batch_invariant_backend(self.model, batch_invariant, attention_backend)
        backend_cls = resolve_backend(attention_backend, self.device)
        self.backend = backend_cls(self.kv_cache, cfg.num_attention_heads, cfg.head_dim, max_num_seqs)
        self.backend.configure_shared_prefix(shared_prefix_decode)
        max_pages = -(-self.max_model_len // block_size)
        self.block_manager = BlockManager(0, block_size, max_seqs=max_num_seqs, max_pages_per_seq=max_pages,
                                          pool=self.kv_pool.blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens)
        inputs = StepInputs(self.block_manager, self.device, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_pages_per_seq=max_pages,
                            null_block=self.kv_cache.null_block, vocab_size=cfg.vocab_size,
                            overlap=async_scheduling)
        self.runner = ModelRunner(self.model, self.backend, Sampler(self.device, seed, self.model.batch_invariant), self.kv_cache, inputs,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                  record_routing=record_routing and cfg.is_moe)
        self.max_num_seqs, self.block_size = max_num_seqs, block_size
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids if tokenizer_eos else ())
        self.weight_version = 0
        # Optional phase listener (e.g. telemetry.NvmlSampler): set_phase(kind) per step, an attribute write.
        self.phase_listener = None
        # engine.* NVTX / profiler ranges (telemetry/nvtx.py): on for a CUDA device, inert on a CPU
        self.ranges = self.runner.ranges = PhaseRanges.for_device(self.device)
        self._token_text: dict[int, str] = {}  # Logprob.decoded_token cache
        self._stashed: list[RequestOutput] = []  # outputs of other requests that finished inside generate()
        self.trace: list[StepRecord] = []
        self.requests: dict[str, RequestState] = {}
        self._request_ids = itertools.count()
        self.async_scheduling = async_scheduling
        self._in_flight: _Launched | None = None  # overlap: the launched, unread step
        self._last_read = 0.0  # perf_counter() of the last read (step records start no earlier)
        if enforce_eager:
            self.cuda_graphs_off = "enforce_eager=True"
        elif self.device.type != "cuda":
            self.cuda_graphs_off = f"CUDA graphs need a CUDA device, the model is on {self.device}"
        else:
            self.cuda_graphs_off = unsupported_reason(self.model, self.backend)
        if self.cuda_graphs_off is None:
            self._use_decode_graphs(CudaGraph, cuda_graph_sizes)

    def _new_kv_pool(self, num_kv_blocks, kv_cache_memory, max_num_seqs, block_size) -> KVPool:
        per_block = bytes_per_block(self.config, block_size, self.model.dtype)
        if num_kv_blocks is None:
            num_kv_blocks = default_num_blocks(self.device, self.gpu_memory_utilization, self.max_model_len,
                                               kv_cache_memory, per_block, max_num_seqs, block_size)
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        cache = KVCache(self.config, num_kv_blocks, block_size, self.model.dtype, self.device)
        return KVPool(cache, BlockPool(num_kv_blocks))

    def _check_pool(self, pool: KVPool, block_size: int) -> None:
        """A shared pool must be laid out for this model: same block size, dtype, device and K/V shape."""
        c, cfg = pool.cache, self.config
        want = (cfg.num_hidden_layers, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
        got = (c.data.shape[0], c.data.shape[1], c.data.shape[3], c.data.shape[4], c.data.shape[5])
        if got != want or c.data.dtype != self.model.dtype or c.data.device != self.device:
            raise ValueError(f"kv_pool: the cache is [L, 2, P, Hkv, D] = {list(got)} {c.data.dtype} on "
                             f"{c.data.device}, this engine needs {list(want)} {self.model.dtype} on {self.device}")

    def _use_decode_graphs(self, graph_cls: type, sizes: list[int] | None = None) -> DecodeGraphs:
        """Route decode steps that fit a bucket through captured graphs (graph_cls: CudaGraph, or
        cuda_graph.StaticReplay to exercise the same path on a CPU)."""
        self.runner.graphs = DecodeGraphs(
            self.model, self.backend, self.runner.inputs, max_bs=self.max_num_seqs,
            record_routing=self.runner.record_routing, sizes=sizes, graph_cls=graph_cls)
        self.cuda_graphs_off = None
        return self.runner.graphs

    def capture_decode_graphs(self) -> None:
        """Capture every decode bucket now (otherwise each is captured on first use, inside a step)."""
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()

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
                             f"{self.block_manager.num_blocks}; raise num_kv_blocks / kv_cache_memory"
                             + (f" (a CPU pool defaults to at most {DEFAULT_CPU_KV_BYTES >> 20} MiB)"
                                if self.device.type == "cpu" else ""))

    def _check_text(self, params: SamplingParams, text: str | None, where: str) -> bool:
        """Whether the request's samples get a detokenizer (see SamplingParams.detokenize)."""
        wants = params.detokenize if params.detokenize is not None else (text is not None or bool(params.stop))
        if wants and self.tokenizer is None:
            raise ValueError(f"{where}: text output (detokenize / stop strings) needs a tokenizer, and this engine "
                             "has none: pass LLM(model, tokenizer=...)")
        return wants

    def add_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None,
                    *, prompt: str | None = None) -> str:
        """Queue one request (n samples); raises ValueError for bad input without touching other requests.

        prompt_token_ids: token ids, or a {"prompt_token_ids": ...} / {"prompt": text} dict (a bare str is
        refused here). prompt: the text the ids came from (RequestOutput.prompt; turns text output on).
        Sample i of a request with a seed draws with sample_seed(seed, i) (sampling_params.py).
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        where = f"request {request_id}"
        parsed = parse_prompt(prompt_token_ids, self.tokenizer, where, allow_str=False)
        ids, text = parsed.token_ids, parsed.text if prompt is None else prompt
        self._validate(ids, params, where)
        detok = self._check_text(params, text, where)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        seqs = [Sequence(request_id, i, ids, params, stop_ids=stop, max_len=max_len,
                         seed_key=None if params.seed is None else sample_seed(params.seed, i))
                for i in range(params.n)]
        for seq in seqs if detok else ():
            seq.detok = Detokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                                    min_tokens=params.min_tokens)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.runner.top_logprobs_on = True
        if params.has_rules:
            self.runner.rules.on = True
        self.requests[request_id] = RequestState(request_id, ids, seqs, text)
        self.scheduler.add(seqs)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """True while requests run or finished outputs wait to be returned by step()."""
        return self.scheduler.has_work or bool(self._stashed) or self._in_flight is not None

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it.

        Synchronous: schedule, launch (prepare, forward, sampling), read (the step's one host read of
        the sampled tokens, so the device is synced) and postprocess; the step's record times all of
        it. With async_scheduling: schedule and launch the next step, then read and postprocess the
        one launched before it (see the module docstring for what its record times).
        """
        t0 = time.perf_counter()
        stashed, self._stashed = self._stashed, []
        with self.ranges("engine.schedule"):
            batch = self.scheduler.schedule()  # overlap: lengths count the tokens in flight
        prev, self._in_flight = self._in_flight, None
        if batch.seqs:
            launched = self._launch(batch, prev, t0)
            if not self.async_scheduling:
                return stashed + self._complete(launched)
            self._in_flight = launched
        elif prev is None:
            self._check_stall()
            return stashed
        return stashed + (self._complete(prev) if prev is not None else [])

    def _check_stall(self) -> None:
        """Nothing could be scheduled although requests wait: the shared pool's blocks are held elsewhere."""
        sched, bm = self.scheduler, self.block_manager
        if sched.waiting and not sched.running:
            need = bm.blocks_for(len(sched.waiting[0][0]))
            raise RuntimeError(f"KV pool exhausted: the next request needs {need} KV blocks, {bm.num_free} of "
                               f"{bm.num_blocks} are free and this engine holds none; the rest are held by another "
                               "engine sharing the pool (LLM(kv_pool=...)): finish or abort its requests first")

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None, started: float) -> _Launched:
        """Queue the batch on the device. Overlap: each sample gets a PENDING placeholder for its token,
        so the next schedule() sees its length."""
        if self.phase_listener is not None:
            self.phase_listener.set_phase(batch.kind)
        num_tokens = sum(len(s.token_ids) for s in batch.seqs) if batch.kind == "prefill" else len(batch.seqs)
        step = self.runner.launch(batch, None if prev is None else prev.step)
        if self.async_scheduling:
            for seq in batch.samples:
                seq.token_ids.append(PENDING)
        return _Launched(step, self.weight_version, num_tokens, started)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step (the one wait), postprocess it and record it."""
        batch = launched.step.batch
        live = None
        if self.async_scheduling:  # samples preempted or finished since the launch no longer own their rows
            live = np.fromiter((s.row for s in batch.samples), np.int64, len(batch.samples))
            live = live == launched.step.prep.sample_rows
        out = self.runner.read(launched.step, live)
        with self.ranges("engine.postprocess"):
            outputs = self._postprocess(batch, out, launched.version)
        now = time.perf_counter()
        # forked siblings sample from their leader's prefill too
        self.trace.append(StepRecord(batch.kind, len(batch.seqs), launched.num_tokens,
                                     now - max(launched.started, self._last_read),
                                     len(batch.samples) if batch.kind == "prefill" else 0))
        self._last_read = now
        return outputs

    def _postprocess(self, batch: ScheduledBatch, out: StepOutput, version: int) -> list[RequestOutput]:
        """Each sample takes its token (overlap: in place of its placeholder); finished samples leave
        the running set and their blocks return."""
        done: dict[str, RequestState] = {}
        finished, pending = SequenceStatus.FINISHED, PENDING  # locals: this loop runs B times per step
        top = out.top
        if out.prompt is not None:
            self._record_prompt_logprobs(batch, out.prompt)
        for i, (seq, token, logprob) in enumerate(zip(batch.samples, out.tokens, out.logprobs)):
            if seq.status is finished:
                continue  # aborted, or (overlap) stopped at the step before: this token is past its end
            ids = seq.token_ids
            if ids[-1] != pending:
                ids.append(token)
                at = len(ids) - 1
            else:  # overlap: the step launched after this one may have appended a placeholder too
                at = len(ids) - 2 if ids[-2] == pending else len(ids) - 1
                ids[at] = token
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if top is not None and seq.top_logprobs is not None:
                seq.top_logprobs.append(self._logprob_entry(top[0][i], top[1][i], seq.params.logprobs, token,
                                                            logprob, top[2][i], seq.params))
            stop = token in seq.stop_ids
            if seq.detok is not None and (not stop or seq.detok.include_stop):
                # vLLM: a stop token's own text is left out unless include_stop_str_in_output
                if seq.detok.add(token) and not stop:
                    stop, seq.stop_reason = True, seq.detok.stop_reason
            if stop or at + 1 >= seq.max_len:
                del ids[at + 1:]  # overlap: the placeholder of a step launched past the stop
                sp = seq.params
                if stop and seq.stop_reason is None and token in sp.stop_token_ids and (
                        sp.ignore_eos or token not in self.eos_ids):
                    seq.stop_reason = token  # vLLM: a stop_token_ids entry (not an EOS id) is the stop reason
                self.scheduler.finish(seq, "stop" if stop else "length")
                state = self.requests[seq.request_id]
                if state.finished:
                    done[seq.request_id] = state
        if out.routing is not None:
            for seq, rows in zip(batch.samples, out.routing):
                if batch.kind == "prefill":
                    seq.routing_ids = [rows]  # a recompute replaces what the preempted run recorded
                else:
                    seq.routing_ids.append(rows)
        outputs = []
        for rid, state in done.items():
            outputs.append(state.output())
            del self.requests[rid]
        return outputs

    def _decoded(self, token: int, params: SamplingParams) -> str | None:
        if self.tokenizer is None or params.detokenize is False:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _logprob_entry(self, ids: list[int], lps: list[float], k: int, token: int, logprob: float, rank: int,
                       params: SamplingParams) -> dict[int, Logprob]:
        """vLLM's per-position dict: the k most likely tokens (ranks 1..k; filtered-out -inf left out), then the
        chosen token with its own rank."""
        entry = {t: Logprob(lp, r + 1, self._decoded(t, params))
                 for r, (t, lp) in enumerate(zip(ids[:k], lps[:k])) if lp != float("-inf")}
        if token not in entry:
            entry[token] = Logprob(logprob, rank, self._decoded(token, params))
        return entry

    def _record_prompt_logprobs(self, batch: ScheduledBatch, prompt: dict) -> None:
        """RequestState.prompt_logprobs of the prefilled sequences the runner scored: [None, {...}, ...]."""
        for r, (ids, lps, tok_lps, ranks) in prompt.items():
            seq = batch.seqs[r]
            state = self.requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is not None:
                continue
            p = seq.params
            state.prompt_logprobs = [None] + [
                self._logprob_entry(ids[j], lps[j], p.prompt_logprobs, t, tok_lps[j], ranks[j], p)
                for j, t in enumerate(seq.token_ids[1:seq.num_prompt_tokens])]

    # ---- batch API ---------------------------------------------------------------------------
    def cpu_kernels(self) -> dict | None:
        """The CPU kernel choices so far ({mode, cache, table}; model/kernel_choice.py), None on a GPU;
        "batch_invariant" in batch-invariant mode (one fixed kernel per op, no choice)."""
        if self.model.batch_invariant:
            return "batch_invariant"
        return op_dispatch.KERNELS.summary() if self.device.type == "cpu" else None

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (rlengine.model.tokenizer.Tokenizer: encode, decode, apply_chat_template,
        eos_token_ids; `.hf` is the tokenizers.Tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("get_tokenizer: this engine has none (it was built from an nn.Module); pass "
                             "LLM(model, tokenizer=Tokenizer or checkpoint directory)")
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> GenerateResult:
        """Generate for every prompt; returns RequestOutputs in prompt order (+ .trace, .stats).

        prompts: a list of prompts, each token ids (list[int]), a str, {"prompt_token_ids": [...]} or
        {"prompt": str}; or one str / dict. All prompts are validated before any is queued: a bad one
        raises ValueError naming its index and leaves the engine (and requests already in flight) untouched.
        use_tqdm: a progress bar over the finished prompts (True, or a tqdm-like callable).
        """
        items = [parse_prompt(p, self.tokenizer, f"prompt {i}") for i, p in enumerate(prompt_list(prompts))]
        return self._generate(items, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             use_tqdm: bool = False) -> GenerateResult:
        """Generate replies to one conversation ([{"role", "content"}, ...]) or a list of them, rendered with
        the tokenizer's chat template (Tokenizer.apply_chat_template; chat_template_kwargs are extra template
        variables, chat_template a template name or source, tools JSON schemas for templates that take them).
        RequestOutput.prompt is the rendered text."""
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        items = chat_prompts(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                             chat_template=chat_template, kwargs=kwargs)
        return self._generate(items, sampling_params, use_tqdm)

    def _generate(self, items: list[Prompt], sampling_params, use_tqdm=False) -> GenerateResult:
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(items)
        if len(plist) != len(items):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(items)} prompts")
        for i, (item, p) in enumerate(zip(items, plist)):
            self._validate(item.token_ids, p, f"prompt {i}")
            self._check_text(p, item.text, f"prompt {i}")
        trace_start, preempt_start = len(self.trace), self.scheduler.num_preemptions
        recompute_start = self.scheduler.num_recomputed_tokens
        ids = [self.add_request(item.token_ids, p, prompt=item.text) for item, p in zip(items, plist)]
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        others: list[RequestOutput] = []
        bar = _progress_bar(use_tqdm, len(ids))
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    finished[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
                else:  # a request added with add_request(): handed out by the next step()
                    others.append(out)
        if bar is not None:
            bar.close()
        self._stashed.extend(others)
        stats = {"preemptions": self.scheduler.num_preemptions - preempt_start,
                 "recomputed_tokens": self.scheduler.num_recomputed_tokens - recompute_start}
        return GenerateResult([finished[i] for i in ids], self.trace[trace_start:], stats)
