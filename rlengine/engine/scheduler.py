"""Scheduler: continuous batching under B_gen (max_num_seqs), a token budget and free KV blocks.

Each step is either a prefill step (new or preempted sequences, packed, up to
max_num_batched_tokens tokens) or a decode step (one token for every running sequence).
Prefill goes first whenever something waiting fits: admitting work early keeps B_act high.
A request with n samples is admitted as one group of n sequences (only the leader is
prefilled; the siblings fork from it afterwards). When a decode step needs a block and none
is free, the most recently admitted running sequence is preempted by recomputation: its
blocks are freed and it goes back to the front of the waiting queue with its generated
tokens kept, to be prefilled again later. No request is ever dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlengine.engine.block_manager import BlockManager
from rlengine.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """What one engine step runs."""

    kind: str                                   # "prefill" | "decode"
    seqs: list[Sequence]                        # B sequences, in batch order
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, before forward


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        seqs, tokens = [], 0
        in_flight = len(self.running)  # counts the siblings of leaders admitted in this step (forked after it)
        while self.waiting:
            seq = self.waiting[0]
            if in_flight + seq.group_size > self.max_num_seqs:
                break
            if tokens + len(seq) > self.max_num_batched_tokens or not self.bm.can_allocate(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            tokens += len(seq)
            in_flight += seq.group_size
        return ScheduledBatch("prefill", seqs)

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch("decode", [])
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            # Room for seq's next K/V slot: preempt the newest sequences, possibly seq itself.
            while self.bm.append_cost(seq) > self.bm.num_free and seq.status is SequenceStatus.RUNNING:
                self._preempt(self.running[-1])
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq was the newest running sequence; everything before it is scheduled
            copy = self.bm.append_slot(seq)
            if copy is not None:
                batch.copies.append(copy)
            batch.seqs.append(seq)
            i += 1
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.num_recomputed_tokens += len(seq)

    def after_prefill(self, leader: Sequence, children: list[Sequence]) -> None:
        """Fork the leader's blocks into its siblings; they join the running set."""
        for child in children:
            self.bm.fork(leader, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.bm.free(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of a request (waiting or running), freeing its blocks."""
        gone = [s for s in list(self.waiting) + self.running if s.request_id == request_id]
        for seq in gone:
            group = [seq] + seq.fork_children
            for s in group:
                if s in self.running:
                    self.running.remove(s)
                    self.bm.free(s)
                s.status = SequenceStatus.FINISHED
                s.finish_reason = "abort"
            if seq in self.waiting:
                self.waiting.remove(seq)
        return gone
