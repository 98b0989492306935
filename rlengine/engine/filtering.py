"""Top-k / top-p filtering of temperature-scaled logits [B, V], without a full sort of the vocabulary.

The sampler (sampler.py) and the learner's sequence_logprobs call filter_logits. Definition: top-k
first, then the nucleus over the renormalised top-k: the smallest prefix of tokens, by descending
logit, whose mass reaches top_p (a token is kept when the mass before it is < top_p; the most
likely token always is). Tie rule: tokens of equal logit are ordered by token id (lower first, the
order of a stable sort), so the nucleus set is fully determined; which of the tokens tied at the
k-th largest logit a top-k keeps is torch.topk's choice.
Fast path: the CANDIDATES (or largest top-k) most likely tokens from torch.topk decide every row
whose kept set ends inside them; a wider nucleus (top_p without top_k on a flat distribution) is
found by a mass-weighted radix select over the logits' order-preserving 32-bit keys: three passes
of a 2048-bucket histogram of the probabilities pin down the boundary logit, and the tokens tied at
it are kept in id order while the mass before them stays < top_p. Masses are summed in fp64 (of the
fp32 probabilities). On the CPU each pass keeps only the boundary bucket's tokens (a host read,
free there), in the C++ op csrc/nucleus.cpp when the extension is built; on a GPU the passes run
over the whole rows with masks (no host read).
Batch-invariant mode keeps the sort-based path (filter_logits_sorted): its keep set is a function of
the row alone by construction.
Dimension legend: B rows, V vocab, K candidates, W rows with a wide nucleus, M compacted tokens.
"""

from __future__ import annotations

import torch

from rlengine.model import ext as _ext
from rlengine.model import batch_invariant

# On the CPU a full sort of [B, V] logits costs tens of ms at B = 256 (a decode step is ~100 ms):
# top-k / top-p first look at the CANDIDATES most likely tokens (torch.topk).
CANDIDATES = 64
RADIX_BITS = (11, 11, 10)  # most significant first; 2048 buckets per pass
_SIGN = -(2 ** 31)


def filter_logits(z_BV: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  max_top_k: int | None = None, invariant: bool = False) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. top_k <= 0 / top_p = 1 mean off.

    z_BV: temperature-scaled logits [B, V] fp32; top_k [B] int64; top_p [B] fp32. Returns a new tensor.
    max_top_k: the largest top_k < V of the batch, from the host (None: read from top_k, a host sync
    on a GPU). Host reads on the CPU only. invariant: the batch-invariant sort-based path.
    """
    if invariant:
        return filter_logits_sorted(z_BV, top_k, top_p, max_top_k, invariant=True)
    V = z_BV.shape[1]
    k_B = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    if max_top_k is None:
        max_top_k = int(k_B.masked_fill(k_B == V, 0).max())
    K = min(V, max(CANDIDATES, max_top_k))
    vals_BK, idx_BK = _ranked_candidates(z_BV, K)
    lse_B = z_BV.logsumexp(dim=-1)
    drop_BK, inside_B = _ranked_drop(vals_BK, k_B, top_p, lse_B if K < V else None, mass_dtype=torch.float64,
                                     tie_safe=True)
    no_filter_B = (k_B == V) & (top_p >= 1.0)
    wide_B = ~inside_B & ~no_filter_B  # no top-k (k <= K is always inside), a nucleus past the candidates
    if z_BV.device.type == "cpu":
        rows = wide_B.nonzero()[:, 0]
        if rows.numel() == z_BV.shape[0]:  # every row wide (top_p on a flat row): the candidates' mask unused
            return nucleus_filter(z_BV, lse_B, top_p)
        out = torch.where(no_filter_B[:, None], z_BV, _scatter_kept(z_BV, vals_BK, idx_BK, drop_BK))
        if rows.numel():
            out[rows] = nucleus_filter(z_BV[rows], lse_B[rows], top_p[rows])
        return out
    out = torch.where(no_filter_B[:, None], z_BV, _scatter_kept(z_BV, vals_BK, idx_BK, drop_BK))
    keep = nucleus_keep(z_BV, lse_B, top_p, compact=False)
    return torch.where(wide_B[:, None], torch.where(keep, z_BV, float("-inf")), out)


def _ranked_candidates(z_BV: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K largest logits per row [B, K] and their ids, descending, ties in id order (two small sorts)."""
    _, idx = z_BV.topk(K, dim=-1, sorted=False)
    idx = idx.sort(dim=-1).values
    vals = z_BV.gather(1, idx)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(1, order)


