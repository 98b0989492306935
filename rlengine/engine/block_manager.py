"""Block manager: KV blocks with reference counts, fork and copy-on-write.

Block b holds the K/V of P consecutive token positions of every sequence whose block table
lists it. Forked sequences share all blocks (reference count > 1); the first write into a
shared block — always the partial last block — copies it to a fresh block first
(copy-on-write), so shared blocks are never written. Freeing decrements reference counts
and returns blocks that reach zero. No tensor work happens here: copies are returned as
(src, dst) block pairs for the model runner to execute before the step's forward.
"""

from __future__ import annotations

from collections import deque

from rlengine.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every current token of `seq` (its prefill); the table must be empty."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        seq.block_table = [self._take() for _ in range(self.blocks_for(len(seq)))]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks."""
        assert not child.block_table
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_counts[block] += 1
        child.num_cached_tokens = parent.num_cached_tokens

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
        if idx == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        block = seq.block_table[idx]
        if self.ref_counts[block] == 1:
            return None
        fresh = self._take()
        self._release(block)
        seq.block_table[idx] = fresh
        return block, fresh

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        """Flat cache slot of token position `pos` of `seq`."""
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
