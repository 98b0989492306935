"""Python entry points of the C++ CPU ops used by the engine's CPU decode path.

Each wrapper allocates the output when none is given and calls torch.ops.rlengine.<name>
(csrc/<name>.cpp). When the extension lacks the op, the wrapper raises with the build command
instead of silently falling back: choosing a fallback is the attention backend's decision,
made once through rlengine._ext.has_op.
"""

from __future__ import annotations

import torch

from rlengine import _ext


def _require(name: str) -> None:
    if not _ext.has_op(name):
        why = f" (load error: {_ext.LOAD_ERROR})" if _ext.LOAD_ERROR else ""
        raise RuntimeError(f"rlengine C++ op '{name}' is not available{why}; build it with "
                           f"`python setup.py build_ext --inplace` or use the torch reference path")


def paged_decode_cpp(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, sm_scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """CPU paged decode attention (csrc/paged_decode.cpp); returns out [B, H, D] in q.dtype.

    q [B, H, D] (contiguous last dim); k_cache, v_cache [num_blocks, P, Hkv, D] contiguous;
    kv_indptr int32 [B+1], kv_indices int32 [kv_indptr[-1]], kv_last_page_len int32 [B] in 1..P.
    fp32, fp16 or bf16, fp32 accumulation. out (contiguous, q's shape and dtype) is written in
    place; the op validates the page tables against the cache before reading it.
    """
    _require("paged_decode")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.rlengine.paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, float(sm_scale),
                                    out)
    return out