def _mask_ranked(z_BV, vals_BK, idx_BK, k_B, top_p_B, lse_full_B, lse=None, exp=torch.exp, mass_dtype=None,
                 tie_safe=False):
    """Top-k / top-p over a descending candidate list vals [B, K] (token ids idx [B, K]).

    Returns (filtered logits [B, V] with everything outside the kept candidates at -inf,
    inside [B]: the kept set provably ends within the K candidates). lse_full [B] normalises
    rows without top-k when K < V (None when K == V: the candidates are the whole row).
    mass_dtype: the cumulative mass's dtype (None: the probabilities' fp32). tie_safe: a row without
    top-k is inside only if its kept set ends above the last candidate's logit (ties in id order).
    """
    drop, inside = _ranked_drop(vals_BK, k_B, top_p_B, lse_full_B, lse, exp, mass_dtype, tie_safe)
    return _scatter_kept(z_BV, vals_BK, idx_BK, drop), inside


def _ranked_drop(vals_BK, k_B, top_p_B, lse_full_B, lse=None, exp=torch.exp, mass_dtype=None, tie_safe=False):
    """_mask_ranked's decision on the candidates alone: (drop [B, K] bool, inside [B])."""
    lse = lse or (lambda x: x.logsumexp(dim=-1))
    K = vals_BK.shape[1]
    drop = torch.arange(K, device=vals_BK.device) >= k_B[:, None]
    lse_B = lse(vals_BK.masked_fill(drop, float("-inf")))  # renormalised over the top-k
    if lse_full_B is not None:
        lse_B = torch.where(k_B <= K, lse_B, lse_full_B)
    probs = exp(vals_BK - lse_B[:, None]).masked_fill_(drop, 0.0)
    if mass_dtype is not None:
        probs = probs.to(mass_dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p_B[:, None].to(probs.dtype)) & (top_p_B[:, None] < 1.0)
    drop[:, 0] = False  # always keep the most likely token
    inside = drop[:, -1]
    if tie_safe:  # the kept set must end before the last candidate's tie group (which may go on past K)
        inside = inside & (vals_BK.masked_fill(drop, float("inf")).amin(dim=-1) > vals_BK[:, -1])
    return drop, inside | (k_B <= K)


def _scatter_kept(z_BV, vals_BK, idx_BK, drop_BK):
    """[B, V] at -inf but the kept candidates."""
    return torch.full_like(z_BV, float("-inf")).scatter_(1, idx_BK, vals_BK.masked_fill(drop_BK, float("-inf")))


def filter_logits_sorted(z_BV: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         max_top_k: int | None = None, invariant: bool = False) -> torch.Tensor:
    """The sort-based filter (the batch-invariant mode's): the CANDIDATES first on the CPU, a full sort of
    the rows whose kept set reaches past them (all rows on a GPU). Same arguments as filter_logits;
    invariant: the normalisers by the batch-invariant logsumexp / exp."""
    lse = batch_invariant.logsumexp if invariant else (lambda x: x.logsumexp(dim=-1))
    exp = batch_invariant.exp if invariant else torch.exp
    V = z_BV.shape[1]
    k_B = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    K = V
    if z_BV.device.type == "cpu":
        if max_top_k is None:
            max_top_k = int(k_B.masked_fill(k_B == V, 0).max())
        K = min(V, max(CANDIDATES, max_top_k))
    if K == V:
        sorted_z, order = z_BV.sort(dim=-1, descending=True)
        return _mask_ranked(z_BV, sorted_z, order, k_B, top_p, None, lse, exp)[0]
    vals_BK, idx_BK = z_BV.topk(K, dim=-1)
    out, inside_B = _mask_ranked(z_BV, vals_BK, idx_BK, k_B, top_p, lse(z_BV), lse, exp)
    no_filter_B = (k_B == V) & (top_p >= 1.0)
    out = torch.where(no_filter_B[:, None], z_BV, out)
    wide = (~inside_B & ~no_filter_B).nonzero()[:, 0]
    if wide.numel():
        sorted_z, order = z_BV[wide].sort(dim=-1, descending=True)
        out[wide] = _mask_ranked(z_BV[wide], sorted_z, order, k_B[wide], top_p[wide], None, lse, exp)[0]
    return out


