"""The shared-prefix planner (rlengine/engine/attention/cascade.py) on hand-written page tables.

Each case says which rule it covers: forked siblings found from common block ids, whole pages only
(each row keeps its last page), a split group (members gone) planned as a smaller group or as plain
decode, siblings that are not adjacent in the batch, groups cut into chunks, no sharing at all.
"""

import numpy as np

from rlengine.engine.attention.cascade import plan_cascade


def _tables(rows):
    indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
    return indptr, np.array([b for r in rows for b in r], dtype=np.int32)


def _levels(plan, indptr, indices):
    """Per row: (its chunk's prefix pages, its own pages); prefix + own must be the row's table."""
    out = []
    for c in range(len(plan.chunk_indptr) - 1):
        pre = plan.prefix_indices[plan.prefix_indptr[c]:plan.prefix_indptr[c + 1]].tolist()
        for b in range(plan.chunk_indptr[c], plan.chunk_indptr[c + 1]):
            own = plan.suffix_indices[plan.suffix_indptr[b]:plan.suffix_indptr[b + 1]].tolist()
            assert pre + own == indices[indptr[b]:indptr[b + 1]].tolist()
            out.append((pre, own))
    return out


def test_group_shares_its_common_whole_pages():
    rows = [[7, 3, 9, 20], [7, 3, 9, 21], [7, 3, 9, 22, 30]]
    plan = plan_cascade(*_tables(rows))
    assert _levels(plan, *_tables(rows)) == [([7, 3, 9], [20]), ([7, 3, 9], [21]), ([7, 3, 9], [22, 30])]
    assert plan.shared_pages == 2 * 3 and plan.max_rows == 3


def test_last_page_always_stays_with_its_row():
    """Row 0 lists nothing but the shared pages: its last one stays in its own level (whole pages only)."""
    rows = [[5, 6], [5, 6, 8], [5, 6, 9]]
    levels = _levels(plan_cascade(*_tables(rows)), *_tables(rows))
    assert levels == [([5], [6]), ([5], [6, 8]), ([5], [6, 9])]


def test_prefix_stops_at_the_first_differing_page():
    rows = [[1, 2, 3, 4], [1, 2, 8, 9]]
    assert _levels(plan_cascade(*_tables(rows)), *_tables(rows)) == [([1, 2], [3, 4]), ([1, 2], [8, 9])]


def test_split_group_and_singletons():
    """Two groups, one reduced to a single member (plain decode for it), and an unrelated row."""
    rows = [[1, 2, 10], [1, 2, 11], [4, 5, 12], [6, 13]]
    plan = plan_cascade(*_tables(rows))
    levels = _levels(plan, *_tables(rows))
    assert levels == [([1, 2], [10]), ([1, 2], [11]), ([], [4, 5, 12]), ([], [6, 13])]


def test_no_sharing_is_no_plan():
    assert plan_cascade(*_tables([[1, 2], [3, 4], [5]])) is None
    assert plan_cascade(*_tables([[1], [1]])) is None  # a shared partial page only: nothing whole to share
    assert plan_cascade(*_tables([[1, 2]])) is None


def test_siblings_apart_in_the_batch_are_separate_groups():
    rows = [[1, 2, 10], [3, 11], [1, 2, 12], [1, 2, 13]]
    levels = _levels(plan_cascade(*_tables(rows)), *_tables(rows))
    assert levels == [([], [1, 2, 10]), ([], [3, 11]), ([1, 2], [12]), ([1, 2], [13])]


def test_long_group_is_cut_into_chunks():
    rows = [[1, 2, 10 + i] for i in range(5)]
    plan = plan_cascade(*_tables(rows), max_rows=2)
    assert plan.chunk_indptr.tolist() == [0, 2, 4, 5] and plan.max_rows == 2
    levels = _levels(plan, *_tables(rows))
    assert [pre for pre, _ in levels] == [[1, 2]] * 4 + [[]]  # the last chunk has one row: plain decode
