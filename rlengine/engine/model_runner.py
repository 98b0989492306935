"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the shared model, samples.

prepare() builds input_ids / positions / slot_mapping and the FlashInfer-style page tables
on the host and moves them to the device once; the attention backend plan()s on them once;
the model forward then calls backend.attend() per layer. Only the last token of each
sequence reaches the LM head. A prefill leader with forked siblings gets one logits row per
sibling (the same row), each sampled with its own generator.
Dimension legend: T tokens in the step, B sequences, V vocab.
"""

from __future__ import annotations

import torch

from rlengine.engine.attention import AttentionBackend
from rlengine.engine.sampler import Sampler
from rlengine.engine.scheduler import ScheduledBatch
from rlengine.engine.sequence import Sequence
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.types import ForwardBatch


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, backend: AttentionBackend, sampler: Sampler, block_size: int,
                 record_routing: bool = False):
        self.model, self.backend, self.sampler = model, backend, sampler
        self.block_size = block_size
        self.device = model.device
        self.record_routing = record_routing
        self.moe_blocks = model.moe_blocks()

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        P = self.block_size
        ids, positions, qo_indptr, logits_idx = [], [], [0], []
        indptr, indices, last_len, ctx = [0], [], [], []
        for seq in batch.seqs:
            n = len(seq)
            if batch.kind == "prefill":
                ids.extend(seq.token_ids)
                positions.extend(range(n))
            else:
                ids.append(seq.token_ids[-1])
                positions.append(n - 1)
            qo_indptr.append(len(ids))
            logits_idx.append(len(ids) - 1)
            pages = -(-n // P)
            indices.extend(seq.block_table[:pages])
            indptr.append(len(indices))
            last_len.append(n - (pages - 1) * P)
            ctx.append(n)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        if batch.kind == "prefill":
            # slot of every position: block_table[pos // P] * P + pos % P, per sequence
            tables = torch.cat([torch.tensor(s.block_table, dtype=torch.int64)[torch.arange(len(s)) // P]
                                for s in batch.seqs])
            slots = tables * P + pos_t % P
        else:
            slots = torch.tensor([s.block_table[(len(s) - 1) // P] * P + (len(s) - 1) % P for s in batch.seqs],
                                 dtype=torch.int64)
        dev = self.device
        to = lambda x, dt: torch.tensor(x, dtype=dt).to(dev, non_blocking=True)  # noqa: E731
        return ForwardBatch(
            kind=batch.kind, input_ids=to(ids, torch.int64), positions=pos_t.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True), qo_indptr=qo_indptr,
            kv_indptr=to(indptr, torch.int32), kv_indices=to(indices, torch.int32),
            kv_last_page_len=to(last_len, torch.int32), context_lens=ctx,
            logits_indices=to(logits_idx, torch.int64), max_num_pages=max(indptr[i + 1] - indptr[i]
                                                                          for i in range(len(ctx))),
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[float]]:
        """Forward + sample. Returns the sequences that receive a token (siblings included), tokens, log-probs."""
        fb = self.prepare(batch)
        self.backend.plan(fb)
        for block in self.moe_blocks:
            block.record_ids = self.record_routing
        hidden_TC = self.model.hidden_states(fb.input_ids, fb.positions, self.backend)
        logits_BV = self.model.compute_logits(hidden_TC[fb.logits_indices])
        if self.record_routing:
            self._store_routing(batch, fb)
        rows, seqs = [], []
        for i, seq in enumerate(batch.seqs):
            group = [seq] + (seq.fork_children if batch.kind == "prefill" else [])
            rows.extend([i] * len(group))
            seqs.extend(group)
        if len(rows) != len(batch.seqs):
            logits_BV = logits_BV[torch.tensor(rows, device=logits_BV.device)]
        tokens, logprobs = self.sampler(logits_BV, seqs)
        return seqs, tokens, logprobs

    def _store_routing(self, batch: ScheduledBatch, fb: ForwardBatch) -> None:
        """Keep the expert ids [tokens, L_moe, K] each sequence's input tokens were routed to."""
        ids_TLK = torch.stack([b.last_ids for b in self.moe_blocks], dim=1).cpu()
        for i, seq in enumerate(batch.seqs):
            rows = ids_TLK[fb.qo_indptr[i]:fb.qo_indptr[i + 1]]
            if batch.kind == "prefill":
                seq.routing_ids = [rows]
                for child in seq.fork_children:
                    child.routing_ids = [rows]
            else:
                seq.routing_ids.append(rows)
