"""Scheduler: continuous batching under B_gen (max_num_seqs), a token budget and free KV blocks.

Each step is either a prefill step (newly admitted groups, packed, up to max_num_batched_tokens
tokens) or a decode step (one token for every running sequence). Prefill goes first whenever
something waiting fits: admitting work early keeps B_act high.

The waiting queue holds groups: a request's n samples, or one preempted sequence. Admission is
where a group's lifecycle is decided, in one place: the leader gets fresh blocks, every other
member forks them, all members join the running set, and only the leader's tokens go through
the prefill forward (each member samples its first token from the leader's last logits row).
A group is admitted only if the free blocks also cover what it takes at its first decode step
(BlockManager.first_decode_blocks: up to G - 1 copy-on-write blocks), counting the groups
admitted before it in the same step, so a group does not preempt its own siblings; with nothing
running the reservation is waived (progress is guaranteed, preemption handles the rest).
When a decode step needs a block and none is free, the most recently admitted running sequence
is preempted by recomputation: its blocks are freed and it goes back to the front of the waiting
queue, alone, with its generated tokens kept, to be prefilled again later. No request is lost.
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
    seqs: list[Sequence]                        # B sequences whose tokens run through the forward
    samples: list[Sequence] = field(default_factory=list)  # N sequences that receive a token (decode: seqs)
    sample_rows: list[int] | None = None        # prefill [N]: index in seqs of the logits row each sample
    #                                             draws from (its group's leader); None: sample i <- row i
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, before forward


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    def add(self, group: list[Sequence]) -> None:
        """Queue a request's samples (all with the same tokens): admitted together, leader first."""
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch("prefill", [], [], [])
        bm, tokens, reserved = self.bm, 0, 0
        while self.waiting:
            group = self.waiting[0]
            leader, G = group[0], len(group)
            n = len(leader)
            if len(self.running) + G > self.max_num_seqs or tokens + n > self.max_num_batched_tokens:
                break
            first_decode = bm.first_decode_blocks(n, G) if self.running else 0
            if bm.blocks_for(n) + reserved + first_decode > bm.num_free:
                break
            self.waiting.popleft()
            self._admit(group)
            batch.sample_rows.extend([len(batch.seqs)] * G)
            batch.seqs.append(leader)
            batch.samples.extend(group)
            tokens += n
            reserved += bm.first_decode_blocks(n, G)
        return batch

    def _admit(self, group: list[Sequence]) -> None:
        """Blocks for the leader's tokens, shared by every member; all members start running."""
        leader = group[0]
        self.bm.allocate(leader)
        for seq in group[1:]:
            self.bm.fork(leader, seq)
        for seq in group:
            seq.status = SequenceStatus.RUNNING
        self.running.extend(group)

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch("decode", [])
        bm, P = self.bm, self.bm.block_size
        ref_counts = bm.ref_counts
        running, seqs = self.running, []
        i = 0
        while i < len(running):
            seq = running[i]
            n = len(seq.token_ids)
            i += 1
            if n >= seq.max_len:
                continue  # overlap: its last token is being sampled; it finishes when that step is read
            # fast path: position n-1 lies in the last page, which only this sequence holds
            if (n - 1) % P and ref_counts[seq.block_table[-1]] == 1:
                seqs.append(seq)
                continue
            # Room for seq's next K/V slot: preempt the newest sequences, possibly seq itself.
            while bm.append_cost(seq) > bm.num_free and seq.status is SequenceStatus.RUNNING:
                self._preempt(running[-1])
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq was the newest running sequence; everything before it is scheduled
            copy = bm.append_slot(seq)
            if copy is not None:
                batch.copies.append(copy)
            seqs.append(seq)
        batch.seqs = batch.samples = seqs
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])
        self.num_preemptions += 1
        self.num_recomputed_tokens += len(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """seq is done: it leaves the running set (or, preempted while its last token was being sampled
        under overlap, the waiting queue) and its blocks return."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove([seq])
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of a request (waiting or running), freeing its blocks."""
        gone = [s for s in self.running if s.request_id == request_id]
        for seq in gone:
            self.running.remove(seq)
            self.bm.free(seq)
        for group in [g for g in self.waiting if g[0].request_id == request_id]:
            self.waiting.remove(group)
            gone.extend(group)
        for seq in gone:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        return gone
