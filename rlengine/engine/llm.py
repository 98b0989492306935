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
Step-level API for streaming RL loops: add_request / step / has_unfinished / abort_request; for
multi-turn trajectories add_request(multi_turn=True) / take_turns / continue_turn / end_trajectory
(turns.py: a paused trajectory keeps its KV, an observation is prefilled on top of it).
LLM is the API: its keywords become an EngineSpec (spec.py) and an EngineCore (core.py) runs the
loop, schedule -> launch -> read -> process outputs (output_processor.py: stops, text, log-probs).
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
decode_kernels (GPU): "torch" (default until a GPU run measures fused faster) or "fused", the six-launch
decode layer of model/fused_decode.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from rlengine.engine.core import EngineCore
from rlengine.engine.detokenizer import Detokenizer
from rlengine.engine.kv_cache import KVPool
from rlengine.engine.llm_args import (DEFAULT_CPU_KV_BYTES, _as_dtype, _build_model, _check_vllm_args,
                                     _progress_bar, _resolve, _tokenizer)
from rlengine.engine.output_processor import OutputProcessor
from rlengine.engine.outputs import GenerateResult, RequestOutput, RequestState
from rlengine.engine.prompts import Prompt, chat_prompts, parse_prompt, prompt_list
from rlengine.engine.sampling_params import SamplingParams, sample_seed
from rlengine.engine.sequence import Sequence
from rlengine.engine.spec import EngineSpec, resolve_engine_spec
from rlengine.engine import turns
from rlengine.model import ops as op_dispatch
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.lora_peft import load_lora
from rlengine.model.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str | Qwen3ForCausalLM, *, tokenizer: Tokenizer | str | None = None,
                 dtype: str | torch.dtype | None = None, device=None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None, kv_pool: KVPool | None = None,
                 max_model_len: int | None = None, attention_backend: str = "auto", seed: int = 0,
                 moe_impl: str = "auto", record_routing: bool = False, enforce_eager: bool = False,
                 cuda_graph_sizes: list[int] | None = None, async_scheduling: bool | None = None,
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, cpu_kernels: str = "cache", batch_invariant: bool = False,
                 shared_prefix_decode: bool | None = None, revision: str | None = None, lora_path: str | None = None,
                 decode_kernels: str = "torch"):
        _check_vllm_args(tensor_parallel_size, trust_remote_code)
        spec = EngineSpec(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          attention_backend=attention_backend, seed=seed, moe_impl=moe_impl,
                          record_routing=record_routing, enforce_eager=enforce_eager,
                          cuda_graph_sizes=tuple(cuda_graph_sizes) if cuda_graph_sizes else None,
                          async_scheduling=async_scheduling, cpu_kernels=cpu_kernels, batch_invariant=batch_invariant,
                          shared_prefix_decode=shared_prefix_decode, decode_kernels=decode_kernels)
        model = _resolve(model, revision)  # a hub id -> its cached snapshot directory (model/hub.py)
        if gpu_memory_utilization is not None and (num_kv_blocks is not None or kv_cache_memory is not None
                                                   or kv_pool is not None):
            raise ValueError("gpu_memory_utilization sizes the KV pool; drop num_kv_blocks / kv_cache_memory / "
                             "kv_pool, or it")
        self.tokenizer, tokenizer_eos = _tokenizer(model, tokenizer)  # before the weights: a bad file fails fast
        self.model = _build_model(model, _as_dtype(dtype, model), device, moe_impl)
        if lora_path:  # a PEFT adapter directory, decoded unmerged on these weights (model/lora_peft.py)
            load_lora(self.model, lora_path, base=str(model))
        self.config, self.device = self.model.config, self.model.device
        self.spec = resolve_engine_spec(spec, self.config.max_position_embeddings, shared_pool=kv_pool is not None,
                                        device=self.device)
        self.eos_ids = frozenset(self.config.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids if tokenizer_eos else ())
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, finish=self._finish)
        self.core = EngineCore(self.model, self.spec, self.outputs, kv_pool=kv_pool)
        self.outputs.pause = self.core.scheduler.pause
        # the core's parts, under the names vLLM-style code and the tests use
        c = self.core
        self.kv_pool, self.kv_cache, self.backend, self.block_manager = c.kv_pool, c.kv_cache, c.backend, c.block_manager
        self.scheduler, self.runner, self.trace = c.scheduler, c.runner, c.trace
        self._stashed: list[RequestOutput] = []  # outputs of other requests that finished inside generate()
        self._request_ids = itertools.count()

    @classmethod
    def from_spec(cls, model: Qwen3ForCausalLM, spec: EngineSpec, *, tokenizer: Tokenizer | str | None = None,
                  kv_pool: KVPool | None = None) -> "LLM":
        """An engine over a live module from a spec the caller resolved (the trainer's plan)."""
        kw = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        kw["cuda_graph_sizes"] = list(spec.cuda_graph_sizes) if spec.cuda_graph_sizes else None
        return cls(model, tokenizer=tokenizer, kv_pool=kv_pool, **kw)

    # ---- what the spec resolved, and the core's state ----------------------------------------
    max_num_seqs = property(lambda self: self.spec.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.spec.max_num_batched_tokens)
    max_model_len = property(lambda self: self.spec.max_model_len)
    block_size = property(lambda self: self.spec.block_size)
    async_scheduling = property(lambda self: self.spec.async_scheduling)
    gpu_memory_utilization = property(lambda self: self.spec.gpu_memory_utilization)
    requests = property(lambda self: self.outputs.requests)
    cuda_graphs_off = property(lambda self: self.core.cuda_graphs_off)
    _in_flight = property(lambda self: self.core.in_flight)

    @property
    def weight_version(self) -> int:
        """The policy version stamped on every sampled token; the learner bumps it after an update."""
        return self.core.weight_version

    @weight_version.setter
    def weight_version(self, v: int) -> None:
        self.core.weight_version = v

    @property
    def ranges(self):
        """The engine.* NVTX / profiler ranges (telemetry/nvtx.py) the core's steps open."""
        return self.core.ranges

    @ranges.setter
    def ranges(self, ranges) -> None:
        self.core.ranges = ranges

    @property
    def phase_listener(self):
        """Optional phase listener (e.g. telemetry.NvmlSampler): set_phase(kind) per step."""
        return self.core.phase_listener

    @phase_listener.setter
    def phase_listener(self, listener) -> None:
        self.core.phase_listener = listener

    def _finish(self, seq, reason: str) -> None:
        self.scheduler.finish(seq, reason)

    def _use_decode_graphs(self, graph_cls: type, sizes: list[int] | None = None):
        return self.core.use_decode_graphs(graph_cls, sizes)

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
                    *, prompt: str | None = None, multi_turn: bool = False) -> str:
        """Queue one request (n samples); raises ValueError for bad input without touching other requests.

        prompt_token_ids: token ids, or a {"prompt_token_ids": ...} / {"prompt": text} dict (a bare str is
        refused here). prompt: the text the ids came from (RequestOutput.prompt; turns text output on).
        Sample i of a request with a seed draws with sample_seed(seed, i) (sampling_params.py).
        multi_turn: each sample is a trajectory (turns.py): a stop pauses it for continue_turn / end_trajectory.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        where = f"request {request_id}"
        parsed = parse_prompt(prompt_token_ids, self.tokenizer, where, allow_str=False)
        ids, text = parsed.token_ids, parsed.text if prompt is None else prompt
        self._validate(ids, params, where)
        detok = self._check_text(params, text, where)
        if multi_turn:
            turns.check_multi_turn(params, detok, where)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        seqs = [Sequence(request_id, i, ids, params, stop_ids=stop, max_len=max_len,
                         seed_key=None if params.seed is None else sample_seed(params.seed, i))
                for i in range(params.n)]
        for seq in seqs:
            seq.multi_turn = multi_turn
        for seq in seqs if detok else ():
            seq.detok = Detokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                                    min_tokens=params.min_tokens)
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.runner.top_logprobs_on = True
        if params.has_rules:
            self.runner.rules.on = True
        self.outputs.requests[request_id] = RequestState(request_id, ids, seqs, text)
        self.scheduler.add(seqs)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    def take_turns(self) -> list[turns.TurnOutput]:
        """The model turns of trajectories that ended since the last call (each now waits, holding its KV)."""
        return turns.take_turns(self.outputs, self.max_model_len)

    def continue_turn(self, request_id: str, index: int, observation: list[int], max_tokens: int) -> None:
        """Append `observation` token ids to a waiting trajectory; it resumes decoding (up to max_tokens) after
        one chunk prefill of the observation on top of its cached history. ValueError leaves it waiting."""
        where = f"continue_turn {request_id!r}/{index}"
        seq = turns.paused_sequence(self.requests, request_id, index, where)
        bm = self.block_manager
        turns.append_observation(seq, observation, max_tokens, vocab_size=self.config.vocab_size,
                                 max_model_len=self.max_model_len, max_blocks=bm.num_blocks,
                                 blocks_for=bm.blocks_for, where=where)
        self.scheduler.resume(seq)

    def end_trajectory(self, request_id: str, index: int, reason: str = "stop") -> None:
        """A waiting trajectory is done: its blocks return; once all of its request's are, step() hands out
        the RequestOutput (token_ids: every generated and observation token, token_logprobs the model's)."""
        seq = turns.paused_sequence(self.requests, request_id, index, f"end_trajectory {request_id!r}/{index}")
        self.scheduler.finish(seq, reason)
        state = self.requests[request_id]
        if state.finished:
            self._stashed.append(state.output())
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        """True while requests run or finished outputs wait to be returned by step()."""
        return self.core.has_work or bool(self._stashed)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step (EngineCore.step); returns the requests that finished in it, and those
        that finished inside an earlier generate() call that was waiting for its own."""
        stashed, self._stashed = self._stashed, []
        return stashed + self.core.step()

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
