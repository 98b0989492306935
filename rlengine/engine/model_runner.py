"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the shared model, samples.

prepare() builds input_ids / positions / slot_mapping and the FlashInfer-style page tables
on the host and moves them to the device once; the attention backend plan()s on them once;
the model forward then calls backend.attend() per layer. Only the last token of each
sequence reaches the LM head. A prefill leader with forked siblings gets one logits row per
sibling (the same row), each sampled with its own generator. With `graphs` set (a
cuda_graph.DecodeGraphs), decode steps that fit a bucket replay a captured forward instead.
Dimension legend: T tokens in the step, B sequences, V vocab.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention import AttentionBackend
from rlengine.engine.sampler import Sampler
from rlengine.engine.scheduler import ScheduledBatch
from rlengine.engine.sequence import Sequence
from rlengine.model.moe import engine_routing, recorded_routing
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.types import ForwardBatch


def decode_tokens(seqs: list[Sequence], P: int) -> tuple[list[int], list[int], list[int]]:
    """A decode step's inputs: each sequence's last token, its position and the KV slot it writes."""
    ids = [seq.token_ids[-1] for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    slots = [seq.block_table[pos // P] * P + pos % P for seq, pos in zip(seqs, positions)]
    return ids, positions, slots


def page_tables(seqs: list[Sequence], P: int) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer CSR page tables of `seqs` at their current lengths: indptr [B+1], indices, last_page_len [B]."""
    indptr, indices, last_len = [0], [], []
    for seq in seqs:
        n = len(seq)
        pages = (n + P - 1) // P
        indices.extend(seq.block_table[:pages])
        indptr.append(len(indices))
        last_len.append(n - (pages - 1) * P)
    return indptr, indices, last_len


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, backend: AttentionBackend, sampler: Sampler, block_size: int,
                 record_routing: bool = False):
        self.model, self.backend, self.sampler = model, backend, sampler
        self.block_size = block_size
        self.device = model.device
        self.record_routing = record_routing
        self.moe_blocks = model.moe_blocks()
        self.graphs = None  # cuda_graph.DecodeGraphs, set by the LLM when decode graphs are on

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """Host-side step metadata -> one ForwardBatch on the device.

        Built with plain Python lists, then packed into two host tensors (int64: ids, positions,
        slots, logits rows; int32: page tables) whose views are the batch's fields: two tensor
        builds and two device copies per step.
        """
        P = self.block_size
        decode = batch.kind == "decode"
        if decode:
            ids, positions, slots = decode_tokens(batch.seqs, P)
            qo_indptr = list(range(len(ids) + 1))
        else:
            ids, positions, slots, qo_indptr = [], [], [], [0]
            for seq in batch.seqs:
                n, table = len(seq), seq.block_table
                ids.extend(seq.token_ids)
                positions.extend(range(n))
                slots.extend(table[pos // P] * P + pos % P for pos in range(n))
                qo_indptr.append(len(ids))
        indptr, indices, last_len = page_tables(batch.seqs, P)
        ctx = [len(seq) for seq in batch.seqs]
        T, B = len(ids), len(ctx)
        logits_rows = qo_indptr[1:] if not decode else []  # decode: every row is a last token
        i64 = torch.tensor(ids + positions + slots + [i - 1 for i in logits_rows], dtype=torch.int64)
        i32 = torch.tensor(indptr + last_len + indices, dtype=torch.int32)
        if self.device.type != "cpu":
            i64, i32 = i64.to(self.device, non_blocking=True), i32.to(self.device, non_blocking=True)
        return ForwardBatch(
            kind=batch.kind, input_ids=i64[:T], positions=i64[T:2 * T], slot_mapping=i64[2 * T:3 * T],
            qo_indptr=qo_indptr, kv_indptr=i32[:B + 1], kv_indices=i32[2 * B + 1:],
            kv_last_page_len=i32[B + 1:2 * B + 1], context_lens=ctx,
            logits_indices=i64[3 * T:] if not decode else None,
            max_num_pages=max(b - a for a, b in zip(indptr, indptr[1:])),
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward + sample. Returns the sequences that receive a token (siblings included), tokens, log-probs."""
        replayed = self.graphs.run(batch.seqs) if batch.kind == "decode" and self.graphs is not None else None
        if replayed is not None:
            hidden_BC, ids_BLK = replayed
            logits_BV = self.model.compute_logits(hidden_BC)
            if ids_BLK is not None:
                self._store_routing(batch, ids_BLK.cpu(), list(range(len(batch.seqs) + 1)))
            return batch.seqs, *self.sampler(logits_BV, batch.seqs)
        fb = self.prepare(batch)
        self.backend.plan(fb)
        engine_routing(self.moe_blocks, self.record_routing)
        hidden_TC = self.model.hidden_states(fb.input_ids, fb.positions, self.backend, fast=True)
        if fb.logits_indices is not None:
            hidden_TC = hidden_TC[fb.logits_indices]
        logits_BV = self.model.compute_logits(hidden_TC)
        if self.record_routing:
            self._store_routing(batch, recorded_routing(self.moe_blocks).cpu(), fb.qo_indptr)
        if batch.kind == "decode":
            return batch.seqs, *self.sampler(logits_BV, batch.seqs)
        rows, seqs = [], []
        for i, seq in enumerate(batch.seqs):
            group = [seq] + seq.fork_children
            rows.extend([i] * len(group))
            seqs.extend(group)
        if len(rows) != len(batch.seqs):
            logits_BV = logits_BV[torch.tensor(rows, device=logits_BV.device)]
        tokens, logprobs = self.sampler(logits_BV, seqs)
        return seqs, tokens, logprobs

    @staticmethod
    def _store_routing(batch: ScheduledBatch, ids_TLK: torch.Tensor, qo_indptr: list[int]) -> None:
        """Keep the expert ids [tokens, L_moe, K] each sequence's input tokens were routed to."""
        for i, seq in enumerate(batch.seqs):
            rows = ids_TLK[qo_indptr[i]:qo_indptr[i + 1]]
            if batch.kind == "prefill":
                seq.routing_ids = [rows]
                for child in seq.fork_children:
                    child.routing_ids = [rows]
            else:
                seq.routing_ids.append(rows)
