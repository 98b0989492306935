"""Attention contexts: how one decoder forward attends, chosen by the caller.

The model computes q, k, v for the packed tokens of a batch and hands them to
`ctx.attend(layer_id, q, k, v)`. The learner and the parity tests use the causal contexts
here (no cache); the engine passes its paged-KV attention backend (rlengine/engine/attention),
which writes k/v into the cache and reads the context from it. Step metadata lives on the
context object, never in module globals.

Dimension legend: T packed tokens, B sequences, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from rlengine.model import ext as _ext

TILED = _ext.has_op("prefill_attention")  # csrc/prefill_attention.cpp (AVX-512 builds)


class AttentionContext(Protocol):
    def attend(self, layer_id: int, q_THD: torch.Tensor, k_TKD: torch.Tensor,
               v_TKD: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> o [T, H, D] (same dtype as q)."""
        ...


def sdpa_causal(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence laid out [T, heads, D]; GQA by head grouping.

    As a batch of one: SDPA's flash kernels take 4-D inputs only, and 3-D ones fall back to the math
    path, which keeps the [heads, T, T] fp32 probabilities for the backward (quadratic in T)."""
    o = F.scaled_dot_product_attention(q_THD.transpose(0, 1)[None], k_TKD.transpose(0, 1)[None],
                                       v_TKD.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


class DenseCausal:
    """B equal-length sequences packed row-major from a [B, S] input: one batched SDPA call."""

    def __init__(self, batch: int, seqlen: int, scale: float):
        self.batch, self.seqlen, self.scale = batch, seqlen, scale

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        B, S = self.batch, self.seqlen
        q = q_THD.view(B, S, *q_THD.shape[1:]).transpose(1, 2)
        k = k_TKD.view(B, S, *k_TKD.shape[1:]).transpose(1, 2)
        v = v_TKD.view(B, S, *v_TKD.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(q_THD.shape)


class PackedCausal:
    """Variable-length sequences packed along T, boundaries in cu_seqlens [B+1] (host list).

    Two layouts, the same result:
    - padded: right-pad the sequences into one [B, S_max] batch and run a single causal SDPA.
      With the padding at the end, causality alone keeps every real query off the padding keys,
      so no mask is needed; padded query rows are dropped on the way back. Sequences of one
      length need no padding: the packed rows are viewed as [B, S] (no copies either way).
    - loop: one SDPA call per sequence.
    Padded is used when gradients flow (the learner) or on a GPU (one flash kernel instead of
    B launches), as long as padding at most doubles the work (B * S_max <= 2T). On the CPU,
    bench/bench_packed_attention.py measured padded forward + backward 1.0-5.2x faster than the
    loop (B 8-128, L 64-256; the gain grows with B) and a whole qwen3-30m GRPO step 1.24-1.28x
    faster. A forward alone (the engine's prefill) was 0.72-1.38x, so CPU inference keeps the loop.
    layout="padded" / "loop" forces one (benchmarks, tests).
    A CPU forward without autograd (the engine's prefill) in "auto" takes the implementation the
    process's kernel choices (model/ops.KERNELS) measured fastest for its shape class: the loop
    ("torch"), the padded call, for bf16 the loop on fp32 copies ("upcast": torch's bf16 flash
    kernel can be slower than its fp32 one on a CPU without AMX), or the C++ kernel over the packed
    rows ("tiled", csrc/prefill_attention.cpp); see prefill_candidates. A pinned
    table without the shape class keeps the loop (tables saved before this choice existed).
    """

    MAX_PAD_FACTOR = 2.0
    LAYOUTS = ("auto", "padded", "loop")

    def __init__(self, cu_seqlens: list[int], scale: float, layout: str = "auto"):
        if layout not in self.LAYOUTS:
            raise ValueError(f"PackedCausal layout must be one of {self.LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        self.scale = scale
        lens = [b - a for a, b in self.bounds]
        self.max_len = max(lens, default=0)
        total = cu_seqlens[-1] - cu_seqlens[0]
        self.can_pad = len(lens) > 1 and len(lens) * self.max_len <= self.MAX_PAD_FACTOR * total
        self._flat: torch.Tensor | None = None  # [T] row of each token in the padded [B * S_max] layout
        self._impl: str | None = None  # the CPU no-grad implementation, chosen at the first attend()
        self._cu: torch.Tensor | None = None  # cu_seqlens as an int64 tensor ("tiled")

    def _flat_index(self, device: torch.device) -> torch.Tensor:
        if self._flat is None or self._flat.device != device:
            S = self.max_len
            idx = torch.cat([torch.arange(i * S, i * S + (b - a)) for i, (a, b) in enumerate(self.bounds)])
            if device.type == "cuda":  # pinned: the copy is queued without a wait on pageable memory
                idx = idx.pin_memory()
            self._flat = idx.to(device, non_blocking=True)  # built once per step, shared by every layer
        return self._flat

    def attend(self, layer_id, q_THD, k_TKD, v_TKD):
        if (self.layout == "auto" and q_THD.device.type == "cpu" and not q_THD.requires_grad
                and q_THD.dtype in (torch.float32, torch.bfloat16) and q_THD.shape[0] > 0):
            return self._run(self._chosen(q_THD, k_TKD, v_TKD), q_THD, k_TKD, v_TKD)
        if len(self.bounds) == 1:
            return sdpa_causal(q_THD, k_TKD, v_TKD, self.scale)
        if self.layout == "auto":
            padded = self.can_pad and (q_THD.requires_grad or q_THD.is_cuda)
        else:
            padded = self.layout == "padded"
        if not padded:
            return torch.cat([sdpa_causal(q_THD[a:b], k_TKD[a:b], v_TKD[a:b], self.scale) for a, b in self.bounds])
        return self._padded(q_THD, k_TKD, v_TKD)

    def _padded(self, q_THD, k_TKD, v_TKD):
        """One right-padded SDPA call over all sequences (equal lengths: views, no padding copies)."""
        B, S = len(self.bounds), self.max_len
        if B * S == q_THD.shape[0]:  # every sequence S long: the packed rows are already [B, S]
            return DenseCausal(B, S, self.scale).attend(0, q_THD, k_TKD, v_TKD)
        flat = self._flat_index(q_THD.device)

        def pad(x_TND):  # [T, heads, D] -> [B, heads, S, D], zeros in the padding
            out = x_TND.new_zeros(B * S, *x_TND.shape[1:]).index_copy(0, flat, x_TND)
            return out.view(B, S, *x_TND.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(pad(q_THD), pad(k_TKD), pad(v_TKD), is_causal=True, scale=self.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(B * S, *q_THD.shape[1:]).index_select(0, flat)

    # ---- the CPU no-grad path: an implementation chosen by measurement (model/kernel_choice.py)

    def _run(self, impl: str, q_THD, k_TKD, v_TKD):
        if impl == "tiled":
            if self._cu is None:
                self._cu = torch.tensor([self.bounds[0][0]] + [b for _, b in self.bounds], dtype=torch.int64)
            return torch.ops.rlengine.prefill_attention(q_THD, k_TKD, v_TKD, self._cu, self.scale)
        if impl == "padded":
            return self._padded(q_THD, k_TKD, v_TKD)
        if impl == "upcast":  # fp32 copies in, the result rounded back to bf16
            return self._loop(q_THD.float(), k_TKD.float(), v_TKD.float()).to(q_THD.dtype)
        return self._loop(q_THD, k_TKD, v_TKD)

    def _loop(self, q_THD, k_TKD, v_TKD):
        if len(self.bounds) == 1:
            return sdpa_causal(q_THD, k_TKD, v_TKD, self.scale)
        return torch.cat([sdpa_causal(q_THD[a:b], k_TKD[a:b], v_TKD[a:b], self.scale) for a, b in self.bounds])

    def _chosen(self, q_THD, k_TKD, v_TKD) -> str:
        """This step's implementation (decided once per step: every layer has the same shapes)."""
        if self._impl is None:
            from rlengine.model.ops import KERNELS  # ops imports nothing of this module; lazy for import order
            key = prefill_key(q_THD.dtype, len(self.bounds), self.max_len, q_THD.shape[1], k_TKD.shape[1],
                              q_THD.shape[2])
            impl = KERNELS.memo.get(key)
            if impl is None and KERNELS.mode == "pinned" and key not in KERNELS.table:
                impl = "torch"  # a table saved before this choice existed: the fixed rule it was saved with
            if impl is None:
                names = prefill_candidates(q_THD.dtype, self.can_pad, q_THD.shape[2])
                if self.bounds[0][0] != 0 or self.bounds[-1][1] != q_THD.shape[0]:
                    names = [n for n in names if n != "tiled"]  # the kernel takes rows [0, T) exactly
                cands = {name: (lambda n=name: self._run(n, q_THD, k_TKD, v_TKD)) for name in names}
                impl = KERNELS.choose(key, cands, rule="torch")
                KERNELS.memo[key] = impl
            self._impl = impl
        return self._impl


def prefill_candidates(dtype: torch.dtype, can_pad: bool, head_dim: int) -> list[str]:
    """The CPU no-grad causal attention implementations for a batch: "torch" (one SDPA per sequence,
    torch's own op), "padded" (one right-padded SDPA, where padding at most doubles the work),
    "upcast" (bf16: the per-sequence SDPA on fp32 copies), "tiled" (csrc/prefill_attention.cpp over the
    packed rows: AVX-512 builds, head_dim a multiple of 16 up to 256; on a 2-core EPYC, 16 x 8 heads of
    128, one thread: fp32 0.58x SDPA's time at 256-512 tokens and 0.95x at 2048, bf16 0.43-0.51x at 64-512
    and 0.71x at 2048)."""
    tiled = TILED and head_dim % 16 == 0 and 0 < head_dim <= 256
    return (["torch"] + (["padded"] if can_pad else []) + (["upcast"] if dtype == torch.bfloat16 else [])
            + (["tiled"] if tiled else []))


def prefill_key(dtype: torch.dtype, num_seqs: int, max_len: int, H: int, Hkv: int, D: int) -> str:
    """The shape class of a causal-attention choice, e.g. "attention/bfloat16/S=512/B=4/16x8x128":
    the longest sequence and the sequence count by kernel_choice.rows_class, the head shape exact."""
    from rlengine.model.kernel_choice import rows_class
    return (f"attention/{str(dtype).removeprefix('torch.')}/S={rows_class(max_len)}/B={rows_class(num_seqs)}/"
            f"{H}x{Hkv}x{D}")


def decide_prefill(cfg, dtype: torch.dtype, lengths: list[int], batches: list[int]) -> None:
    """Make the CPU causal-attention choices of model config `cfg` for B prompts of S tokens (every B in
    `batches`, S in `lengths`), now, on random inputs: fills model/ops.KERNELS (`rlengine info --kernels`)."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with torch.inference_mode():
        for S in lengths:
            for B in batches:
                q, k, v = (torch.randn(B * S, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
                PackedCausal(list(range(0, B * S + 1, S)), D ** -0.5).attend(0, q, k, v)
