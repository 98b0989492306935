"""GPU (or interpreter) decode backend: rlengine's own Triton split-KV paged-decode kernel.

graph_safe: the kernel reads the page tables from device tensors and each sequence splits its
own pages, so the launch depends only on the batch size and on the split count plan() takes from
max_num_pages, which a graph's batch fixes at capture. Graph buckets capture one graph per split
class (graph_page_bounds: 1, 2, 4, ... splits up to what the SMs need), so a context that one split
covers runs no merge launch. `num_sms` overrides the device's SM count in split planning (the CPU
launch counter plans as on a 132-SM H100/H200 under the interpreter). Shared-prefix decode (eager steps
only): a step with forked siblings runs kernels/cascade_decode.py on plan()'s cascade tables,
uploaded once per step (one non_blocking copy from a pinned buffer on a GPU).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from rlengine.engine.attention.base import AttentionBackend


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True
    supports_shared_prefix = True
    # off unless asked: on an H200 (docs/RESULTS.md) the cascade op took 3.6x the plain kernel's time at the
    # 512-token GRPO shape (Qwen3-0.6B, bf16): its prefix pass runs one program per (group, KV head)
    shared_prefix_by_default = False

    @staticmethod
    def unavailable_reason(device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU correctness runs)"
        return None

    def __init__(self, kv_cache, num_heads, head_dim, max_num_seqs, num_sms: int | None = None):
        super().__init__(kv_cache, num_heads, head_dim, max_num_seqs)
        from rlengine.kernels import paged_decode as pd

        self._pd = pd
        self.num_splits = 1  # the split count plan() chose for this step
        self.plan_for_sms(num_sms)
        device = kv_cache.data.device
        self.out = torch.empty(max_num_seqs, num_heads, head_dim, dtype=kv_cache.data.dtype, device=device)
        from rlengine.kernels import cascade_decode as cd

        self._cd = cd
        G = num_heads // kv_cache.data.shape[4]
        self.cascade_max_rows = max(1, cd.max_rows_per_program(kv_cache.data.dtype) // G)
        self.cascade_workspace = cd.alloc_cascade_workspace(max_num_seqs, num_heads, head_dim, device)
        # cascade tables: two pinned staging buffers taken in turn (under overlap a step's copy may still be
        # pending while the next step is planned) and one device buffer; grown in plan()
        self._tables_hosts = [torch.empty(0, dtype=torch.int32)] * 2
        self._tables_dev = self._tables_hosts[0]
        self._tables_slot = 0
        self.cascade = None

    def plan_for_sms(self, num_sms: int | None) -> None:
        """Plan splits for num_sms SMs (None: the device's); the workspace is sized to the most splits the
        heuristic can then pick for this many KV heads."""
        self.num_sms = num_sms
        self._bounds: dict[tuple[int, int], list[int]] = {}
        self.workspace = self._pd.alloc_workspace(self.max_num_seqs, self.num_heads, self.head_dim,
                                                  self._pd.MAX_SPLITS, self.kv.data.device,
                                                  num_kv_heads=self.kv.data.shape[4], num_sms=num_sms)

    def splits(self, batch_size: int, max_num_pages: int) -> int:
        """KV splits of a decode step of batch_size rows whose longest sequence holds max_num_pages pages."""
        s = self._pd.choose_num_splits(batch_size, self.kv.data.shape[4], max_num_pages, self.kv.block_size,
                                       self.kv.data.device, self.num_sms)
        return max(1, min(s, self.workspace.max_splits(batch_size)))

    def graph_page_bounds(self, bs: int, max_pages: int) -> list[int]:
        """The largest page count planned with 1, 2, 4, ... splits, then max_pages (capacity); cached."""
        hit = self._bounds.get((bs, max_pages))
        if hit is not None:
            return hit
        bounds, s, cap = [], 1, self.splits(bs, max_pages)
        while s < cap:
            lo, hi = 1, max_pages  # the largest m with splits(m) <= s (splits is monotone in m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.splits(bs, mid) <= s else (lo, mid - 1)
            if not bounds or lo > bounds[-1]:
                bounds.append(lo)
            s *= 2
        hit = self._bounds[bs, max_pages] = [b for b in bounds if b < max_pages] + [max_pages]
        return hit

    def plan(self, batch) -> None:
        super().plan(batch)
        if batch.kind == "decode":
            self.num_splits = self.splits(batch.batch_size, batch.max_num_pages)
        plan = self.plan_shared_prefix(batch)
        self.cascade = None
        if plan is None:
            return
        arrays = (plan.chunk_indptr, plan.prefix_indptr, plan.prefix_indices, plan.suffix_indptr, plan.suffix_indices)
        n = sum(a.shape[0] for a in arrays)
        if n > self._tables_dev.numel():  # rare: the batch's page count grew past every earlier step's
            self._alloc_tables(2 * n)
        self._tables_slot ^= 1
        staging = self._tables_hosts[self._tables_slot]
        host, parts, at = staging.numpy(), [], 0
        for a in arrays:
            host[at:at + a.shape[0]] = a
            parts.append(self._tables_dev[at:at + a.shape[0]])
            at += a.shape[0]
        if self._tables_dev is not staging:
            self._tables_dev[:at].copy_(staging[:at], non_blocking=True)
        suffix_pages = int(np.diff(plan.suffix_indptr).max())
        self.cascade = (parts, plan.max_rows, suffix_pages)

    def _alloc_tables(self, n: int) -> None:
        """The cascade tables' staging (pinned on a GPU) and device buffers, n int32 entries."""
        if self.out.device.type == "cuda":
            self._tables_hosts = [torch.empty(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self._tables_dev = torch.empty(n, dtype=torch.int32, device=self.out.device)
        else:  # the interpreter reads host memory: one buffer is staging and device copy at once
            self._tables_hosts = [torch.empty(n, dtype=torch.int32)] * 2
            self._tables_dev = self._tables_hosts[0]

    def decode(self, layer_id, q_BHD, k_cache, v_cache):
        b = self.batch
        if self.cascade is not None:
            (chunks, prefix_ptr, prefix_idx, suffix_ptr, suffix_idx), max_rows, suffix_pages = self.cascade
            return self._cd.cascade_decode(q_BHD, k_cache, v_cache, chunks, prefix_ptr, prefix_idx, suffix_ptr,
                                           suffix_idx, b.kv_last_page_len, sm_scale=self.scale, max_rows=max_rows,
                                           max_suffix_pages=suffix_pages, workspace=self.cascade_workspace,
                                           out=self.out[: q_BHD.shape[0]])
        return self._pd.paged_decode(q_BHD, k_cache, v_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                                     sm_scale=self.scale, max_num_pages=b.max_num_pages,
                                     out=self.out[: q_BHD.shape[0]], workspace=self.workspace,
                                     num_splits=self.num_splits)
