"""Step inputs: one step's ForwardBatch and SamplingBatch, built from persistent per-row state.

Each sequence holding KV blocks owns a row (BlockManager rows). Per row the host keeps numpy
arrays: its page table (BlockManager.tables), context length (one more at every launch) and last
token (at every read), and its sampling parameters (written when the sequence is prefilled:
admission or recompute). A decode step reads its batch from these arrays with a few vectorised
numpy ops; nothing is rebuilt from Python lists, and while the batch's rows and tables stay the
same (BlockManager.version) the page tables and sampling rows of the last step are reused.

A step writes every input it needs (ids, positions, slot mapping, page tables, logits rows,
copy-on-write pairs, sampling rows) into ONE byte buffer, pinned on a GPU, and moves it to the
device in one non_blocking copy; the batch's tensors are typed views of the device copy. On a
CPU the staging buffer is the device buffer (no copy). Sections sit in a fixed order, each
sized by the step's counts; a decode step padded to a CUDA-graph bucket bs uses counts that
depend on bs only (capacities), so its graph inputs land at the same addresses every time:
eager steps and graph replays go through the same prepare().
Dimension legend: T tokens, B sequences in the forward, N samples, C copy-on-write pairs, P page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlengine.engine.block_manager import BlockManager
from rlengine.engine.sampler import FILTERED, SEEDED, draw_keys, sample_kind
from rlengine.engine.scheduler import ScheduledBatch
from rlengine.engine.sequence import Sequence
from rlengine.engine.forward_batch import ForwardBatch, SamplingBatch

# (name, dtype) of each section of the staging buffer, in buffer order. The graph-read sections
# come first or are sized by capacity, and kv_indices (the only one of variable length in a
# padded decode step) comes last.
SECTIONS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
            ("logits_indices", np.int64), ("logits_rows", np.int64), ("copies", np.int64),
            ("seed_keys", np.int64), ("top_k", np.int64), ("temperature", np.float32), ("top_p", np.float32),
            ("kind", np.int32), ("prev_index", np.int64), ("kv_indptr", np.int32), ("kv_last_page_len", np.int32),
            ("kv_indices", np.int32))
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


def _offsets(counts: tuple[int, ...]) -> list[int]:
    """Byte offset of each section (8-byte aligned) for the element counts, plus the end offset."""
    out, at = [], 0
    for (_, dtype), n in zip(SECTIONS, counts):
        out.append(at)
        at += -(-n * np.dtype(dtype).itemsize // 8) * 8
    return out + [at]


@dataclass(slots=True)
class PreparedStep:
    """What prepare() built for one step."""

    fb: ForwardBatch
    sb: SamplingBatch
    copies: tuple[torch.Tensor, torch.Tensor] | None  # copy-on-write src [C], dst [C] int64 block ids
    sample_rows: np.ndarray                          # [N] int64 engine row of each sample (host)
    prev_index: torch.Tensor | None = None           # overlap: [B] int64 index of each input token in the
    #                                                  in-flight step's sampled tokens, -1: on the host


@dataclass(slots=True)
class _DecodeTables:
    """What a decode step reuses from the previous one while its rows and block tables are unchanged."""

    key: tuple                      # (rows bytes, bucket size, BlockManager.version)
    host: dict                      # numpy views of the staging sections
    dev: dict                       # device tensor views
    host_t: dict                    # host tensor views
    indices: torch.Tensor           # kv_indices device view
    indices_host: np.ndarray        # kv_indices host view (the staging buffer)
    nbytes: int                     # staging bytes the step uploads
    longest: int                    # max_num_pages
    copies: tuple | None            # copy-on-write (src, dst) device views
    sb: SamplingBatch


class StepInputs:
    """Per-row host state, the staging buffer and its device copy; prepare() per step.

    overlap (LLM(async_scheduling=True)): a step is prepared while the previous one still runs, so
    its input tokens may not be on the host yet. Each sample's row then records which launched step
    samples its next token and where (pending_step / pending_index); prepare() writes, per input,
    that index into the in-flight step's tokens (prev_index, -1 when the token is on the host) for
    the runner to gather on the device. On a GPU the staging buffer is doubled (a step's non_blocking
    copy may still be pending when the next step is written), and the decode-table reuse is off.
    """

    def __init__(self, bm: BlockManager, device: torch.device, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_pages_per_seq: int, null_block: int, vocab_size: int, overlap: bool = False):
        self.bm, self.device, self.P = bm, device, bm.block_size
        self.null_block, self.vocab_size, self.max_pages = null_block, vocab_size, max_pages_per_seq
        R = bm.tables.shape[0]
        self.ctx_len = np.zeros(R, np.int64)       # len(seq): tokens so far, the last one not yet in the cache
        self.last_token = np.zeros(R, np.int64)    # seq.token_ids[-1]
        self.temperature = np.ones(R, np.float32)  # 1.0 for greedy rows
        self.top_k = np.zeros(R, np.int64)
        self.top_p = np.ones(R, np.float32)
        self.kind = np.zeros(R, np.int32)          # sampler.sample_kind bits
        self.seed_key = np.zeros(R, np.uint64)     # sampling_params.sample_seed of seeded rows
        self.pending_step = np.full(R, -1, np.int64)  # overlap: launched step that samples the row's next token
        self.pending_index = np.zeros(R, np.int64)    # overlap: its index among that step's samples
        self.overlap = overlap
        B, T = max_num_seqs, max(max_num_batched_tokens, max_num_seqs)
        # a prefill's pages: its sequences' whole contexts (a trajectory's chunk attends its cached tokens too)
        prefill = (T, T, T, B, B, 2 * B, B, B, B, B, B, 0, B + 1, B, max(T // self.P + B, B * max_pages_per_seq))
        decode = (B, B, B, 0, 0, 2 * B, B, B, B, B, B, B, B + 1, B, B * max_pages_per_seq)
        nbytes = max(_offsets(prefill)[-1], _offsets(decode)[-1])
        cuda = device.type == "cuda"
        copies = 2 if overlap and cuda else 1
        self._hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(copies)]
        self._hosts_np = [h.numpy() for h in self._hosts]
        self._slot = 0  # which staging buffer this step writes
        self.dev = self._hosts[0] if not cuda else torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._arange = np.arange(max(T, B * max_pages_per_seq) + B, dtype=np.int64)
        self._views: dict[tuple, tuple[dict, dict, dict, int]] = {}
        self._reuse: _DecodeTables | None = None  # the last decode step's tables, valid until staging is rewritten

    @property
    def host(self) -> torch.Tensor:
        """The staging buffer this step writes (pinned on a GPU)."""
        return self._hosts[self._slot]

    def _decode_counts(self, bs: int, copies: int, pages: int) -> tuple[int, ...]:
        return (bs, bs, bs, 0, 0, 2 * copies, bs, bs, bs, bs, bs, bs if self.overlap else 0, bs + 1, bs, pages)

    def _sections(self, counts: tuple[int, ...]) -> tuple[dict, dict, dict, int]:
        """(host numpy views, device tensor views, host tensor views, kv_indices byte offset), cached by
        every count but kv_indices' (the views of the fixed sections do not depend on it)."""
        key = (self._slot,) + counts[:-1]
        hit = self._views.get(key)
        if hit is None:
            offs = _offsets(counts[:-1] + (0,))
            host, dev, host_t = {}, {}, {}
            for (name, dtype), n, at in zip(SECTIONS[:-1], counts[:-1], offs):
                size = n * np.dtype(dtype).itemsize
                host[name] = self._hosts_np[self._slot][at:at + size].view(dtype)
                dev[name] = self.dev[at:at + size].view(_TORCH[dtype])
                host_t[name] = self.host[at:at + size].view(_TORCH[dtype])
            if len(self._views) > 512:  # prefill layouts vary with T: keep the cache bounded
                self._views.clear()
            hit = self._views[key] = (host, dev, host_t, offs[len(SECTIONS) - 1])
        return hit

    def _indices(self, at: int, n: int) -> tuple[np.ndarray, torch.Tensor]:
        return self._hosts_np[self._slot][at:at + 4 * n].view(np.int32), self.dev[at:at + 4 * n].view(torch.int32)

    # ---- per-row state ----------------------------------------------------------------------------
    def _write_rows(self, samples: list[Sequence], rows: np.ndarray, ctx: np.ndarray) -> None:
        """A prefill's samples (admitted or recomputed): their context lengths and sampling parameters."""
        self.ctx_len[rows] = ctx
        temperature, top_k, top_p, kind, key = [], [], [], [], []
        for seq in samples:
            p = seq.params
            temperature.append(1.0 if p.greedy else p.temperature)
            top_k.append(p.top_k)
            top_p.append(p.top_p)
            kind.append(sample_kind(p, seq.seed_key is not None))
            key.append(seq.seed_key or 0)
        self.temperature[rows], self.top_k[rows], self.top_p[rows] = temperature, top_k, top_p
        self.kind[rows] = kind
        self.seed_key[rows] = np.array(key, dtype=np.uint64)
        self.pending_step[rows] = -1

    def launched(self, prep: PreparedStep, step_id: int | None = None) -> None:
        """The step is on its way: each sample's row is one token longer (its value comes with the read).
        step_id (overlap): remember that step `step_id` samples these rows' next tokens."""
        rows = prep.sample_rows
        self.ctx_len[rows] += 1
        if step_id is not None:
            self.pending_step[rows] = step_id
            self.pending_index[rows] = self._arange[:len(rows)]

    def tokens_read(self, prep: PreparedStep, tokens: np.ndarray, live: np.ndarray | None = None) -> None:
        """The step's sampled tokens [N] are on the host: rows take them as their last token (overlap:
        only the `live` samples [N] bool, whose sequence still holds the row)."""
        rows = prep.sample_rows
        if live is None:
            self.last_token[rows] = tokens
        else:
            self.last_token[rows[live]] = tokens[live]

    # ---- prepare ------------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, pad_to: int | None = None, prev_step: int | None = None) -> PreparedStep:
        """Fill the staging buffer for `batch`, copy it to the device (non_blocking), return the views.

        pad_to: a decode step run in a CUDA-graph bucket of that size (rows B..pad_to-1 are padding:
        token 0 at position 0, one page, the null block). prev_step (overlap): the step still in flight,
        whose tokens some inputs are. No host sync; on a GPU a staging buffer must not be rewritten
        before its copy has run (ordered by the step's output read; overlap alternates two buffers).
        """
        if len(self._hosts) > 1:
            self._slot ^= 1
        if batch.kind == "decode":
            return self._prepare_decode(batch, pad_to, prev_step)
        return self._prepare_prefill(batch)

    def _prepare_decode(self, batch: ScheduledBatch, pad_to: int | None, prev_step: int | None) -> PreparedStep:
        """Per step: ids, positions, slots, last-page lengths and seeded draw keys. The page tables and
        sampling rows are rebuilt only when the batch's rows or any block table changed since the last
        decode step (at small B_act, most steps: a sequence opens a new page every P tokens)."""
        seqs, P = batch.seqs, self.P
        B = len(seqs)
        bs = pad_to or B
        rows = np.array([s.row for s in seqs], dtype=np.int64)
        ctx = self.ctx_len[rows]
        pos = ctx - 1
        page, off = np.divmod(pos, P)
        key = (rows.tobytes(), bs, self.bm.version)
        tables = self._reuse if self._reuse is not None and self._reuse.key == key else None
        if tables is None:
            tables = self._decode_tables(batch, rows, page + 1, bs, pad_to is not None, key)
            self._reuse = None if self.overlap else tables
        host, sb = tables.host, tables.sb
        self.last_token.take(rows, out=host["input_ids"][:B])
        host["positions"][:B] = pos
        slots = host["slot_mapping"][:B]
        np.multiply(self.bm.tables[rows, page], P, out=slots, dtype=np.int64)
        slots += off
        np.add(off, 1, out=host["kv_last_page_len"][:B], casting="unsafe")
        if sb.kinds_any & SEEDED:
            host["seed_keys"][:B] = draw_keys(self.seed_key[rows], ctx).view(np.int64)
        prev_index = None
        if prev_step is not None:
            in_flight = self.pending_step[rows] == prev_step
            np.copyto(host["prev_index"][:B], np.where(in_flight, self.pending_index[rows], -1))
            prev_index = tables.dev["prev_index"][:B]
        self._upload(tables.nbytes)
        dev, host_t = tables.dev, tables.host_t
        fb = ForwardBatch(
            kind="decode", input_ids=dev["input_ids"], positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            qo_indptr=range(bs + 1), kv_indptr=dev["kv_indptr"], kv_indices=tables.indices,
            kv_last_page_len=dev["kv_last_page_len"], kv_indptr_host=host_t["kv_indptr"],
            kv_last_page_len_host=host_t["kv_last_page_len"],
            context_lens=ctx if bs == B else np.concatenate([ctx, np.ones(bs - B, np.int64)]),
            logits_indices=None, max_num_pages=tables.longest, static=False, kv_indices_host=tables.indices_host)
        return PreparedStep(fb, sb, tables.copies if batch.copies else None, rows, prev_index)

    def _decode_tables(self, batch: ScheduledBatch, rows: np.ndarray, npages: np.ndarray, bs: int, padded: bool,
                       key: tuple) -> _DecodeTables:
        """The parts of a decode step that change only with its rows or their block tables: the layout,
        page tables (+ padding rows), copy-on-write pairs and sampling rows, written to staging."""
        B = len(rows)
        indptr_np = np.zeros(B + 1, np.int64)
        npages.cumsum(out=indptr_np[1:])
        total = int(indptr_np[B])
        longest = int(npages.max())
        if padded and longest > self.max_pages:
            raise ValueError(f"a sequence needs {longest} pages, more than the {self.max_pages} a decode graph "
                             "was sized for")
        C = len(batch.copies)
        pad = bs - B
        host, dev, host_t, at = self._sections(self._decode_counts(bs, bs if padded else C, total + pad))
        host["kv_indptr"][:B + 1] = indptr_np
        indices_np, indices = self._indices(at, total + pad)
        self._gather_pages(rows, npages, indptr_np[:B], indices_np[:total], total)
        if pad:
            self._pad(host, B, bs, total, indices_np)
        copies = self._copies(host, dev, batch.copies, bs if padded else C)
        sb = self._sampling(host, dev, rows, B)
        return _DecodeTables(key, host, dev, host_t, indices, indices_np, at + 4 * (total + pad), longest, copies,
                             sb)

    def _pad(self, host: dict, B: int, bs: int, total: int, indices_np: np.ndarray) -> None:
        """Padding rows B..bs-1 of a graph bucket: token 0 at position 0 writing the null block's slot 0."""
        host["input_ids"][B:bs] = 0
        host["positions"][B:bs] = 0
        host["slot_mapping"][B:bs] = self.null_block * self.P
        host["kv_indptr"][B + 1:bs + 1] = self._arange[total + 1:total + 1 + bs - B]
        host["kv_last_page_len"][B:bs] = 1
        indices_np[total:total + bs - B] = self.null_block
        host["top_k"][B:bs], host["kind"][B:bs], host["temperature"][B:bs], host["top_p"][B:bs] = 0, 0, 1, 1

    def _prepare_prefill(self, batch: ScheduledBatch) -> PreparedStep:
        self._reuse = None  # this step rewrites the staging buffer
        seqs, samples, P = batch.seqs, batch.samples, self.P
        B, N = len(seqs), len(samples)
        full = np.fromiter((len(s.token_ids) for s in seqs), np.int64, B)  # tokens attended (context + new)
        starts = None if batch.starts is None else np.asarray(batch.starts, np.int64)
        lens = full if starts is None else full - starts  # this step's tokens per sequence
        T = int(lens.sum())
        rows = np.fromiter((s.row for s in seqs), np.int64, B)
        npages = (full + P - 1) // P
        total = int(npages.sum())
        grouped = N != B
        C = len(batch.copies)
        counts = (T, T, T, B, N if grouped else 0, 2 * C, N, N, N, N, N, 0, B + 1, B, total)
        host, dev, host_t, at = self._sections(counts)
        qo = np.zeros(B + 1, np.int64)
        np.cumsum(lens, out=qo[1:])
        ids = host["input_ids"]
        for r, (seq, a, b) in enumerate(zip(seqs, qo[:-1].tolist(), qo[1:].tolist())):
            ids[a:b] = seq.token_ids if starts is None else seq.token_ids[int(starts[r]):]
        pos = host["positions"]
        np.subtract(self._arange[:T], np.repeat(qo[:-1] if starts is None else qo[:-1] - starts, lens), out=pos)
        page, off = np.divmod(pos, P)
        slots = host["slot_mapping"]
        np.multiply(self.bm.tables[np.repeat(rows, lens), page], P, out=slots, dtype=np.int64)
        slots += off
        np.subtract(qo[1:], 1, out=host["logits_indices"])
        indptr = host["kv_indptr"]
        indptr[0] = 0
        np.cumsum(npages, out=indptr[1:])
        np.subtract(full, (npages - 1) * P, out=host["kv_last_page_len"], casting="unsafe")
        indices_np, indices = self._indices(at, total)
        self._gather_pages(rows, npages, indptr[:B], indices_np, total)
        sample_rows = np.asarray(batch.sample_rows, dtype=np.int64) if grouped else None
        srows = np.fromiter((s.row for s in samples), np.int64, N)
        self._write_rows(samples, srows, full[sample_rows] if grouped else full)
        logits_rows = None
        if grouped:
            host["logits_rows"][:] = sample_rows
            logits_rows = dev["logits_rows"]
        sb = self._sampling(host, dev, srows, N, logits_rows)
        if sb.kinds_any & SEEDED:
            host["seed_keys"][:N] = draw_keys(self.seed_key[srows], self.ctx_len[srows]).view(np.int64)
        copies = self._copies(host, dev, batch.copies, C)  # copy-on-write of a chunk's shared first page
        self._upload(at + 4 * total)
        fb = ForwardBatch(
            kind="prefill", input_ids=dev["input_ids"], positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            qo_indptr=qo.tolist(), kv_indptr=dev["kv_indptr"], kv_indices=indices,
            kv_last_page_len=dev["kv_last_page_len"], kv_indptr_host=host_t["kv_indptr"],
            kv_last_page_len_host=host_t["kv_last_page_len"], context_lens=full,
            logits_indices=dev["logits_indices"], max_num_pages=int(npages.max()), context_start=starts)
        return PreparedStep(fb, sb, copies, srows)

    def _gather_pages(self, rows: np.ndarray, npages: np.ndarray, starts: np.ndarray, out: np.ndarray,
                      total: int) -> None:
        """kv_indices of the batch: row r's first npages[r] table entries, concatenated, into out [total]."""
        tables = self.bm.tables
        flat = np.repeat(rows * tables.shape[1] - starts, npages)
        flat += self._arange[:total]
        np.take(tables.ravel(), flat, out=out)

    def _copies(self, host: dict, dev: dict, pairs: list[tuple[int, int]], cap: int):
        if not pairs:
            return None
        C = len(pairs)
        buf = host["copies"].reshape(2, cap)
        buf[:, :C] = np.array(pairs, dtype=np.int64).T
        d = dev["copies"]
        return d[:C], d[cap:cap + C]

    def _sampling(self, host: dict, dev: dict, srows: np.ndarray, N: int,
                  logits_rows: torch.Tensor | None = None) -> SamplingBatch:
        """The samples' rows of the sampling parameters -> staging; the SamplingBatch of their views
        (the caller writes the seeded draw keys: they change every step)."""
        kinds = host["kind"][:N]
        np.take(self.kind, srows, out=kinds)
        np.take(self.temperature, srows, out=host["temperature"][:N])
        top_k = host["top_k"][:N]
        np.take(self.top_k, srows, out=top_k)
        np.take(self.top_p, srows, out=host["top_p"][:N])
        kinds_any = int(np.bitwise_or.reduce(kinds))
        kinds_all = int(np.bitwise_and.reduce(kinds))
        max_top_k = 0
        if kinds_any & FILTERED:  # the filter's candidate count, from the host on every device
            max_top_k = int(np.where((top_k > 0) & (top_k < self.vocab_size), top_k, 0).max())
        full = dev["kind"].shape[0] == N

        def v(name):
            return dev[name] if full else dev[name][:N]
        return SamplingBatch(num_samples=N, logits_rows=logits_rows, temperature=v("temperature"), top_k=v("top_k"),
                             top_p=v("top_p"), seed_keys=v("seed_keys"), kind=v("kind"), kinds_any=kinds_any,
                             kinds_all=kinds_all, max_top_k=max_top_k)

    def _upload(self, nbytes: int) -> None:
        if self.dev is not self.host:
            self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    # ---- CUDA-graph buckets -------------------------------------------------------------------------
    def static_batch(self, bs: int) -> ForwardBatch:
        """The fixed-address batch of decode bucket bs (page capacity bs * max_pages_per_seq), its host
        fields context_lens / max_num_pages placeholders (the capacity), as graphs capture it."""
        host, dev, host_t, at = self._sections(self._decode_counts(bs, bs, 0))
        _, indices = self._indices(at, bs * self.max_pages)
        return ForwardBatch(
            kind="decode", input_ids=dev["input_ids"], positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            qo_indptr=range(bs + 1), kv_indptr=dev["kv_indptr"], kv_indices=indices,
            kv_last_page_len=dev["kv_last_page_len"], kv_indptr_host=host_t["kv_indptr"],
            kv_last_page_len_host=host_t["kv_last_page_len"], context_lens=np.ones(bs, np.int64),
            logits_indices=None, max_num_pages=self.max_pages, static=True)

    def bucket_views(self, bs: int) -> dict:
        return self._sections(self._decode_counts(bs, bs, 0))[1]  # bucket bs's device section views (graphs)

    def fill_padding(self, bs: int) -> None:
        """Buffers of bucket bs holding padding rows only (what a graph is captured on)."""
        self._reuse = None
        host, _, _, at = self._sections(self._decode_counts(bs, bs, bs))
        indices_np, _ = self._indices(at, bs)
        host["kv_indptr"][0] = 0
        self._pad(host, 0, bs, 0, indices_np)
        self._upload(at + 4 * bs)

