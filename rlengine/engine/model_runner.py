"""ModelRunner: runs one ScheduledBatch through the shared model and samples; one host read per step.

launch() = prepare (step_inputs.StepInputs: the step's inputs from the persistent per-row state,
one non_blocking copy to the device), copy-on-write block copies, the attention backend's plan(),
the forward (eager, or a CUDA-graph replay when `graphs` is set and the decode batch fits a
bucket: both read the same input buffers), the LM head on each sequence's last token, the sampler
(with the step's penalties / min_tokens / min_p from sampling_rules.RuleState, when a row has one),
and the packing of the sampled tokens, their log-probs and (when recorded) the MoE routing ids into
one int32 buffer whose copy to the host is queued behind them. read() waits for that copy: the
step's ONE device-to-host read (a logprobs request's top-k and ranks come packed in a second buffer
copied before the same event; a prefill with prompt_logprobs reads those after it); nothing else in a decode step reads the device
(tests/engine/test_host_reads.py counts it, tests/gpu/test_engine_sync_and_backends_gpu.py runs under sync-debug mode).
A graph decode step without rules or top-logprobs runs head, sampler and packing inside the graph
(cuda_graph.py): around the replay the host issues only the staging upload and the output copy.
run() = read(launch()). With overlap (LLM(async_scheduling=True)) the LLM launches step t+1 before
reading step t: inputs whose token step t is still sampling are gathered on the device from step
t's token tensor, and the output buffers alternate so step t+1 cannot overwrite step t's.
Dimension legend: T tokens in the step, B sequences, N samples, V vocab, L MoE layers, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from rlengine.engine.attention import AttentionBackend
from rlengine.engine.kv_cache import KVCache
from rlengine.engine.sampler import Sampler, log_softmax, top_logprobs
from rlengine.engine.sampling_rules import RuleState
from rlengine.engine.scheduler import ScheduledBatch
from rlengine.engine.step_inputs import PreparedStep, StepInputs
from rlengine.model.moe import engine_routing, recorded_routing
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.telemetry.nvtx import PhaseRanges


@dataclass(slots=True)
class StepOutput:
    """One step's results on the host, in batch.samples order (from the step's one device read)."""

    tokens: list[int]                     # [N] sampled token ids
    logprobs: list[float]                 # [N] their log-probs (SamplingParams.logprobs_mode)
    routing: list[np.ndarray] | None      # [N] expert ids [tokens of the sample's row, L, K] int32, or None
    top: tuple[list, list, list] | None = None  # logprobs: ([N][k] top ids, [N][k] log-probs, [N] ranks), or None
    prompt: dict | None = None            # prompt_logprobs: batch.seqs index -> (top ids [L-1][k], top
    #                                       log-probs [L-1][k], prompt-token log-probs [L-1], ranks [L-1])


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels and output copy are queued; read() returns its StepOutput."""

    step_id: int                          # launch counter
    batch: ScheduledBatch
    prep: PreparedStep
    tokens: torch.Tensor                  # [N] int64 sampled tokens on the device (the next step's inputs)
    slot: int                             # output buffer it packed into
    n: int                                # int32 words packed: 2N + routing
    ids_shape: tuple[int, ...] | None     # [T, L, K] of the routing ids, or None
    event: torch.cuda.Event | None        # recorded after the output copy (GPU)
    launched_at: float                    # perf_counter() at launch
    top_k: int | None = None              # logprobs: k of the records packed in the slot's top buffer, or None
    lp_at: int | None = None              # word offset of the log-probs in the slot (None: N; a graph's: bs)
    prompt: dict | None = None            # prompt_logprobs: batch.seqs index -> 4 tensors (StepOutput.prompt)


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, backend: AttentionBackend, sampler: Sampler, kv_cache: KVCache,
                 inputs: StepInputs, *, max_num_seqs: int, max_num_batched_tokens: int, record_routing: bool = False):
        self.model, self.backend, self.sampler, self.kv_cache = model, backend, sampler, kv_cache
        self.inputs = inputs
        self.device = model.device
        self.record_routing = record_routing
        self.moe_blocks = model.moe_blocks()
        self.graphs = None  # cuda_graph.DecodeGraphs, set by the LLM when decode graphs are on
        # set by the LLM once a request asks for logprobs / prompt_logprobs; until then no step looks at them
        self.top_logprobs_on = False
        self.rules = RuleState(self.device, model.config.vocab_size)  # penalties, min_tokens, min_p
        self.ranges = PhaseRanges()  # engine.prepare / forward / sample ranges (the LLM shares its own)
        # The packed output buffer: tokens [N] | log-prob bits [N] | routing ids [T, L, K], int32; two
        # slots under overlap (step t+1 packs while step t's copy may still be unread).
        cfg = model.config
        routing = max_num_batched_tokens * len(self.moe_blocks) * cfg.num_experts_per_tok if record_routing else 0
        self._words = 2 * max_num_seqs + routing
        slots = 2 if inputs.overlap else 1
        cuda = self.device.type == "cuda"
        self.out_dev = torch.zeros(slots * self._words, dtype=torch.int32, device=self.device)
        self.out_host = torch.zeros(slots * self._words, dtype=torch.int32, pin_memory=True) if cuda else self.out_dev
        self._out_host_np = self.out_host.numpy()
        self._events = [torch.cuda.Event() for _ in range(slots)] if cuda else None
        self._launches = 0
        # logprobs records per slot: top ids [N, k] | top log-prob bits [N, k] | ranks [N], int32; sized at
        # first use and grown when a step needs more (a slot is only resized once its last step was read)
        self._top_dev: list[torch.Tensor | None] = [None] * slots
        self._top_host: list[torch.Tensor | None] = [None] * slots
        self._top_host_np: list[np.ndarray | None] = [None] * slots

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Forward + sample one step and read its outputs (the step's one host read)."""
        return self.read(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step: inputs, forward, sampling and the copy of its outputs to the host; no host read.

        prev: the step still in flight (overlap), whose sampled tokens some of this step's inputs are.
        """
        B = len(batch.seqs)
        bs = self.graphs.bucket(B) if batch.kind == "decode" and self.graphs is not None else None
        prev_step = None if prev is None else prev.step_id
        with self.ranges("engine.prepare"):
            prep = self.inputs.prepare(batch, pad_to=bs, prev_step=prev_step)
            rules = self.rules.for_step(batch.samples, prep.sample_rows, batch.kind == "prefill")
            ks = [s.params.logprobs for s in batch.samples if s.params.logprobs is not None] \
                if self.top_logprobs_on else ()
            key = None
            if bs is not None:
                sb = prep.sb
                in_graph = rules is None and not ks  # head + sampler inside the graph
                key = self.graphs.key(bs, prep.fb.max_num_pages,
                                      (sb.kinds_any, sb.kinds_all, sb.max_top_k) if in_graph else None)
                if not self.graphs.has(bs, key):  # first use: capture rewrites the buffers, so prepare again
                    self.graphs.capture(bs, key, self.sampler)
                    prep = self.inputs.prepare(batch, pad_to=bs, prev_step=prev_step)
            fb = prep.fb
            if prep.prev_index is not None:  # tokens step `prev` is sampling: gathered on the device
                pi = prep.prev_index
                ids = fb.input_ids[:B]
                ids.copy_(torch.where(pi >= 0, prev.tokens[pi.clamp(min=0)], ids))
            if prep.copies is not None:
                self.kv_cache.copy_blocks(*prep.copies)
            if bs is None:
                self.backend.plan(fb)
        prompt = None
        with self.ranges("engine.forward"):
            if bs is not None:
                out = self.graphs.replay(bs, fb, key)
                ids_TLK = None if out.ids is None else out.ids[:B]
                if out.packed is not None:  # head and sampler ran inside the graph
                    step = self._queue_graph_outputs(batch, prep, out, bs, ids_TLK)
                    self.inputs.launched(prep, step.step_id if self.inputs.overlap else None)
                    return step
                hidden_TC = out.hidden[:B]
            else:
                engine_routing(self.moe_blocks, self.record_routing)
                # a prefill samples one row a sequence: the last layer's o_proj and MLP run on those rows only,
                # unless every row is wanted (prompt log-probs, routing replay records every token's experts)
                rows = (fb.logits_indices if fb.logits_indices is not None and not self.top_logprobs_on
                        and not self.record_routing else None)
                hidden_TC = self.model.hidden_states(fb.input_ids, fb.positions, self.backend, fast=True, rows=rows)
                ids_TLK = recorded_routing(self.moe_blocks) if self.record_routing else None
                prompt = self._prompt_logprobs(batch, fb, hidden_TC) if self.top_logprobs_on else None
                if fb.logits_indices is not None and rows is None:
                    hidden_TC = hidden_TC[fb.logits_indices]
            logits_NV = self.model.compute_logits(hidden_TC)
        with self.ranges("engine.sample"):
            if prep.sb.logits_rows is not None:  # prefill: every member of a group samples its leader's row
                logits_NV = logits_NV[prep.sb.logits_rows]
            top = None
            if ks:
                tokens_N, logprobs_N, *top = self.sampler.sample_with_top(logits_NV, prep.sb, max(ks), rules)
            else:
                tokens_N, logprobs_N = self.sampler(logits_NV, prep.sb, rules)
            if rules is not None:
                rules.count(tokens_N)
            step = self._queue_outputs(batch, prep, tokens_N, logprobs_N, ids_TLK, top)
            step.prompt = prompt
        self.inputs.launched(prep, step.step_id if self.inputs.overlap else None)
        return step

    def _queue_outputs(self, batch, prep, tokens_N: torch.Tensor, logprobs_N: torch.Tensor,
                       ids_TLK: torch.Tensor | None, top: list[torch.Tensor] | None = None) -> LaunchedStep:
        """Pack tokens, log-prob bits and routing ids into one int32 buffer (and a logprobs step's top ids
        [N, k], top log-probs [N, k] and ranks [N] into the slot's top buffer); queue the copies to pinned
        memory, both before the slot's event."""
        N = tokens_N.shape[0]
        n = 2 * N + (ids_TLK.numel() if ids_TLK is not None else 0)
        slot = self._launches % (self.out_dev.numel() // self._words)
        base = slot * self._words
        out = self.out_dev[base:base + n]
        out[:N].copy_(tokens_N)
        out[N:2 * N].view(torch.float32).copy_(logprobs_N)
        if ids_TLK is not None:
            out[2 * N:].view(ids_TLK.shape).copy_(ids_TLK)
        k = None if top is None else top[0].shape[1]
        if top is not None:
            self._pack_top(slot, *top)
        event = None
        if self._events is not None:
            self.out_host[base:base + n].copy_(out, non_blocking=True)
            if top is not None:
                m = N * (2 * k + 1)
                self._top_host[slot][:m].copy_(self._top_dev[slot][:m], non_blocking=True)
            event = self._events[slot]
            event.record()
        self._launches += 1
        return LaunchedStep(self._launches, batch, prep, tokens_N, slot, n,
                            None if ids_TLK is None else tuple(ids_TLK.shape), event, time.perf_counter(), top_k=k)

    def _queue_graph_outputs(self, batch, prep, out, bs: int, ids_TLK: torch.Tensor | None) -> LaunchedStep:
        """A graph that sampled: its packed tokens | log-prob bits [2 * bs] go to the slot as they are (one
        copy: to pinned memory on a GPU); with routing ids, through _queue_outputs."""
        N = prep.sb.num_samples
        if ids_TLK is not None:
            return self._queue_outputs(batch, prep, out.tokens[:N], out.packed[bs:bs + N].view(torch.float32), ids_TLK)
        slot = self._launches % (self.out_dev.numel() // self._words)
        base = slot * self._words
        event = None
        if self._events is not None:
            self.out_host[base:base + 2 * bs].copy_(out.packed, non_blocking=True)
            event = self._events[slot]
            event.record()
        else:
            self.out_dev[base:base + 2 * bs].copy_(out.packed)
        self._launches += 1
        return LaunchedStep(self._launches, batch, prep, out.tokens[:N], slot, 2 * bs, None, event,
                            time.perf_counter(), lp_at=bs)

    def _pack_top(self, slot: int, ids_Nk: torch.Tensor, lp_Nk: torch.Tensor, rank_N: torch.Tensor) -> None:
        """Top ids [N, k] int64, log-probs [N, k] fp32 and ranks [N] int64 -> the slot's int32 top buffer."""
        N, k = ids_Nk.shape
        m = N * (2 * k + 1)
        if self._top_dev[slot] is None or self._top_dev[slot].numel() < m:
            size = max(m, self._words)
            self._top_dev[slot] = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._top_host[slot] = (torch.zeros(size, dtype=torch.int32, pin_memory=True)
                                    if self._events is not None else self._top_dev[slot])
            self._top_host_np[slot] = self._top_host[slot].numpy()
        buf = self._top_dev[slot]
        buf[:N * k].view(N, k).copy_(ids_Nk)
        buf[N * k:2 * N * k].view(torch.float32).view(N, k).copy_(lp_Nk)
        buf[2 * N * k:m].copy_(rank_N)

    def read(self, step: LaunchedStep, live: np.ndarray | None = None) -> StepOutput:
        """Wait for a launched step's outputs (the one host read) -> StepOutput; rows take their tokens
        (only the `live` samples [N] bool under overlap: the others left their rows meanwhile)."""
        tokens, logprobs, ids = self._read_outputs(step)
        self.inputs.tokens_read(step.prep, tokens, live)
        top = self._read_top(step)
        prompt = None if step.prompt is None else {r: tuple(t.tolist() for t in v) for r, v in step.prompt.items()}
        return StepOutput(tokens.tolist(), logprobs.tolist(), self._routing_per_sample(step.batch, step.prep, ids),
                          top, prompt)

    def _read_top(self, step: LaunchedStep) -> tuple[list, list, list] | None:
        """The logprobs records of a step whose outputs were read (its event covers their copy): ([N][k] top
        ids, [N][k] top log-probs, [N] ranks) from the slot's pinned top buffer; no device read."""
        if step.top_k is None:
            return None
        N, k = step.prep.sb.num_samples, step.top_k
        host = self._top_host_np[step.slot]
        return (host[:N * k].reshape(N, k).tolist(), host[N * k:2 * N * k].view(np.float32).reshape(N, k).tolist(),
                host[2 * N * k:N * (2 * k + 1)].tolist())

    def _prompt_logprobs(self, batch: ScheduledBatch, fb, hidden_TC: torch.Tensor) -> dict | None:
        """prompt_logprobs of the prefilled sequences that ask for them and have no output yet (a recompute
        already reported them): per sequence, position j < L - 1 scores prompt token j + 1 under
        log_softmax(logits_j / T) (T = 1 for greedy)."""
        if batch.kind != "prefill":
            return None
        out = {}
        for r, seq in enumerate(batch.seqs):
            p = seq.params
            if p.prompt_logprobs is None or len(seq.token_ids) != seq.num_prompt_tokens:
                continue
            a, L = fb.qo_indptr[r], seq.num_prompt_tokens
            z_LV = self.model.compute_logits(hidden_TC[a:a + L - 1]).float()
            if not p.greedy:
                z_LV = z_LV / torch.full((L - 1, 1), p.temperature, dtype=torch.float32, device=z_LV.device)
            targets = torch.tensor(seq.token_ids[1:L], dtype=torch.int64, device=z_LV.device)
            out[r] = top_logprobs(log_softmax(z_LV, self.sampler.invariant), targets, p.prompt_logprobs)
        return out or None

    def _read_outputs(self, step: LaunchedStep):
        """The step's one device-to-host read: wait for the queued copy. Returns host numpy views (valid
        until the slot is reused): tokens [N] int32, log-probs [N] fp32, routing ids [T, L, K] or None."""
        if step.event is not None:
            step.event.synchronize()
        N = step.prep.sb.num_samples
        base = step.slot * self._words
        host = self._out_host_np[base:base + step.n]
        ids = host[2 * N:].reshape(step.ids_shape) if step.ids_shape is not None else None
        at = N if step.lp_at is None else step.lp_at
        return host[:N], host[at:at + N].view(np.float32), ids

    @staticmethod
    def _routing_per_sample(batch: ScheduledBatch, prep: PreparedStep,
                            ids_TLK: np.ndarray | None) -> list[np.ndarray] | None:
        """Each sample's routing rows (a copy: the host buffer is reused): its leader's prompt tokens
        (prefill) or its one input token (decode)."""
        if ids_TLK is None:
            return None
        ids_TLK = ids_TLK.copy()
        if batch.kind == "decode":
            return [ids_TLK[i:i + 1] for i in range(len(batch.samples))]
        qo = prep.fb.qo_indptr
        return [ids_TLK[qo[r]:qo[r + 1]] for r in batch.sample_rows]
