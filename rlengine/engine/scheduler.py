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

Trajectories (multi-turn sequences): a sequence whose turn ended is parked (`parked`, PAUSED) with
its blocks and row, and counts toward max_num_seqs; continued with an observation it joins
`resuming` and is prefilled as a chunk of its new tokens on top of its cached ones (start =
num_cached, recorded in ScheduledBatch.starts), ahead of any new admission. Under memory pressure
a parked trajectory is preempted before a decoding sequence: its blocks are freed and num_cached
reset, so its resume prefills it whole (so is a continued one still waiting for its chunk, after the
parked ones). New admissions never preempt a parked trajectory.
"""

from __future__ import annotations

import itertools
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
    starts: list[int] | None = None             # prefill [B]: tokens of each seq already cached (chunk start);
    #                                             None: every seq prefills from position 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []           # trajectories between turns (PAUSED), in pause order
        self.resuming: deque[Sequence] = deque()   # continued trajectories waiting for their chunk prefill
        self.num_parked_preemptions = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    def add(self, group: list[Sequence]) -> None:
        """Queue a request's samples (all with the same tokens): admitted together, leader first."""
        self.waiting.append(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.resuming)

    @property
    def num_in_flight(self) -> int:
        """Sequences counted against max_num_seqs: running, parked and resuming ones."""
        return len(self.running) + len(self.parked) + len(self.resuming)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch("prefill", [], [], [], starts=[])
        bm, tokens, reserved = self.bm, 0, 0
        while self.resuming:  # already in flight: no cap check, ahead of new admissions
            seq = self.resuming[0]
            n = len(seq) - seq.num_cached
            if tokens + n > self.max_num_batched_tokens or not self._room_to_resume(seq):
                break
            self.resuming.popleft()
            batch.starts.append(seq.num_cached)
            if seq.num_cached:
                batch.copies.extend(bm.extend(seq))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:  # preempted while parked: recomputed whole
                self._admit([seq])
            batch.sample_rows.append(len(batch.seqs))
            batch.seqs.append(seq)
            batch.samples.append(seq)
            tokens += n
            reserved += bm.first_decode_blocks(len(seq), 1)
        while self.waiting:
            group = self.waiting[0]
            leader, G = group[0], len(group)
            n = len(leader)
            if self.num_in_flight + G > self.max_num_seqs or tokens + n > self.max_num_batched_tokens:
                break
            first_decode = bm.first_decode_blocks(n, G) if self.running else 0
            if bm.blocks_for(n) + reserved + first_decode > bm.num_free:
                break
            self.waiting.popleft()
            self._admit(group)
            batch.sample_rows.extend([len(batch.seqs)] * G)
            batch.starts.append(0)
            batch.seqs.append(leader)
            batch.samples.extend(group)
            tokens += n
            reserved += bm.first_decode_blocks(n, G)
        if not any(batch.starts):
            batch.starts = None
        return batch

    def _room_to_resume(self, seq: Sequence) -> bool:
        """Free blocks for seq's chunk (or whole recompute), preempting other parked trajectories if needed."""
        bm = self.bm
        while True:
            need = bm.extend_cost(seq) if seq.num_cached else bm.blocks_for(len(seq))
            if need <= bm.num_free or not self._preempt_parked(seq):
                return need <= bm.num_free

    def _preempt_parked(self, resuming: Sequence | None = None) -> bool:
        """Free the blocks of the most recently parked trajectory that holds any (then of a continued one still
        waiting for its chunk, other than `resuming`); False if none holds blocks."""
        for seq in itertools.chain(reversed(self.parked), reversed(self.resuming)):
            if seq.block_table and seq is not resuming:
                self.bm.free(seq)
                self.num_recomputed_tokens += seq.num_cached
                seq.num_cached = 0
                self.num_preemptions += 1
                self.num_parked_preemptions += 1
                return True
        return False

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
                if not self._preempt_parked():  # a parked trajectory goes before a decoding sequence
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
        elif seq.status is SequenceStatus.PAUSED:
            self.parked.remove(seq)
            self.bm.free(seq)
        elif seq in self.resuming:
            self.resuming.remove(seq)
            self.bm.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove([seq])
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def pause(self, seq: Sequence, reason: str) -> None:
        """A trajectory's turn ended: it leaves the running set and waits, parked with its blocks. The K/V of
        its last token is not written yet (a decode step writes its input's), so num_cached = len - 1."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PAUSED
        seq.finish_reason = reason
        seq.num_cached = len(seq) - 1
        self.parked.append(seq)

    def resume(self, seq: Sequence) -> None:
        """A parked trajectory took new tokens: queue its chunk prefill."""
        self.parked.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.finish_reason = None
        self.resuming.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of a request (waiting, running, parked or resuming), freeing its blocks."""
        gone = [s for s in self.running if s.request_id == request_id]
        for seq in gone:
            self.running.remove(seq)
            self.bm.free(seq)
        for queue in (self.parked, self.resuming):
            for seq in [s for s in queue if s.request_id == request_id]:
                queue.remove(seq)
                self.bm.free(seq)
                gone.append(seq)
        for group in [g for g in self.waiting if g[0].request_id == request_id]:
            self.waiting.remove(group)
            gone.extend(group)
        for seq in gone:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        return gone
