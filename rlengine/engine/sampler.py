"""Sampler: logits of the last token of each sequence -> next token and its log-prob.

Per row: greedy (temperature 0), or temperature with optional top-k and top-p filtering,
drawn from the row's own torch.Generator when the request has a seed (so a sample's tokens
do not depend on what else is in the batch) or from the engine's generator otherwise.
Returned log-prob, per the row's SamplingParams.logprobs_mode: "raw" = log_softmax(logits / T)
over the full vocabulary, before filtering; "processed" = log_softmax(filter_logits(logits / T)),
the distribution the token was drawn from (taken only for rows with a filter: without one the two
are the same numbers). Greedy rows get log_softmax(logits) in both modes. sequence_logprobs is the
learner's side: the same definition, through the same filter_logits, differentiable.

Drawing: inverse CDF with ONE uniform number per row (not one per vocabulary entry, as the
Gumbel-max trick needs: at B=256, V=4096 the [B, V] RNG alone cost more than the rest of the
sampler on the CPU). Unseeded rows take theirs from the engine's generator in one call, seeded
rows one number each from their own generator. An all-greedy batch is one max + log_softmax.
"""

from __future__ import annotations

import torch

from rlengine.engine.sampling_params import LOGPROBS_MODES
from rlengine.engine.sequence import Sequence


# On the CPU a full sort of [B, V] logits costs tens of ms at B = 256 (a decode step is ~100 ms):
# top-k / top-p first look at the CANDIDATES most likely tokens (torch.topk) and sort the whole row
# only for the rows whose kept set reaches past them (a flat distribution with top_p near 1).
CANDIDATES = 64


def filter_logits(z_BV: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k <= 0 / top_p = 1 mean off.

    z_BV: temperature-scaled logits [B, V] fp32; top_k [B] int64; top_p [B] fp32. Returns a new tensor.
    Top-k first, then the nucleus over the renormalised top-k: the smallest prefix of tokens (by
    descending prob) whose mass reaches top_p. On the CPU: host reads of top_k and of which rows
    need the full sort (free there); on a GPU: one segmented sort, no host read.
    """
    V = z_BV.shape[1]
    k_B = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    K = V
    if z_BV.device.type == "cpu":
        K = min(V, max(CANDIDATES, int(k_B.masked_fill(k_B == V, 0).max())))
    if K == V:
        sorted_z, order = z_BV.sort(dim=-1, descending=True)
        return _mask_ranked(z_BV, sorted_z, order, k_B, top_p, None)[0]
    vals_BK, idx_BK = z_BV.topk(K, dim=-1)
    out, inside_B = _mask_ranked(z_BV, vals_BK, idx_BK, k_B, top_p, z_BV.logsumexp(dim=-1))
    no_filter_B = (k_B == V) & (top_p >= 1.0)
    out = torch.where(no_filter_B[:, None], z_BV, out)
    wide = (~inside_B & ~no_filter_B).nonzero()[:, 0]
    if wide.numel():
        sorted_z, order = z_BV[wide].sort(dim=-1, descending=True)
        out[wide] = _mask_ranked(z_BV[wide], sorted_z, order, k_B[wide], top_p[wide], None)[0]
    return out


def _mask_ranked(z_BV, vals_BK, idx_BK, k_B, top_p_B, lse_full_B):
    """Top-k / top-p over a descending candidate list vals [B, K] (token ids idx [B, K]).

    Returns (filtered logits [B, V] with everything outside the kept candidates at -inf,
    inside [B]: the kept set provably ends within the K candidates). lse_full [B] normalises
    rows without top-k when K < V (None when K == V: the candidates are the whole row).
    """
    K = vals_BK.shape[1]
    drop = torch.arange(K, device=vals_BK.device) >= k_B[:, None]
    lse_B = vals_BK.masked_fill(drop, float("-inf")).logsumexp(dim=-1)  # renormalised over the top-k
    if lse_full_B is not None:
        lse_B = torch.where(k_B <= K, lse_B, lse_full_B)
    probs = (vals_BK - lse_B[:, None]).exp().masked_fill_(drop, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p_B[:, None]) & (top_p_B[:, None] < 1.0)
    drop[:, 0] = False  # always keep the most likely token
    out = torch.full_like(z_BV, float("-inf")).scatter_(1, idx_BK, vals_BK.masked_fill(drop, float("-inf")))
    return out, drop[:, -1] | (k_B <= K)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_BV: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits [B, V] (any float dtype) for `seqs` -> (token ids [B], log-probs [B]) as host lists.

        Host sync: the .tolist() at the end (the engine needs the tokens on the host anyway);
        which path to take is decided from the host-side params, never from device values.
        """
        logits = logits_BV.float()
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.max(dim=-1, keepdim=True)[1]  # max() is ~3x faster than argmax() on the CPU
            return tokens.view(-1).tolist(), _logprob_of(logits, tokens).tolist()
        device = logits.device
        z = logits / torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)[:, None]
        if any(p.filtered for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
            filtered = filter_logits(z, top_k, top_p)
        else:
            filtered = z
        # Inverse-CDF draw: the first token whose cumulative probability exceeds u ~ U(0, 1), one u
        # per row (CPU cumsum accumulates in double, so each CDF entry is correctly rounded).
        logprobs_BV = z.log_softmax(dim=-1)
        cdf = (logprobs_BV.exp() if filtered is z else filtered.softmax(dim=-1)).cumsum_(dim=-1)
        u = self._uniform(len(seqs), seqs, device)
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)
        if any(greedy):
            rows = torch.tensor(greedy, device=device)[:, None]
            tokens = torch.where(rows, logits.max(dim=-1, keepdim=True)[1], tokens)
        logprobs_B1 = logprobs_BV.gather(1, tokens)
        processed = [i for i, p in enumerate(params) if p.logprobs_mode == "processed" and p.filtered and not p.greedy]
        if processed:  # only these rows pay for a second log_softmax; the rest keep the raw values
            rows = torch.tensor(processed, device=device)
            logprobs_B1[rows] = filtered[rows].log_softmax(dim=-1).gather(1, tokens[rows])
        return tokens.view(-1).tolist(), logprobs_B1.view(-1).tolist()

    def _uniform(self, B: int, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """u ~ U(0, 1) [B, 1]: seeded sequences draw from their own generator, the rest from the engine's."""
        u = torch.empty(B, 1, device=device)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if len(shared) == B:
            return u.uniform_(generator=self.generator)
        if shared:
            u[shared] = torch.rand((len(shared), 1), generator=self.generator, device=device)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i].uniform_(generator=s.generator)
        return u


