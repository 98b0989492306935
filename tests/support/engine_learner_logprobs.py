"""Generator-vs-learner log-prob comparison shared by tests/rl/test_logprob_parity.py and the GPU tier:
a GRPO batch sampled by the engine, and |learner log-prob - engine log-prob| per response token.

Low-precision bound: the two forwards round the residual stream and sublayer outputs to bf16/fp16 at
different points, a few ulps (2^-8 relative for bf16) of the hidden state after 2 layers; with
|logit| <= ~1 that bounds a per-token difference by 2^-6 and its mean by 2^-9. Each further layer adds
its own roundings to the residual stream, so low_precision_bounds(L) grows the two bounds linearly in L
(the worst case, no cancellation): 2^-4 and 2^-7 for qwen3-30m's 8 layers.
"""

import torch

from rlengine import LLM, SamplingParams
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.learner.learner import token_logprobs
from rlengine.rl.rollout_group import RolloutGroup

MAX_LOW, MEAN_LOW = 2 ** -6, 2 ** -9  # 2 layers (the tiny presets)


def low_precision_bounds(num_layers: int) -> tuple[float, float]:
    """(max, mean) bounds on |learner - engine| log-probs in bf16/fp16 for a model of num_layers layers."""
    scale = max(1.0, num_layers / 2)
    return MAX_LOW * scale, MEAN_LOW * scale


def rollout_batch(model, *, G=3, prompts=4, max_tokens=9, seed=6, backend="auto"):
    llm = LLM(model, max_num_seqs=8, attention_backend=backend)
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 60, (int(n),), generator=gen).tolist() for n in torch.randint(2, 12, (prompts,), generator=gen)]
    outs = llm.generate(ids, SamplingParams(n=G, temperature=1.0, max_tokens=max_tokens, seed=seed))
    groups = [RolloutGroup(i, o.prompt_token_ids, [c.token_ids for c in o.outputs], [c.token_logprobs for c in o.outputs],
                           [float(j) for j in range(G)], [c.policy_versions for c in o.outputs],
                           [c.finish_reason for c in o.outputs]) for i, o in enumerate(outs)]
    return grpo_batch(groups, normalize_std=True)


def learner_minus_engine(model, batch, fused):
    logp, _ = token_logprobs(model, batch, 1.0, fused)  # grad enabled: the learner's training forward
    assert logp.requires_grad and logp.dtype == torch.float32
    valid = batch.loss_mask > 0
    return (logp.detach()[valid] - batch.old_logprobs.to(logp.device)[valid]).abs()
