"""Property tests of the block manager and the scheduler on top of it.

Random sequences of add / allocate / step (append_slot) / fork / preempt / finish / abort,
over many seeds (plain `random`, so a failure reproduces from the printed seed). After every
operation the bookkeeping is checked against an independent recount:
  - no leaked block: free + referenced == total, and the free list holds exactly the
    refcount-0 blocks, each once (no double free);
  - each block's refcount equals the number of live block tables that hold it;
  - a block table covers exactly the positions written so far;
  - writes never land in a block with refcount > 1 (append_slot hands back a copy first);
  - each live sequence owns a distinct row of the persistent tables, and that row lists its block
    table (the arrays a step reads its page tables from);
  - a shadow KV cache (block -> {offset: token}) that replays every write and copy-on-write
    reads back each live sequence's own tokens through its block table, so a write into a
    shared block would show up as a sibling's corrupted context.
The second half drives the real Scheduler with a tiny block budget the same way the engine
does (schedule, copies, writes, sample every member of an admitted group, finish), with the
same checks, plus the group-admission reservation.
"""

import random
from collections import Counter

import pytest

from rlengine.engine.block_manager import BlockManager
from rlengine.engine.sampling_params import SamplingParams
from rlengine.engine.scheduler import Scheduler
from rlengine.engine.sequence import Sequence, SequenceStatus

PARAMS = SamplingParams()


def _seq(rng: random.Random, max_prompt: int, request: str = "r") -> Sequence:
    return Sequence(request, 0, [rng.randrange(1000) for _ in range(rng.randint(1, max_prompt))], PARAMS)


