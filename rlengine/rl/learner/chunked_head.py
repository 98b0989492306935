"""The learner's torch log-prob head, chunked over tokens: per-token log p(target) and entropy, no [T, V].

Where the fused Triton kernel does not run (the CPU learner), the head computes the same quantity
in plain torch, but a few rows at a time: the forward walks T in chunks of `chunk_tokens` rows under
no_grad and keeps only the per-token outputs; the backward recomputes each chunk's logits with
autograd on and backpropagates that chunk alone, so at any moment one [T_c, V] block (and its
gradient) exists instead of the [T, V] fp32 logits, their log_softmax and exp kept for autograd.
The head function is any row-wise map (h_c, W, targets_c) -> (logp_c, entropy_c): the raw
definition (kernels.fused_logprob.fused_logprob_ref) and the processed one (top-k / top-p filtered,
engine.sampler.sequence_logprobs) both run through it. The LM head is upcast to fp32 once per pass
(not per chunk), and grad_W is summed over chunks in fp32. With one chunk the ops, and so the bits,
are those of the unchunked head. Dims: T tokens, C hidden, V vocab, T_c rows of one chunk.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# rows per chunk: one [T_c, V] fp32 block of 2**23 elements (32 MiB, 55 rows at V = 151,936); the
# memory plan (analysis/activations.py) counts the head's workspace from the same numbers
from rlengine.analysis.activations import head_chunk_tokens as chunk_tokens_for

HeadFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _acc_dtype(w: Tensor) -> torch.dtype:
    return torch.promote_types(w.dtype, torch.float32)  # fp32, or fp64 for a float64 model


class ChunkedHeadFunction(torch.autograd.Function):
    """(h_TC, w_VC, targets_T) -> (logp_T, entropy_T), fp32; saves h, W and targets only."""

    @staticmethod
    def forward(ctx, h_TC, w_VC, targets_T, head_fn: HeadFn, chunk_tokens: int):
        w_acc = w_VC.to(_acc_dtype(w_VC))  # once per pass: no copy for an fp32 head
        parts = [head_fn(h_TC[a:a + chunk_tokens], w_acc, targets_T[a:a + chunk_tokens])
                 for a in range(0, h_TC.shape[0], chunk_tokens)]
        ctx.save_for_backward(h_TC, w_VC, targets_T)
        ctx.head_fn, ctx.chunk_tokens = head_fn, chunk_tokens
        ctx.set_materialize_grads(False)
        if not parts:
            empty = h_TC.new_zeros(0, dtype=torch.float32)
            return empty, empty.clone()
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        h_TC, w_VC, targets_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = [(i, g) for i, g in enumerate((g_logp_T, g_ent_T)) if g is not None]
        if not grads or not (need_h or need_w):
            return None, None, None, None, None
        step, T = ctx.chunk_tokens, h_TC.shape[0]
        w_acc = w_VC.detach().to(_acc_dtype(w_VC)).requires_grad_(need_w)
        grad_h = torch.empty_like(h_TC) if need_h else None
        grad_w = None
        for a in range(0, T, step):
            h_c = h_TC[a:a + step].detach().requires_grad_(need_h)
            with torch.enable_grad():
                outs = ctx.head_fn(h_c, w_acc, targets_T[a:a + step])
            inputs = [x for x, need in ((h_c, need_h), (w_acc, need_w)) if need]
            got = torch.autograd.grad([outs[i] for i, _ in grads], inputs, [g[a:a + step] for _, g in grads],
                                      allow_unused=True)
            got = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, got)]
            if need_h:
                grad_h[a:a + step] = got[0]
            if need_w:
                gw = got[-1]
                grad_w = gw if grad_w is None else grad_w.add_(gw)  # fp32 sum over chunks
        if grad_w is not None:
            grad_w = grad_w.to(w_VC.dtype)
        return grad_h, grad_w, None, None, None


def chunked_head(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, head_fn: HeadFn, *,
                 chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """(logp_T, entropy_T) fp32 of head_fn over row chunks; differentiable in h_TC and w_VC.

    h_TC: [T, C]; w_VC: [V, C] (the head_fn receives it upcast to fp32); targets_T: [T] int64.
    chunk_tokens: rows per chunk (default chunk_tokens_for(V)). Extra memory: the fp32 head copy
    (none for an fp32 model) and one chunk's [T_c, V] logits with their autograd graph.
    """
    if h_TC.dim() != 2 or w_VC.dim() != 2 or h_TC.shape[1] != w_VC.shape[1]:
        raise ValueError(f"chunked_head: h_TC must be [T, C] and w_VC [V, C], got {tuple(h_TC.shape)}, "
                         f"{tuple(w_VC.shape)}")
    if targets_T.shape != (h_TC.shape[0],):
        raise ValueError(f"chunked_head: targets_T must be [T]=({h_TC.shape[0]},), got {tuple(targets_T.shape)}")
    step = chunk_tokens_for(w_VC.shape[0]) if chunk_tokens is None else chunk_tokens
    if step < 1:
        raise ValueError(f"chunked_head: chunk_tokens must be >= 1, got {step}")
    return ChunkedHeadFunction.apply(h_TC, w_VC, targets_T, head_fn, step)