def nucleus_filter(z_WV: torch.Tensor, lse_W: torch.Tensor, top_p_W: torch.Tensor) -> torch.Tensor:
    """z [W, V] fp32 with the tokens outside each row's top-p nucleus (no top-k) at -inf, on the CPU:
    the C++ op (csrc/nucleus.cpp: the same radix select, one row per task, about 3x faster) when
    built, else nucleus_keep's torch passes. Both sum the same fp32 probabilities in fp64."""
    if _ext.has_op("nucleus_filter"):
        return torch.ops.rlengine.nucleus_filter(z_WV, torch.exp(z_WV - lse_W[:, None]), top_p_W.float())
    return torch.where(nucleus_keep(z_WV, lse_W, top_p_W, compact=True), z_WV, float("-inf"))


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """int32 keys with the order of the fp32 values z (-0.0 taken as +0.0): a < b iff key(a) < key(b)."""
    b = (z + 0.0).view(torch.int32)
    return b.bitwise_xor_((b >> 31).bitwise_and_(0x7FFFFFFF))


def nucleus_keep(z_WV: torch.Tensor, lse_W: torch.Tensor, top_p_W: torch.Tensor, compact: bool) -> torch.Tensor:
    """The top-p nucleus of full rows (no top-k) by a mass-weighted radix select -> keep mask [W, V] bool.

    z [W, V] fp32, lse [W] its logsumexp, top_p [W] fp32 in (0, 1]. compact: after the first pass keep
    only the boundary bucket's tokens (a host read: the CPU's choice), else masked full-row passes.
    """
    W, V = z_WV.shape
    p_WV = torch.exp(z_WV - lse_W[:, None]).double()  # the fp32 probabilities _mask_ranked uses
    key_WV = order_keys(z_WV)
    target = top_p_W.double()
    above = torch.zeros(W, dtype=torch.float64, device=z_WV.device)
    shift = 32 - RADIX_BITS[0]
    digit = ((key_WV >> shift) + (1 << (RADIX_BITS[0] - 1))).long()  # the top bits in unsigned order
    best, above, total = _radix_pass(None, digit, p_WV, RADIX_BITS[0], above, target)
    prefix, rows, flat, live = best, None, None, None
    if compact:  # the boundary buckets' tokens as flat lists (row-major: id order within a row)
        flat = (digit == best[:, None]).view(-1).nonzero()[:, 0]
        rows = flat // V
        ukey, p = key_WV.view(-1).take(flat) ^ _SIGN, p_WV.view(-1).take(flat)
    else:
        live = digit == best[:, None]
        ukey, p = key_WV ^ _SIGN, p_WV
    for bits in RADIX_BITS[1:]:
        shift -= bits
        digit = ((ukey >> shift) & ((1 << bits) - 1)).long()
        best, above, _ = _radix_pass(rows, digit, p if live is None else p * live, bits, above, target)
        prefix = (prefix << bits) | best
        if compact:
            sel = (digit == best[rows]).nonzero()[:, 0]
            ukey, p, rows, flat = ukey[sel], p[sel], rows[sel], flat[sel]
        else:
            live &= digit == best[:, None]
    key0 = (prefix + _SIGN).to(torch.int32)  # the boundary logit's key (unsigned -> signed order)
    keep = key_WV > key0[:, None]
    keep |= (total < target)[:, None]  # the whole row's mass below top_p: keep all
    if compact:  # the tie group, in id order within each row
        start = torch.searchsorted(rows, torch.arange(W, device=rows.device))
        j = torch.arange(rows.numel(), device=rows.device) - start[rows]
        ok = above[rows] + j.double() * p < target[rows]
        keep.view(-1)[flat[ok]] = True
    else:
        j = live.cumsum(dim=-1) - 1
        q = (p_WV * live).amax(dim=-1)
        keep |= live & (above[:, None] + j.double() * q[:, None] < target[:, None])
    return keep


def _radix_pass(rows_M, digit, p, bits, above_W, target_W):
    """One histogram pass over [W, V] (rows_M None) or flat [M] tokens of rows rows_M -> (the digit of the
    boundary token per row [W] int64, the mass of the tokens above its bucket [W] fp64, the mass of
    these tokens and those above them [W] fp64)."""
    W, NB = above_W.shape[0], 1 << bits
    if rows_M is None:
        hist = torch.zeros(W, NB, dtype=torch.float64, device=p.device).scatter_add_(1, digit, p)
    else:
        hist = torch.zeros(W * NB, dtype=torch.float64, device=p.device).index_add_(0, rows_M * NB + digit, p)
    desc = hist.view(W, NB).flip(1)
    cum = desc.cumsum(dim=1)
    excl = above_W[:, None] + (cum - desc)  # mass of every bucket above this one
    j = (excl + desc < target_W[:, None]).sum(dim=1).clamp(max=NB - 1)  # first bucket reaching top_p
    return NB - 1 - j, excl.gather(1, j[:, None])[:, 0], above_W + cum[:, -1]