class ShadowKV:
    """What the KV cache would hold: block -> {offset: token id written there}."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.blocks: dict[int, dict[int, int]] = {}

    def copy(self, src: int, dst: int) -> None:
        assert self.bm.ref_counts[dst] == 1, f"copy-on-write target {dst} is shared"
        self.blocks[dst] = dict(self.blocks.get(src, {}))

    def write(self, seq: Sequence, pos: int, group: list[Sequence] | None = None) -> None:
        """A K/V write of seq's position pos. Into a shared block only from the prefill of the group that
        shares it (group: its members, all with the same token there)."""
        block = seq.block_table[pos // self.bm.block_size]
        if group is None:
            assert self.bm.ref_counts[block] == 1, f"write into block {block} with refcount {self.bm.ref_counts[block]}"
        else:
            assert self.bm.ref_counts[block] == len(group), f"prefill write into block {block} shared outside its group"
            assert all(g.token_ids[pos] == seq.token_ids[pos] for g in group)
        self.blocks.setdefault(block, {})[pos % self.bm.block_size] = seq.token_ids[pos]

    def read(self, seq: Sequence, num_tokens: int) -> list[int | None]:
        P = self.bm.block_size
        return [self.blocks.get(seq.block_table[p // P], {}).get(p % P) for p in range(num_tokens)]


def check_invariants(bm: BlockManager, live: dict[int, tuple[Sequence, int]], shadow: ShadowKV) -> None:
    """live: seq_id -> (sequence, positions written). Raises AssertionError on any broken invariant."""
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)), "a block is on the free list twice (double free)"
    assert all(bm.ref_counts[b] == 0 for b in free), "a referenced block is on the free list"
    referenced = sum(1 for c in bm.ref_counts if c > 0)
    assert len(free) + referenced == bm.num_blocks, "leaked block: neither free nor referenced"
    holders = Counter(b for seq, _ in live.values() for b in seq.block_table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == holders.get(block, 0), \
            f"block {block}: refcount {bm.ref_counts[block]} but {holders.get(block, 0)} tables hold it"
    rows = [seq.row for seq, _ in live.values() if seq.block_table]
    assert len(rows) == len(set(rows)) and all(r >= 0 for r in rows), f"rows shared or missing: {rows}"
    for seq, written in live.values():
        if not seq.block_table:
            continue
        assert bm.tables[seq.row, :len(seq.block_table)].tolist() == seq.block_table, \
            f"sequence {seq.seq_id}: table row {seq.row} differs from its block table"
        assert len(seq.block_table) == bm.blocks_for(written), f"sequence {seq.seq_id}: table/written mismatch"
        assert shadow.read(seq, written) == seq.token_ids[:written], f"sequence {seq.seq_id} reads wrong K/V"


@pytest.mark.parametrize("seed", range(200))
def test_block_manager_random_ops(seed):
    rng = random.Random(seed)
    P = rng.choice([1, 2, 3, 4, 8])
    # small tables on purpose: rows and pages grow when exceeded
    bm = BlockManager(rng.randint(1, 24), P, max_seqs=rng.randint(1, 4), max_pages_per_seq=rng.randint(1, 4))
    shadow = ShadowKV(bm)
    waiting: list[Sequence] = []
    live: dict[int, tuple[Sequence, int]] = {}  # allocated sequences and how many positions are written
    groups: dict[int, set[int]] = {}             # request (root seq id) -> its live sequences, for abort
    root: dict[int, int] = {}
    counts = Counter()
    for _ in range(150):
        op = rng.choice(["add", "allocate", "allocate", "step", "step", "step", "fork", "preempt", "finish",
                         "abort"])
        allocated = list(live.values())
        if op == "add":
            seq = _seq(rng, 3 * P + 1)
            waiting.append(seq)
            root[seq.seq_id] = seq.seq_id
        elif op == "allocate" and waiting:
            seq = rng.choice(waiting)
            if not bm.can_allocate(seq):
                assert bm.blocks_for(len(seq)) > bm.num_free
                continue
            waiting.remove(seq)
            bm.allocate(seq)
            for pos in range(len(seq)):  # the prefill writes every position
                shadow.write(seq, pos)
            live[seq.seq_id] = (seq, len(seq))
            groups.setdefault(root[seq.seq_id], set()).add(seq.seq_id)
        elif op == "step" and allocated:
            seq, written = rng.choice(allocated)
            seq.token_ids.append(rng.randrange(1000))  # the sampled token, written by the next decode step
            cost = bm.append_cost(seq)
            if cost > bm.num_free:
                seq.token_ids.pop()  # the scheduler would preempt here instead
                continue
            free_before = bm.num_free
            copy = bm.append_slot(seq)
            assert bm.num_free == free_before - cost, "append_cost disagrees with what append_slot took"
            if copy is not None:
                src, dst = copy
                assert src != dst and bm.ref_counts[src] >= 1 and dst == seq.block_table[(len(seq) - 1) // P]
                shadow.copy(src, dst)
                counts["cow"] += 1
            shadow.write(seq, len(seq) - 1)
            live[seq.seq_id] = (seq, len(seq))
        elif op == "fork" and allocated:
            parent, written = rng.choice(allocated)
            child = Sequence(parent.request_id, 1, parent.token_ids, PARAMS)
            bm.fork(parent, child)
            live[child.seq_id] = (child, written)
            root[child.seq_id] = root[parent.seq_id]
            groups[root[parent.seq_id]].add(child.seq_id)
            counts["fork"] += 1
        elif op == "preempt" and allocated:
            seq, _ = rng.choice(allocated)
            bm.free(seq)
            del live[seq.seq_id]
            groups[root[seq.seq_id]].discard(seq.seq_id)
            waiting.append(seq)  # tokens kept, recomputed by a later allocate
        elif op in ("finish", "abort") and allocated:
            seq, _ = rng.choice(allocated)
            victims = [seq.seq_id] if op == "finish" else list(groups[root[seq.seq_id]])
            for sid in victims:
                bm.free(live.pop(sid)[0])
                groups[root[sid]].discard(sid)
        check_invariants(bm, live, shadow)
    for seq, _ in list(live.values()):
        bm.free(seq)
    check_invariants(bm, {}, shadow)
    assert bm.num_free == bm.num_blocks


def test_block_manager_detects_double_free_and_bad_sizes():
    bm = BlockManager(4, 2)
    seq = Sequence("r", 0, [1, 2, 3], PARAMS)
    bm.allocate(seq)
    block = seq.block_table[0]
    bm.free(seq)
    with pytest.raises(AssertionError, match="double free"):
        bm._release(block)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


def test_copy_on_write_targets_only_the_partial_block():
    bm = BlockManager(8, 4)
    parent = Sequence("r", 0, list(range(6)), PARAMS)  # blocks [full, partial (2 of 4)]
    bm.allocate(parent)
    children = [Sequence("r", i, parent.token_ids, PARAMS) for i in (1, 2)]
    for c in children:
        bm.fork(parent, c)
    assert bm.ref_counts[parent.block_table[0]] == bm.ref_counts[parent.block_table[1]] == 3
    for i, s in enumerate([parent] + children):
        s.token_ids.append(100 + i)
    copies = [bm.append_slot(s) for s in [parent] + children]
    assert copies[0] is not None and copies[1] is not None and copies[2] is None  # the last holder writes in place
    assert copies[0][0] == copies[1][0] == children[1].block_table[1]
    assert bm.ref_counts[parent.block_table[0]] == 3  # the full prefix block stays shared
    assert len({s.block_table[1] for s in [parent] + children}) == 3


# ---- the real scheduler ----------------------------------------------------------------------------
def _drive_scheduler(seed: int) -> Scheduler:
    """Run a random workload through a Scheduler the way LLM.step() does, checking invariants every step."""
    rng = random.Random(1000 + seed)
    P = rng.choice([1, 2, 4])
    max_len = 6 * P + rng.randint(0, P)
    min_blocks = -(-max_len // P)  # one sequence at full length always fits: progress is guaranteed
    bm = BlockManager(rng.randint(min_blocks, 3 * min_blocks), P, max_seqs=1, max_pages_per_seq=1)  # tables grow
    sched = Scheduler(bm, max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=max_len)
    shadow = ShadowKV(bm)
    requests: dict[str, list[Sequence]] = {}
    max_out: dict[int, int] = {}
    finished = 0
    for step in range(400):
        if rng.random() < 0.3 and len(requests) < 12:
            rid = f"q{step}"
            n = rng.randint(1, min(3, sched.max_num_seqs))
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, max_len // 2))]
            seqs = [Sequence(rid, i, prompt, PARAMS) for i in range(n)]
            for s in seqs:
                max_out[s.seq_id] = rng.randint(1, max_len - len(prompt))
                s.max_len = len(prompt) + max_out[s.seq_id]  # the engine's length limit, as LLM sets it
            requests[rid] = seqs
            sched.add(seqs)
        if requests and rng.random() < 0.03:
            rid = rng.choice(list(requests))
            sched.abort(rid)
            del requests[rid]
        if not sched.has_work:
            continue
        batch = sched.schedule()
        assert batch.seqs, "the scheduler stalled with work queued"
        assert len(batch.seqs) <= sched.max_num_seqs
        for src, dst in batch.copies:
            shadow.copy(src, dst)
        for i, seq in enumerate(batch.seqs):  # the forward writes K/V: every position (prefill) or the last one
            assert seq.status == SequenceStatus.RUNNING
            if batch.kind == "prefill":  # once for the whole group, into the blocks its members share
                group = [s for s, r in zip(batch.samples, batch.sample_rows) if r == i]
                for pos in range(len(seq)):
                    shadow.write(seq, pos, group)
            else:
                shadow.write(seq, len(seq) - 1)
        if batch.kind == "prefill":
            assert sum(len(s) for s in batch.seqs) <= sched.max_num_batched_tokens
            assert [batch.seqs[r].token_ids for r in batch.sample_rows] == [s.token_ids for s in batch.samples]
        else:
            assert batch.samples == batch.seqs
        for seq in batch.samples:
            seq.append(rng.randrange(1000), 0.0, 0)
            if seq.num_output_tokens >= max_out[seq.seq_id]:
                sched.finish(seq, "length")
                finished += 1
                if all(s.is_finished for s in requests[seq.request_id]):
                    del requests[seq.request_id]
        live = {s.seq_id: (s, len(s) - 1) for s in sched.running}
        check_invariants(bm, live, shadow)
        assert all(not s.block_table and s.row < 0 for group in sched.waiting for s in group)
        assert len(sched.running) <= sched.max_num_seqs
    # drain: everything still queued completes, nothing is lost
    while sched.has_work:
        batch = sched.schedule()
        assert batch.seqs
        for seq in batch.samples:
            seq.append(0, 0.0, 0)
            if seq.num_output_tokens >= max_out[seq.seq_id]:
                sched.finish(seq, "length")
    assert bm.num_free == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    assert finished > 0
    return sched


@pytest.mark.parametrize("seed", range(60))
def test_scheduler_with_tiny_block_budget(seed):
    _drive_scheduler(seed)


def test_scheduler_workloads_do_preempt():
    """The budgets above are tight enough that recompute preemption is exercised, not just allowed."""
    preempted = [_drive_scheduler(seed).num_preemptions for seed in range(10)]
    assert sum(n > 0 for n in preempted) >= 5, preempted


def _group(rid: str, prompt_len: int, G: int) -> list[Sequence]:
    return [Sequence(rid, i, list(range(prompt_len)), PARAMS) for i in range(G)]


@pytest.mark.parametrize("prompt_len,first_decode", [(5, 3), (8, 4)])  # P = 4: partial last page / full pages
def test_group_admission_reserves_its_first_decode_blocks(prompt_len, first_decode):
    """A group of G = 4 is admitted only when the free blocks also cover its first decode step (G - 1
    copy-on-writes, or G fresh pages at a page boundary), so it never preempts its own siblings."""
    P, G = 4, 4
    prompt_blocks = -(-prompt_len // P)
    for spare, admitted in ((first_decode - 1, False), (first_decode, True)):
        bm = BlockManager(1 + prompt_blocks + spare, P)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
        sched.add(_group("other", 3, 1))
        assert sched.schedule().kind == "prefill"  # one sequence running, holding one block
        sched.running[0].append(9, 0.0, 0)
        sched.add(_group("g", prompt_len, G))
        batch = sched.schedule()
        assert (batch.kind == "prefill") == admitted, (spare, batch.kind)
        if not admitted:
            continue
        assert [s.request_id for s in batch.samples] == ["g"] * G and batch.sample_rows == [0] * G
        for s in batch.samples:
            s.append(9, 0.0, 0)
        decode = sched.schedule()
        assert decode.kind == "decode" and len(decode.seqs) == G + 1 and sched.num_preemptions == 0
        assert len(decode.copies) == (G - 1 if prompt_len % P else 0)


def test_group_admission_waives_the_reservation_when_idle():
    """With nothing running a group is admitted on its prefill blocks alone (else it could never run);
    its first decode then preempts its own newest members, and everything still completes."""
    P, G = 4, 4
    bm = BlockManager(2 + 1, P)  # prompt of 5: two blocks, one spare (the group's first decode needs 3)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_group("g", 5, G))
    batch = sched.schedule()
    assert batch.kind == "prefill" and len(batch.samples) == G
    for s in batch.samples:
        s.append(9, 0.0, 0)
    decode = sched.schedule()
    assert sched.num_preemptions > 0 and len(decode.seqs) < G
