"""Block manager: KV blocks with reference counts, fork and copy-on-write, and the block tables.

Block b holds the K/V of P consecutive token positions of every sequence whose block table
lists it. Forked sequences share all blocks (reference count > 1). A group forked at admission
shares its blocks before its prefill, which writes them once for every member (they hold the
same tokens there); after that, the first write into a shared block — always the partial last
block — copies it to a fresh block first (copy-on-write), so a shared block is never written
with one member's token. Freeing decrements reference counts
and returns blocks that reach zero. No tensor work happens here: copies are returned as
(src, dst) block pairs for the model runner to execute before the step's forward.

The free list and reference counts live in a BlockPool, which engines sharing one KV cache
(the trainer's rollout and eval engines) share; each engine's BlockManager keeps its own
sequences' tables. A sequence holding blocks owns a row of `tables` ([rows, max_pages] int32,
numpy), written here whenever its block table changes (allocate, fork, a new page, a
copy-on-write), so a step reads the page tables of its batch straight from that array
instead of rebuilding them from Python lists; `version` counts those writes, so a step can tell
that nothing changed since the last one.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from rlengine.engine.sequence import Sequence


class BlockPool:
    """Free list and reference counts of num_blocks KV blocks (shared by engines on one KV cache)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, max_seqs: int = 64, max_pages_per_seq: int = 64,
                 pool: BlockPool | None = None):
        """num_blocks is ignored when `pool` (another engine's) is given. max_seqs / max_pages_per_seq size
        the tables; they grow if exceeded (never in the engine, which passes B_gen and max_model_len / P)."""
        if block_size < 1 or (pool is None and num_blocks < 1):
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.pool = pool or BlockPool(num_blocks)
        self.block_size = block_size
        self.ref_counts, self.free_blocks = self.pool.ref_counts, self.pool.free_blocks
        self.tables = np.zeros((max(1, max_seqs), max(1, max_pages_per_seq)), dtype=np.int32)
        self._free_rows = list(range(self.tables.shape[0] - 1, -1, -1))  # pop() hands out row 0 first
        self.version = 0  # bumped by every change of a row or its table

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_decode_blocks(self, num_tokens: int, group_size: int) -> int:
        """Blocks a group of `group_size` sequences forked at `num_tokens` takes at its first decode step:
        one copy-on-write per member but the last writer when the shared last page is partial, else
        one fresh page per member."""
        return group_size if num_tokens % self.block_size == 0 else group_size - 1

    # ---- blocks ----------------------------------------------------------------------------------
    def _take(self) -> int:
        block = self.free_blocks.popleft()
        assert self.ref_counts[block] == 0, f"block {block} on the free list with refcount {self.ref_counts[block]}"
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"double free of block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    # ---- rows ------------------------------------------------------------------------------------
    def _take_row(self, seq: Sequence, num_pages: int) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.tables.shape[0])
        if num_pages > self.tables.shape[1]:
            self._grow(pages=max(num_pages, 2 * self.tables.shape[1]))
        seq.row = self._free_rows.pop()
        self.version += 1
        return seq.row

    def _grow(self, rows: int | None = None, pages: int | None = None) -> None:
        old = self.tables
        R, Pg = rows or old.shape[0], pages or old.shape[1]
        self.tables = np.zeros((R, Pg), dtype=np.int32)
        self.tables[:old.shape[0], :old.shape[1]] = old
        self.version += 1
        self._free_rows = list(range(R - 1, old.shape[0] - 1, -1)) + self._free_rows

    # ---- sequence lifecycle ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """A row and blocks for every current token of `seq` (its prefill); the table must be empty."""
        assert not seq.block_table and seq.row < 0, f"sequence {seq.seq_id} already has blocks"
        seq.block_table = [self._take() for _ in range(self.blocks_for(len(seq)))]
        row = self._take_row(seq, len(seq.block_table))
        self.tables[row, :len(seq.block_table)] = seq.block_table

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (and gets its own row)."""
        assert not child.block_table and child.row < 0
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_counts[block] += 1
        n = len(child.block_table)
        row = self._take_row(child, n)
        self.tables[row, :n] = self.tables[parent.row, :n]

    def append_cost(self, seq: Sequence) -> int:
        """Free blocks needed to write the K/V of seq's last token (position len-1)."""
        pos = len(seq) - 1
        if pos // self.block_size >= len(seq.block_table):
            return 1
        return 1 if self.ref_counts[seq.block_table[pos // self.block_size]] > 1 else 0

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make position len-1 writable; returns a (src, dst) block copy when copy-on-write is needed."""
        pos = len(seq) - 1
        idx = pos // self.block_size
        table = seq.block_table
        if idx == len(table):
            if idx >= self.tables.shape[1]:
                self._grow(pages=2 * self.tables.shape[1])
            block = self._take()
            table.append(block)
            self.tables[seq.row, idx] = block
            self.version += 1
            return None
        block = table[idx]
        if self.ref_counts[block] == 1:
            return None
        fresh = self._take()
        self._release(block)
        table[idx] = fresh
        self.tables[seq.row, idx] = fresh
        self.version += 1
        return block, fresh

    def extend_cost(self, seq: Sequence) -> int:
        """Free blocks needed to write positions num_cached..len-1 (a chunk on top of seq's cached tokens):
        new pages past its table, plus one copy when the page holding position num_cached is shared."""
        start, table = seq.num_cached, seq.block_table
        cost = max(0, self.blocks_for(len(seq)) - len(table))
        idx = start // self.block_size
        return cost + (1 if idx < len(table) and self.ref_counts[table[idx]] > 1 else 0)

    def extend(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make positions num_cached..len-1 writable (the caller checked extend_cost); returns the (src, dst)
        copy-on-write pair of a shared page the chunk writes into, if any (at most one: pages past it are
        new or only seq's, since a shared page is never written)."""
        table, P = seq.block_table, self.block_size
        copies = []
        for idx in range(seq.num_cached // P, self.blocks_for(len(seq))):
            if idx == len(table):
                if idx >= self.tables.shape[1]:
                    self._grow(pages=2 * self.tables.shape[1])
                table.append(self._take())
            elif self.ref_counts[table[idx]] > 1:
                fresh = self._take()
                self._release(table[idx])
                copies.append((table[idx], fresh))
                table[idx] = fresh
            else:
                continue
            self.tables[seq.row, idx] = table[idx]
            self.version += 1
        return copies

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1
            self.version += 1
