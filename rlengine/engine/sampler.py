"""Sampler: logits of the last token of each sequence -> next token and its log-prob.

Per row: greedy (temperature 0), or temperature with optional top-k and top-p filtering,
drawn from the row's own torch.Generator when the request has a seed (so a sample's tokens
do not depend on what else is in the batch) or from the engine's generator otherwise.
Returned log-prob: log_softmax(logits / temperature) over the full vocabulary, before
filtering (log_softmax(logits) for greedy rows): the definition the learner recomputes.

Fast path: a batch that is all greedy (or all unseeded with shared settings) is one batched
op; seeded rows draw their uniform noise row by row (one small RNG call each).
"""

from __future__ import annotations

import torch

from rlengine.engine.sequence import Sequence


def filter_logits(z_BV: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k <= 0 / top_p = 1 mean off.

    z_BV: temperature-scaled logits [B, V] fp32; top_k [B] int64; top_p [B] fp32. Returns a new tensor.
    The nucleus keeps the smallest prefix of tokens (by descending prob) whose mass reaches top_p.
    """
    V = z_BV.shape[1]
    sorted_z, order = z_BV.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=z_BV.device).expand_as(sorted_z)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_z.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    return torch.full_like(z_BV, float("-inf")).scatter(1, order, sorted_z.masked_fill(drop, float("-inf")))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_BV: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits [B, V] (any float dtype) for `seqs` -> (token ids [B], log-probs [B]) as host lists.

        Host sync: one .tolist() at the end (the engine needs the tokens on the host anyway).
        """
        logits = logits_BV.float()
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
            logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
            return tokens.tolist(), logprobs.tolist()
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        z = logits / temps[:, None]
        logprobs_full = z.log_softmax(dim=-1)
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=torch.float32)
        filtered = filter_logits(z, top_k, top_p) if bool((top_k > 0).any() or (top_p < 1).any()) else z
        # Gumbel-max draw: argmax(z - log(-log u)) samples softmax(z); u per row from the row's generator.
        u = torch.empty_like(filtered)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            u[shared] = torch.rand((len(shared), u.shape[1]), generator=self.generator, device=u.device)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(u.shape[1], generator=s.generator, device=u.device)
        gumbel = -torch.log(-torch.log(u.clamp_(min=1e-20, max=1.0 - 1e-7)))
        tokens = (filtered + gumbel).argmax(dim=-1)
        greedy_rows = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
        logprobs = logprobs_full.gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), logprobs.tolist()