def _logprob_of(logits_BV: torch.Tensor, tokens_B1: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row (log_softmax beats logits[token] - logsumexp on the CPU)."""
    return logits_BV.log_softmax(dim=-1).gather(1, tokens_B1).view(-1)


def sequence_logprobs(logits_TV: torch.Tensor, targets_T: torch.Tensor, *, temperature: float, top_k: int = -1,
                      top_p: float = 1.0, mode: str = "raw") -> torch.Tensor:
    """Log-probs [T] fp32 of targets [T] int64 under logits [T, V] (any float dtype): the learner's side.

    The same definition as the Sampler for one request's SamplingParams (see sampling_params.py):
    "raw" = log_softmax(logits / temperature); "processed" = log_softmax(filter_logits(logits /
    temperature)); temperature 0 (greedy) = log_softmax(logits) in both modes. Same ops as the
    sampler, so on the same logits the values agree bit for bit (on the CPU a nucleus boundary within
    rounding of top_p may still fall differently if the sampler's batch held a top_k > CANDIDATES,
    which changes the candidate count). Differentiable w.r.t. logits; the
    top-k / top-p keep-mask is a constant of the backward, so it is computed under no_grad (no sort /
    topk / scatter on the autograd graph) and applied with masked_fill. Masked-out tokens get -inf
    and no gradient, so a target that was filtered out gives -inf (its gradient stays finite).
    Host sync on the CPU only (inside filter_logits).
    """
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"sequence_logprobs: mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    z_TV = logits_TV.float()
    if temperature > 0:
        # a [T, 1] tensor, as the sampler divides by: a Python scalar may become a multiply by the
        # reciprocal (CUDA does), which differs in the last bit from a true division
        z_TV = z_TV / torch.full((z_TV.shape[0], 1), temperature, dtype=torch.float32, device=z_TV.device)
        if mode == "processed" and (top_k > 0 or top_p < 1.0):
            T = z_TV.shape[0]
            with torch.no_grad():
                k_T = torch.full((T,), top_k, dtype=torch.int64, device=z_TV.device)
                p_T = torch.full((T,), top_p, dtype=torch.float32, device=z_TV.device)
                keep_TV = filter_logits(z_TV.detach(), k_T, p_T).isfinite()
            z_TV = z_TV.masked_fill(~keep_TV, float("-inf"))  # the kept entries are filter_logits' values
    return z_TV.log_softmax(dim=-1).gather(1, targets_T.view(-1, 1).long()).view(-1)
