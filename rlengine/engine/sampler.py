"""Sampler: logits of each sample's last token -> next token and its log-prob, on the device.

Per row: greedy (temperature 0), or temperature with optional top-k and top-p filtering; rows with
the rules of sampling_rules.py (min_tokens, penalties before temperature, min_p after it) get them
from a StepRules (None when no row of the step has one: the plain path is unchanged).
Returned log-prob, per the row's SamplingParams.logprobs_mode: "raw" = log_softmax(logits / T)
over the full vocabulary, before the rules and filtering; "processed" = log_softmax of the logits
the token was drawn from (taken only for rows with a filter or a rule: without one the two
are the same numbers). Greedy rows get log_softmax(logits) (processed: of the penalised logits).
sequence_logprobs is the learner's side for temperature / top-k / top-p: the same definition,
through the same filter_logits, differentiable.

Drawing: an exponential race over the filtered logits, argmax_v (z_v - log E_v) with E_v ~ Exp(1)
i.i.d. (Gumbel-max), which picks v with probability exactly softmax(z)_v; a filtered-out token
(-inf) can never win. There is no cumulative sum to round (an inverse CDF over an fp32 GPU cumsum
can land on a token of probability 0). It runs in two levels so a row needs ~2 sqrt(V) exponentials,
not V: the vocabulary is cut into chunks of S tokens, a race over the chunks' masses (logsumexp)
picks a chunk, a race inside it picks the token; P(v) = m_c / M * p_v / m_c = p_v / M.
Exponentials: unseeded rows draw theirs from the engine's torch.Generator (one call for the batch);
seeded rows compute theirs from a counter-based hash of (their draw key, element index), the key
being splitmix64(sample seed + position * golden) (draw_keys), so a seeded sample's tokens depend
on nothing but its seed, its positions and its logits, and all seeded rows cost one batched
computation, not one launch per row. No host reads: which path runs is decided from the step's
host flags (SamplingBatch.kinds_any / kinds_all).
Batch-invariant mode (Sampler(invariant=True), model/batch_invariant.py): every reduction over the
vocabulary (the log-prob's normaliser, the race's chunk masses, the filter's normalisers) is the
fixed-order C++ logsumexp, so a row's token and log-prob depend on its logits alone, and the
learner's sequence_logprobs(invariant=True) computes the same numbers.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from rlengine.engine.filtering import CANDIDATES, filter_logits  # noqa: F401 (re-exported)
from rlengine.engine.sampling_params import LOGPROBS_MODES, SamplingParams
from rlengine.engine.sampling_rules import StepRules
from rlengine.model import batch_invariant
from rlengine.engine.forward_batch import SamplingBatch

# Bits of SamplingBatch.kind, one int per sample.
SAMPLED = 1     # temperature > 0 (else greedy)
FILTERED = 2    # top-k or top-p on
PROCESSED = 4   # log-prob under the filtered distribution (sampled and filtered rows only)
SEEDED = 8      # sampled with a per-request seed (hashed exponentials)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M32 = 0xFFFFFFFF


def sample_kind(params: SamplingParams, seeded: bool) -> int:
    """The kind bits of a sample with these params (seeded: it has a per-request seed)."""
    if params.greedy:
        return 0
    kind = SAMPLED | (SEEDED if seeded else 0)
    if params.filtered:
        kind |= FILTERED | (PROCESSED if params.logprobs_mode == "processed" else 0)
    return kind


def draw_keys(seed_keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Key of each seeded draw: splitmix64(seed_key + position * golden) [N] uint64.

    seed_keys [N] uint64 (sampling_params.sample_seed of each sample), positions [N] int64 (index of
    the token being sampled). This is the position-th output of a SplitMix64 stream seeded with the
    sample's seed (the same numbers as sampling_params.splitmix64 in pure Python).
    """
    z = seed_keys + positions.astype(np.uint64) * _GOLDEN + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def make_sampling_batch(params: list[SamplingParams], *, device: torch.device | str = "cpu",
                        seed_keys: list[int | None] | None = None, positions: list[int] | None = None,
                        vocab_size: int | None = None) -> SamplingBatch:
    """A SamplingBatch for N samples built directly (the engine builds the same from its row arrays,
    engine/step_inputs.py): seed_keys [N] per-sample seeds (None: the engine's generator), positions
    [N] index of the token each draws (default 0), vocab_size for the CPU filter's candidate count."""
    N = len(params)
    seed_keys = list(seed_keys) if seed_keys is not None else [None] * N
    positions = list(positions) if positions is not None else [0] * N
    kinds = np.array([sample_kind(p, k is not None) for p, k in zip(params, seed_keys)], dtype=np.int32)
    keys = draw_keys(np.array([k or 0 for k in seed_keys], dtype=np.uint64), np.array(positions, dtype=np.int64))
    top_k = [p.top_k for p in params]
    V = vocab_size or (max(top_k) + 1)
    device = torch.device(device)
    return SamplingBatch(
        num_samples=N, logits_rows=None,
        temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                                 device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        seed_keys=torch.from_numpy(keys.view(np.int64)).to(device), kind=torch.from_numpy(kinds).to(device),
        kinds_any=int(np.bitwise_or.reduce(kinds)), kinds_all=int(np.bitwise_and.reduce(kinds)),
        max_top_k=max([k if k < V else 0 for k in top_k] + [0]))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer bijection (two xorshift-multiply rounds) on int64 values in [0, 2^32), in place.

    The multipliers are odd and < 2^31, so no product of a 32-bit value overflows int64.
    """
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    x ^= x >> 15
    return x


def hashed_exponentials(keys_N: torch.Tensor, M: int, invariant: bool = False) -> torch.Tensor:
    """Exp(1) variates [N, M] fp32 from per-row draw keys [N] int64 (uint64 bits): element e of row r
    is -log(u) with u = (2 * (h >> 9) + 1) / 2^24, h = H(H(e ^ lo_r) ^ hi_r), H = _hash32.
    invariant: the log by the batch-invariant elementwise kernel (the same bits at any N)."""
    lo = (keys_N & _M32)[:, None]
    hi = ((keys_N >> 32) & _M32)[:, None]
    x = torch.arange(M, device=keys_N.device, dtype=torch.int64)[None, :] ^ lo
    x = _hash32(_hash32(x) ^ hi)
    u = ((x >> 9) * 2 + 1).to(torch.float32).mul_(2.0 ** -24)  # odd / 2^24: exact in fp32, in (0, 1)
    return (batch_invariant.log(u) if invariant else u.log_()).neg_()


def _torch_logsumexp(x: torch.Tensor) -> torch.Tensor:
    return x.logsumexp(dim=-1)


def lse_fn(invariant: bool):
    """log-sum-exp over the last dim: torch's, or the batch-invariant kernel's."""
    return batch_invariant.logsumexp if invariant else _torch_logsumexp


def log_softmax(z_NV: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """log_softmax over the vocabulary (batch-invariant mode: z - its fixed-order logsumexp)."""
    return z_NV - batch_invariant.logsumexp(z_NV)[:, None] if invariant else z_NV.log_softmax(dim=-1)


def token_logprob(z_NV: torch.Tensor, tokens_N: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """log_softmax(z)[token] per row [N] fp32 as z[token] - logsumexp(z): one reduction over [N, V], no
    [N, V] log_softmax (invariant: the batch-invariant logsumexp)."""
    return z_NV.gather(1, tokens_N.view(-1, 1)).view(-1) - lse_fn(invariant)(z_NV)


def chunk_log_mass(x_NCS: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """log of each chunk's unnormalised mass [N, num_chunks] (-inf for a chunk of excluded tokens)."""
    return lse_fn(invariant)(x_NCS)


