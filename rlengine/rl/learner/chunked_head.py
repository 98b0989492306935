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

The raw definition has its own Function (RawHeadFunction, through raw_chunked_head): the same fp32
logits and log-probs, with the gradient of the logits written out (no autograd replay), the
backward GEMMs in the model's dtype (what autograd does for every other linear), and, when T fits
one chunk, the forward's log-softmax block kept for the backward instead of recomputed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
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
    return ChunkedHeadFunction.apply(h_TC, w_VC, targets_T, head_fn, _check(h_TC, w_VC, targets_T, chunk_tokens,
                                                                            "chunked_head"))


def _check(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, chunk_tokens: int | None, name: str) -> int:
    """The rows per chunk, after checking the shapes (ValueError naming the tensor)."""
    if h_TC.dim() != 2 or w_VC.dim() != 2 or h_TC.shape[1] != w_VC.shape[1]:
        raise ValueError(f"{name}: h_TC must be [T, C] and w_VC [V, C], got {tuple(h_TC.shape)}, "
                         f"{tuple(w_VC.shape)}")
    if targets_T.shape != (h_TC.shape[0],):
        raise ValueError(f"{name}: targets_T must be [T]=({h_TC.shape[0]},), got {tuple(targets_T.shape)}")
    step = chunk_tokens_for(w_VC.shape[0]) if chunk_tokens is None else chunk_tokens
    if step < 1:
        raise ValueError(f"{name}: chunk_tokens must be >= 1, got {step}")
    return step


def _log_softmax_block(h_TC: Tensor, w_acc_VC: Tensor, temperature: float) -> Tensor:
    """log_softmax(h W^T / temperature) of one chunk, [T_c, V] in W's accumulation dtype: the ops of
    fused_logprob_ref (dividing by 1.0 is exact, so it is skipped)."""
    z_TV = F.linear(h_TC.to(w_acc_VC.dtype), w_acc_VC)
    if temperature != 1.0:
        z_TV.div_(temperature)
    return torch.log_softmax(z_TV, dim=-1)


def _grad_logits(logp_TV: Tensor, targets_T: Tensor, ent_T: Tensor, g_logp_T: Tensor | None,
                 g_ent_T: Tensor | None, temperature: float) -> Tensor:
    """d loss / d logits of one chunk, a new [T_c, V] fp32 block (logp_TV is only read). With
    p = exp(logp): d logp_y / dz_j = (1[j = y] - p_j) / t and d entropy / dz_j = -p_j (logp_j + entropy) / t."""
    p_TV = logp_TV.exp()
    if g_ent_T is None:
        g_TV = p_TV.mul_(g_logp_T[:, None] / -temperature)
    else:  # p * (g_logp + g_ent * (entropy + logp)), negated and over t
        c_T = g_ent_T * ent_T if g_logp_T is None else g_logp_T + g_ent_T * ent_T
        g_TV = torch.addcmul(c_T[:, None], logp_TV, g_ent_T[:, None]).mul_(p_TV).div_(-temperature)
    if g_logp_T is not None:
        rows = torch.arange(g_TV.shape[0], device=g_TV.device)
        g_TV[rows, targets_T] += g_logp_T / temperature
    return g_TV


class RawHeadFunction(torch.autograd.Function):
    """(h_TC, w_VC, targets_T) -> (logp_T, entropy_T) of the raw definition, fp32 logits; saves h, W,
    targets, the entropy and, with one chunk, its [T, V] log-softmax block."""

    @staticmethod
    def forward(ctx, h_TC, w_VC, targets_T, temperature: float, chunk_tokens: int):
        T, acc = h_TC.shape[0], _acc_dtype(w_VC)
        w_acc = w_VC.to(acc)  # once per pass: no copy for an fp32 head
        logp_T = torch.empty(T, dtype=acc, device=h_TC.device)
        ent_T = torch.empty_like(logp_T)
        block = None
        for a in range(0, T, chunk_tokens):
            b = min(T, a + chunk_tokens)
            block = _log_softmax_block(h_TC[a:b], w_acc, temperature)
            logp_T[a:b] = block.gather(1, targets_T[a:b, None])[:, 0]
            ent_T[a:b] = -block.exp().mul_(block).sum(dim=-1)
        ctx.save_for_backward(h_TC, w_VC, targets_T, ent_T, *([block] if T <= chunk_tokens and T else []))
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)
        return logp_T, ent_T.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_T, g_ent_T):
        h_TC, w_VC, targets_T, ent_T, *kept = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp_T is None and g_ent_T is None) or not (need_h or need_w):
            return None, None, None, None, None
        T, step, t = h_TC.shape[0], ctx.chunk_tokens, ctx.temperature
        one, w_acc = T <= step, None
        grad_h = torch.empty_like(h_TC) if need_h else None
        grad_w = None
        for a in range(0, T, step):
            b = min(T, a + step)
            if kept:  # only read: it stays intact for another backward (retain_graph=True)
                block = kept[0]
            else:
                w_acc = w_VC.to(_acc_dtype(w_VC)) if w_acc is None else w_acc
                block = _log_softmax_block(h_TC[a:b], w_acc, t)
            g_TV = _grad_logits(block, targets_T[a:b], ent_T[a:b], None if g_logp_T is None else g_logp_T[a:b],
                                None if g_ent_T is None else g_ent_T[a:b], t)
            if one:  # one chunk: both GEMMs in the model's dtype, as autograd runs every other linear
                g_TV = g_TV.to(w_VC.dtype)
                grad_h = torch.mm(g_TV, w_VC).to(h_TC.dtype) if need_h else None
                grad_w = torch.mm(g_TV.t(), h_TC) if need_w else None
                break
            if need_h:
                grad_h[a:b] = torch.mm(g_TV.to(w_VC.dtype), w_VC)
            if need_w:  # summed over chunks in fp32
                gw = torch.mm(g_TV.t(), h_TC[a:b].to(g_TV.dtype))
                grad_w = gw if grad_w is None else grad_w.add_(gw)
        if grad_w is not None:
            grad_w = grad_w.to(w_VC.dtype)
        return grad_h, grad_w, None, None, None


def raw_chunked_head(h_TC: Tensor, w_VC: Tensor, targets_T: Tensor, temperature: float = 1.0, *,
                     chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """(logp_T, entropy_T) of log_softmax(h_TC W^T / temperature) at targets_T, fp32 (fp64 for a
    float64 model), the logits accumulated in fp32; differentiable in h_TC and w_VC.

    h_TC: [T, C]; w_VC: [V, C]; targets_T: [T] int64. chunk_tokens: rows per chunk (default
    chunk_tokens_for(V)). Extra memory: with T <= chunk_tokens one [T, V] fp32 block kept from the
    forward to the backward; with more, one chunk's [T_c, V] blocks at a time and an fp32 head copy.
    """
    step = _check(h_TC, w_VC, targets_T, chunk_tokens, "raw_chunked_head")
    if temperature <= 0:
        raise ValueError(f"raw_chunked_head: temperature must be > 0, got {temperature}")
    return RawHeadFunction.apply(h_TC, w_VC, targets_T, float(temperature), step)
