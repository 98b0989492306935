"""The learner's log-prob definition: log_softmax(logits / temperature) at the packed targets.

The engine samples with the same definition (rlengine/engine/sampler.py), so the learner's
recomputation agrees with the behaviour log-probs to rounding: "raw" through the fused Triton kernel
(CUDA) or the torch head chunked over tokens (learner/chunked_head.py: the CPU), "processed"
(top-k / top-p filtered) through the engine's own sequence_logprobs, chunked the same way. Neither
keeps a [T, V] tensor for the backward. Both go through the module's forward(), so DDP / FSDP hooks
run, and take checkpoint_layers for the differentiable passes.
In batch-invariant mode (model/batch_invariant.py) both definitions run through the invariant LM
head and logsumexp, the engine's own kernels, so the recomputation equals the sampled log-probs
bit for bit.
"""

from __future__ import annotations

import torch

from rlengine.model import batch_invariant as inv
from rlengine.model.qwen3 import logits_fp32
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.chunked_head import chunked_head, raw_chunked_head


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
        from rlengine.kernels.fused_logprob import fused_logprob

        def head(hidden_TC, w_VC):
            return fused_logprob(hidden_TC, w_VC, mb.targets, temperature=temperature, return_entropy=True)
    else:
        def head(hidden_TC, w_VC):
            return raw_chunked_head(hidden_TC, w_VC, mb.targets, temperature)
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)


def raw_head(temperature: float):
    """The raw definition on one chunk of rows: (h_c, W, targets_c) -> (logp_c, entropy_c), fp32."""
    from rlengine.kernels.fused_logprob import fused_logprob_ref

    def fn(h_TC, w_VC, targets_T):
        return fused_logprob_ref(h_TC, w_VC, targets_T, temperature=temperature, return_entropy=True)
    return fn


def processed_head(temperature: float, top_k: int, top_p: float):
    """The processed definition on one chunk of rows (entropy: of the unfiltered distribution)."""
    from rlengine.engine.sampler import sequence_logprobs

    def fn(h_TC, w_VC, targets_T):
        logits_TV = logits_fp32(h_TC, w_VC)
        logp = sequence_logprobs(logits_TV, targets_T, temperature=temperature, top_k=top_k, top_p=top_p,
                                 mode="processed")
        full_TV = (logits_TV / temperature).log_softmax(dim=-1)
        return logp, -(full_TV.exp() * full_TV).sum(dim=-1)
    return fn


def processed_token_logprobs(module, mb: TrainBatch, temperature: float, top_k: int, top_p: float,
                             checkpoint_layers: bool = False):
    """(logp [T], entropy [T]) under the top-k / top-p filtered distribution at `temperature`.

    The same quantity the engine returns with logprobs_mode="processed" (sampler.sequence_logprobs);
    the filter sorts each row of logits, so it runs on the torch path, chunked over tokens
    (learner/chunked_head.py). Entropy is that of the unfiltered distribution, as in raw mode.
    """
    if is_batch_invariant(module):
        head = _invariant_head(mb, temperature, top_k, top_p, "processed")
        return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)

    def head(hidden_TC, w_VC):
        return chunked_head(hidden_TC, w_VC, mb.targets, processed_head(temperature, top_k, top_p))
    return module(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head, checkpoint_layers=checkpoint_layers)