def chunking(V: int) -> tuple[int, int]:
    """(S, num_chunks) of the two-level race: S a power of two near sqrt(V), num_chunks * S >= V.

    A power of two within 4x of sqrt(V) that divides V is preferred (no padded copy of the logits:
    Qwen3's V = 151936 = 128 * 1187 gives S = 128); else S ~ sqrt(V) and the last chunk is padded.
    """
    S0 = 1 << max(0, round(math.log2(max(V, 1)) / 2))
    for S in (S0, S0 // 2, S0 * 2, S0 // 4):
        if S >= 1 and V % S == 0:
            return S, V // S
    return S0, -(-V // S0)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, invariant: bool = False):
        self.device = device
        self.invariant = invariant  # batch-invariant mode: fixed-order reductions over the vocabulary
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_NV: torch.Tensor, sb: SamplingBatch,
                 rules: StepRules | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V] (any float dtype) -> (token ids [N] int64, log-probs [N] fp32), on the device.

        No host sync, no host-to-device copy: the per-sample inputs are device views of the step's
        staging copy, and the path is chosen from sb's host flags (rules, when a row has one: small index
        tensors uploaded by sampling_rules.RuleState.for_step).
        """
        tokens_N1, z_NV = self._draw(logits_NV, sb, rules)
        return tokens_N1.view(-1), token_logprob(z_NV, tokens_N1.view(-1), self.invariant)

    def sample_with_top(self, logits_NV: torch.Tensor, sb: SamplingBatch, k: int, rules: StepRules | None = None):
        """As __call__, plus the k most likely tokens of each row's log-prob distribution (the one its
        sampled token's log-prob is taken from) and the sampled token's rank in it: (tokens [N], log-probs
        [N], top ids [N, k] int64, top log-probs [N, k] fp32 (-inf where a filter left fewer than k tokens),
        ranks [N] int64). One top-k and one compare over [N, V]."""
        tokens_N1, z_NV = self._draw(logits_NV, sb, rules)
        top_ids, top_lp, lp_N, rank_N = top_logprobs(log_softmax(z_NV, self.invariant), tokens_N1.view(-1), k)
        return tokens_N1.view(-1), lp_N, top_ids, top_lp, rank_N

    def _draw(self, logits_NV: torch.Tensor, sb: SamplingBatch,
              rules: StepRules | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token ids [N, 1] int64, z [N, V] fp32 whose log_softmax defines each row's log-prob)."""
        logits = logits_NV.float()
        adjusted = logits if rules is None else rules.before_temperature(logits)  # min_tokens, penalties
        if not sb.kinds_any & SAMPLED:  # all greedy: max() is ~3x faster than argmax() on the CPU
            tokens = adjusted.max(dim=-1, keepdim=True)[1]
            if rules is not None and rules.processed is not None:
                return tokens, torch.where(rules.processed, adjusted, logits)
            return tokens, logits
        z = adjusted / sb.temperature[:, None]  # greedy rows carry temperature 1: z = logits there
        if rules is not None:
            z = rules.apply_min_p(z)
        filtered = (filter_logits(z, sb.top_k, sb.top_p, sb.max_top_k, self.invariant) if sb.kinds_any & FILTERED
                    else z)
        tokens = self._race(filtered, sb)
        sampled = None
        if not sb.kinds_all & SAMPLED:
            sampled = ((sb.kind & SAMPLED) != 0)[:, None]
            tokens = torch.where(sampled, tokens, adjusted.max(dim=-1, keepdim=True)[1])
        raw = z if rules is None else logits / sb.temperature[:, None]  # before the rules
        if sb.kinds_any & PROCESSED:  # one log_softmax: filtered rows where processed, raw elsewhere
            raw = torch.where(((sb.kind & PROCESSED) != 0)[:, None], filtered, raw)
        if rules is not None and rules.processed is not None:
            after = filtered if sampled is None else torch.where(sampled, filtered, adjusted)
            raw = torch.where(rules.processed, after, raw)
        return tokens, raw

    def _race(self, x_NV: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Two-level exponential race over logits x [N, V] (-inf = excluded) -> token ids [N, 1] int64."""
        N, V = x_NV.shape
        S, nc = chunking(V)
        if nc * S != V:
            x_NV = F.pad(x_NV, (0, nc * S - V), value=float("-inf"))
        x_NCS = x_NV.view(N, nc, S)
        e = self._exponentials(N, nc + S, sb)
        log_e = batch_invariant.log(e) if self.invariant else e.log_()
        chunk_N1 = (chunk_log_mass(x_NCS, self.invariant) - log_e[:, :nc]).argmax(dim=-1, keepdim=True)
        inside_NS = x_NCS.gather(1, chunk_N1[:, :, None].expand(N, 1, S))[:, 0]
        return chunk_N1 * S + (inside_NS - log_e[:, nc:]).argmax(dim=-1, keepdim=True)

    def _exponentials(self, N: int, M: int, sb: SamplingBatch) -> torch.Tensor:
        """Exp(1) variates [N, M] fp32: hashed from the draw keys for seeded rows, the engine's generator
        for the rest. Clamped away from 0, so -log(E) is finite and a -inf logit stays -inf."""
        if sb.kinds_all & SEEDED:
            return hashed_exponentials(sb.seed_keys, M, self.invariant)
        rng = torch.empty(N, M, device=sb.temperature.device).exponential_(generator=self.generator)
        rng.clamp_(min=torch.finfo(torch.float32).tiny)
        if not sb.kinds_any & SEEDED:
            return rng
        return torch.where(((sb.kind & SEEDED) != 0)[:, None], hashed_exponentials(sb.seed_keys, M, self.invariant),
                           rng)


def top_logprobs(lp_NV: torch.Tensor, tokens_N: torch.Tensor, k: int):
    """vLLM's log-prob records from log-probs [N, V] fp32 and chosen tokens [N] int64: (top ids [N, k] int64,
    top log-probs [N, k], the tokens' log-probs [N], their ranks [N] int64 = 1 + the number of tokens with a
    strictly higher log-prob; the top-k's own ranks are 1..k)."""
    top_lp, top_ids = lp_NV.topk(min(k, lp_NV.shape[1]), dim=-1)
    lp_N = lp_NV.gather(1, tokens_N.view(-1, 1)).view(-1)
    rank_N = (lp_NV > lp_N[:, None]).sum(dim=-1) + 1
    return top_ids, top_lp, lp_N, rank_N


def sequence_logprobs(logits_TV: torch.Tensor, targets_T: torch.Tensor, *, temperature: float, top_k: int = -1,
                      top_p: float = 1.0, mode: str = "raw", invariant: bool = False) -> torch.Tensor:
    """Log-probs [T] fp32 of targets [T] int64 under logits [T, V] (any float dtype): the learner's side.

    The same definition as the Sampler for one request's SamplingParams (see sampling_params.py):
    "raw" = log_softmax(logits / temperature); "processed" = log_softmax(filter_logits(logits /
    temperature)); temperature 0 (greedy) = log_softmax(logits) in both modes. Same ops as the
    sampler, so on the same logits the values agree bit for bit (the nucleus masses are fp64 sums, so
    the candidate count a batch's largest top_k sets does not move the boundary beyond fp64
    rounding). Differentiable w.r.t. logits; the
    top-k / top-p keep-mask is a constant of the backward, so it is computed under no_grad (no sort /
    topk / scatter on the autograd graph) and applied with masked_fill. Masked-out tokens get -inf
    and no gradient, so a target that was filtered out gives -inf (its gradient stays finite).
    Host reads on the CPU only (inside filter_logits). invariant: the batch-invariant mode's
    reductions (the Sampler's with invariant=True), equal to its values bit for bit.
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
                max_top_k = top_k if 0 < top_k < z_TV.shape[1] else 0  # from the host: no read of k_T
                keep_TV = filter_logits(z_TV.detach(), k_T, p_T, max_top_k, invariant=invariant).isfinite()
            z_TV = z_TV.masked_fill(~keep_TV, float("-inf"))  # the kept entries are filter_logits' values
    return token_logprob(z_TV, targets_T.long(), invariant)
