"""The learner's log-prob definition: log_softmax(logits / temperature) at the packed targets.

The engine samples with the same definition (rlengine/engine/sampler.py), so the learner's
recomputation agrees with the behaviour log-probs to rounding: "raw" through the fused chunked
kernel (never the [T, V] logits) or its torch reference, "processed" (top-k / top-p filtered)
through the engine's own sequence_logprobs on materialised logits. Both go through the module's
forward(), so DDP / FSDP hooks run, and take checkpoint_layers for the differentiable passes.
In batch-invariant mode (model/batch_invariant.py) both definitions run through the invariant LM
head and logsumexp, the engine's own kernels, so the recomputation equals the sampled log-probs
bit for bit.
"""

from __future__ import annotations

import torch

from rlengine.model import batch_invariant as inv
from rlengine.model.qwen3 import logits_fp32
from rlengine.rl.learner.batching import TrainBatch


def is_batch_invariant(module) -> bool:
    """Whether the model behind `module` (the model, or its DDP wrapper) runs in batch-invariant mode."""
    return bool(getattr(getattr(module, "module", module), "batch_invariant", False))


def _invariant_head(mb: TrainBatch, temperature: float, top_k: int = -1, top_p: float = 1.0,
                    mode: str = "raw"):
    """The head of batch-invariant mode: the engine's LM head and log-prob definition, its kernels."""
    from rlengine.engine.sampler import sequence_logprobs

    def head(hidden_TC, w_VC):
        logits_TV = inv.logits(hidden_TC, w_VC)
        logp = sequence_logprobs(logits_TV, mb.targets, temperature=temperature, top_k=top_k, top_p=top_p,
                                 mode=mode, invariant=True)
        t_T1 = torch.full((logits_TV.shape[0], 1), temperature if temperature > 0 else 1.0, device=logits_TV.device)
        full_TV = (logits_TV / t_T1).log_softmax(dim=-1)
        return logp, -(full_TV.exp() * full_TV).sum(dim=-1)
    return head


def token_logprobs(module, mb: TrainBatch, temperature: float, fused: bool, checkpoint_layers: bool = False):
    """(logp [T], entropy [T]) of mb.targets under `module` (raw definition), fp32, differentiable.

    `module` is the model or its DDP / FSDP wrapper: the call goes through its forward(), so the
    wrappers' hooks run. The learner's forward is the differentiable torch path (fast=False); it
    agrees with the engine's fused inference path to rounding (tests/rl/test_logprob_parity.py).
    checkpoint_layers: recompute each decoder layer in the backward (train.activation_checkpointing).
    """
    if is_batch_invariant(module):
        return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=_invariant_head(mb, temperature),
                      checkpoint_layers=checkpoint_layers)
    if fused:
        from rlengine.kernels.fused_logprob import fused_logprob as fn
    else:
        from rlengine.kernels.fused_logprob import fused_logprob_ref as fn

    def head(hidden_TC, w_VC):
        return fn(hidden_TC, w_VC, mb.targets, temperature=temperature, return_entropy=True)
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)


def processed_token_logprobs(module, mb: TrainBatch, temperature: float, top_k: int, top_p: float,
                             checkpoint_layers: bool = False):
    """(logp [T], entropy [T]) under the top-k / top-p filtered distribution at `temperature`.

    The same quantity the engine returns with logprobs_mode="processed" (sampler.sequence_logprobs);
    it needs the [T, V] logits (the filter sorts each row), so it is not fused. Entropy is that of
    the unfiltered distribution, as in raw mode.
    """
    from rlengine.engine.sampler import sequence_logprobs

    if is_batch_invariant(module):
        head = _invariant_head(mb, temperature, top_k, top_p, "processed")
        return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)

    def head(hidden_TC, w_VC):
        logits_TV = logits_fp32(hidden_TC, w_VC)
        logp = sequence_logprobs(logits_TV, mb.targets, temperature=temperature, top_k=top_k, top_p=top_p,
                                 mode="processed")
        full_TV = (logits_TV / temperature).log_softmax(dim=-1)
        return logp, -(full_TV.exp() * full_TV).sum(dim=-1)
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)
