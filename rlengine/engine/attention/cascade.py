"""Shared-prefix (cascade) plan of a decode step: which rows of the batch share which KV pages.

A GRPO group's samples fork the leader's blocks (BlockManager.fork), so their block tables start
with the same block ids until the first page a member owns alone (copy-on-write or a fresh page).
plan_cascade reads exactly that from the step's page tables: a run of consecutive batch rows whose
first block is the same block is one group (block ids have one owner family, so equal first blocks
mean forked siblings), and its prefix is the longest run of leading pages every member lists, cut to
whole pages (each member's last page, where this step's token is written, stays its own). Nothing is
tracked by hand: a member that finished, was preempted or aborted has left the batch, and the rest
form a smaller group, or plain decode once one member is left. Groups longer than `max_rows` rows
are cut into chunks (the kernels score one chunk's rows together).

The plan is host work on numpy (page tables of the step's ForwardBatch), one pass per step; the
kernels take it as CSR tables (FlashInfer's cascade vocabulary: a prefix level and a suffix level).
Dimension legend: B sequences, C chunks, P page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CascadePlan:
    """CSR tables of one step's two attention levels (host int32 arrays)."""

    chunk_indptr: np.ndarray     # [C+1] batch rows of chunk c: chunk_indptr[c] .. chunk_indptr[c+1]
    prefix_indptr: np.ndarray    # [C+1] chunk c's shared pages: prefix_indices[prefix_indptr[c]:prefix_indptr[c+1]]
    prefix_indices: np.ndarray   # [>= 1] block ids of the shared full pages (one dummy entry when there are none)
    suffix_indptr: np.ndarray    # [B+1] each row's own pages in suffix_indices
    suffix_indices: np.ndarray   # [suffix_indptr[B]] block ids
    max_rows: int                # most batch rows in one chunk
    shared_pages: int            # page reads saved per KV head: sum over chunks of (rows - 1) * prefix pages


def plan_cascade(kv_indptr: np.ndarray, kv_indices: np.ndarray, max_rows: int = 64) -> CascadePlan | None:
    """The cascade plan of a decode batch, or None when no two rows share a whole page.

    kv_indptr [B+1], kv_indices [kv_indptr[B]] (host, any int dtype): the step's page tables.
    max_rows: most batch rows per chunk. Returns None fast (a few vectorised ops) for a batch
    without forked siblings, so plain decode pays nearly nothing for the check.
    """
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    B = indptr.shape[0] - 1
    if B < 2:
        return None
    indices = np.asarray(kv_indices)
    npages = np.diff(indptr)
    first = indices[indptr[:-1]]
    # a row joins the group of the row before it when both start on the same block and can share a
    # whole page (each keeps at least its last page)
    joins = (first[1:] == first[:-1]) & (npages[1:] > 1) & (npages[:-1] > 1)
    if not joins.any():
        return None
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.append(starts[1:], B)
    shared = _common_prefixes(indptr, indices, npages, starts)
    # groups cut into chunks of at most max_rows rows; a one-row chunk shares nothing
    n_chunks = -(-(ends - starts) // max_rows)
    first_chunk = np.cumsum(n_chunks) - n_chunks
    chunk_start = np.repeat(starts, n_chunks) + (np.arange(int(n_chunks.sum())) - np.repeat(first_chunk, n_chunks)) * max_rows
    rows_C = np.minimum(np.repeat(ends, n_chunks), chunk_start + max_rows) - chunk_start
    pages_C = np.where(rows_C > 1, np.repeat(shared, n_chunks), 0)
    if not (pages_C > 0).any():
        return None
    chunk_indptr = np.zeros(len(rows_C) + 1, np.int32)
    np.cumsum(rows_C, out=chunk_indptr[1:])
    prefix_indptr = np.zeros(len(rows_C) + 1, np.int32)
    np.cumsum(pages_C, out=prefix_indptr[1:])
    n_prefix = int(prefix_indptr[-1])
    prefix_at = np.repeat(indptr[chunk_start] - prefix_indptr[:-1], pages_C) + np.arange(n_prefix)
    prefix_indices = np.append(indices[prefix_at], 0)  # one dummy entry keeps the array non-empty
    skip_B = np.repeat(pages_C, rows_C)            # leading pages each row leaves to its chunk's prefix
    own_B = npages - skip_B
    suffix_indptr = np.zeros(B + 1, np.int32)
    np.cumsum(own_B, out=suffix_indptr[1:])
    gather = np.repeat(indptr[:-1] + skip_B - suffix_indptr[:-1], own_B) + np.arange(int(suffix_indptr[B]))
    return CascadePlan(chunk_indptr, prefix_indptr, prefix_indices.astype(np.int32), suffix_indptr,
                       indices[gather].astype(np.int32), int(rows_C.max()), int(((rows_C - 1) * pages_C).sum()))


def _common_prefixes(indptr: np.ndarray, indices: np.ndarray, npages: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per group (rows starts[g] .. starts[g+1]-1): the leading pages all its rows list, at most each
    row's page count minus one (whole pages only). One pass over a [B, max pages] table: a row's
    match length against its group's first row, then the minimum per group (equality with the first
    row is transitive, so that is the common prefix)."""
    B = npages.shape[0]
    col = np.arange(int(npages.max()))
    pos = np.minimum(indptr[:-1, None] + col, indices.shape[0] - 1)
    table = np.where(col < npages[:, None], indices[pos], -1)
    leader = np.repeat(starts, np.diff(np.append(starts, B)))
    cap = np.minimum(npages, npages[leader]) - 1
    same = (table == table[leader]) & (col < cap[:, None])
    match = np.argmin(np.concatenate([same, np.zeros((B, 1), dtype=bool)], axis=1), axis=1)
    return np.minimum.reduceat(match, starts)
