"""Sampler statistics: drawn token frequencies match the target distribution; seeds reproduce;
returned log-probs follow SamplingParams.logprobs_mode, and sequence_logprobs (the learner's side)
gives the same numbers and the gradient of a hand-built masked log_softmax.

The sampler is driven directly (no model) with SamplingBatches built by make_sampling_batch on a
small vocabulary: one call with N identical logits rows is N independent draws, so each case is
one batched call. The draw is a two-level exponential race (sampler.py); its own cases cover
vocabularies that are not a multiple of the chunk size, mass concentrated in one chunk, the
hashed (seeded) exponentials, and a planted bug in the chunk level that the test must catch.
Frequencies are checked with Pearson's chi-square test over the tokens the target keeps;
tokens the target removes (top-k, top-p) must never be drawn. The critical value is the
Wilson-Hilferty approximation chi2_{1-a}(k) ~= k * (1 - 2/(9k) + z_{1-a} * sqrt(2/(9k)))^3
(at a = 1e-3 it errs on the conservative side by < 4% for k = 1 and < 2% for k >= 3; checked
against scipy when it is importable), with z = 3.0902 for a = 1e-3. The draws are seeded, so every case is
deterministic: a pass or a failure reproduces exactly.
"""

import math

import numpy as np
import pytest
import torch

from rlengine.engine import sampler as sampler_mod
from rlengine.engine.sampler import (Sampler, chunking, draw_keys, filter_logits, hashed_exponentials,
                                     make_sampling_batch, sequence_logprobs)
from rlengine.engine.sampling_params import SamplingParams, sample_seed, splitmix64

from tests.support.sampler_checks import assert_matches_distribution, chi2_critical, random_logits

CPU = torch.device("cpu")
# sample_seed(0, 1), sample_seed(1, 2), sample_seed(-1, 3): pinned so a change of the hash shows
SAMPLE_SEED_VALUES = [6791897765849424158, 16171810823986729605, 4722581856061867462]

N_DRAWS = 20_000


# chi-square 0.999 quantiles from standard tables (scipy.stats.chi2.ppf(0.999, dof))
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 5: 20.515, 10: 29.588, 19: 43.820, 49: 85.351}


def test_wilson_hilferty_matches_table():
    for dof, exact in CHI2_999.items():
        assert 0 <= (chi2_critical(dof) - exact) / exact < (0.04 if dof < 3 else 0.02), dof


def test_chi_square_check_rejects_a_wrong_distribution():
    """Negative control: the check has the power to see a 20% temperature error at N_DRAWS."""
    logits = random_logits(20)
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0))
    with pytest.raises(AssertionError, match="chi2="):
        assert_matches_distribution(tokens, (logits / 1.2).softmax(-1))


def _draw(logits_V: torch.Tensor, params: SamplingParams, n: int = N_DRAWS, seeds=None, sampler_seed: int = 0,
          invariant: bool = False):
    """n draws from one logits row: unseeded (the engine's generator) or one seed per draw (hashed)."""
    sampler = Sampler(CPU, seed=sampler_seed, invariant=invariant)
    sb = make_sampling_batch([params] * n, seed_keys=None if seeds is None else list(seeds),
                             vocab_size=logits_V.numel())
    return sampler(logits_V.expand(n, -1).contiguous(), sb)


def _masked_softmax(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(~keep, float("-inf")).softmax(-1)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_distribution(temperature):
    logits = random_logits(20)
    tokens, logprobs = _draw(logits, SamplingParams(temperature=temperature))
    assert_matches_distribution(tokens, (logits / temperature).softmax(-1))
    # returned log-prob: log_softmax(logits / T) of the drawn token over the full vocabulary
    torch.testing.assert_close(logprobs, (logits / temperature).log_softmax(-1)[tokens])


@pytest.mark.parametrize("top_p,top_k", [(1.0, -1), (0.8, 6)])
def test_batch_invariant_sampler_draws_the_same_distribution(top_p, top_k):
    """Sampler(invariant=True): the fixed-order logsumexp in the race, the filter and the log-prob;
    the same target distribution, and the processed log-prob is log_softmax of the kept logits."""
    logits = random_logits(40, seed=9)
    params = SamplingParams(temperature=0.7, top_p=top_p, top_k=top_k, logprobs_mode="processed")
    tokens, logprobs = _draw(logits, params, invariant=True)
    z = logits / 0.7
    keep = filter_logits(z[None], torch.tensor([top_k]), torch.tensor([top_p]))[0].isfinite()
    assert_matches_distribution(tokens, _masked_softmax(z, keep))
    torch.testing.assert_close(logprobs, z.masked_fill(~keep, float("-inf")).log_softmax(-1)[tokens],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_top_k_distribution(top_k):
    logits = random_logits(30, seed=1)
    tokens, logprobs = _draw(logits, SamplingParams(temperature=0.8, top_k=top_k))
    z = logits / 0.8
    keep = torch.zeros(30, dtype=torch.bool)
    keep[z.topk(top_k).indices] = True
    assert_matches_distribution(tokens, _masked_softmax(z, keep))
    # the default ("raw") log-prob is taken before filtering, not the renormalised one
    torch.testing.assert_close(logprobs, z.log_softmax(-1)[tokens])


# Nucleus probabilities in a shuffled order, no ties; cumulative mass of the sorted head: 0.40, 0.65, 0.80,
# 0.90, 0.96, then a tail of seven (0.010, 0.0086, ... 0.0014) reaching 0.970, 0.9786, 0.9857, ...
TAIL = torch.arange(7, 0, -1, dtype=torch.float64) / 28 * 0.04
NUCLEUS_PROBS = torch.cat([TAIL, torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06], dtype=torch.float64)]).float()[
    torch.randperm(12, generator=torch.Generator().manual_seed(3))]


@pytest.mark.parametrize("top_p,kept", [(0.01, 1), (0.39, 1), (0.41, 2), (0.64, 2), (0.66, 3), (0.79, 3),
                                        (0.81, 4), (0.95, 5), (0.965, 6), (0.975, 7), (0.999, 12), (1.0, 12)])
def test_top_p_distribution_at_the_nucleus_boundary(top_p, kept):
    """The nucleus is the smallest most-likely prefix whose mass reaches top_p (just below/above each step)."""
    logits = NUCLEUS_PROBS.log()
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0, top_p=top_p))
    keep = torch.zeros(12, dtype=torch.bool)
    keep[NUCLEUS_PROBS.argsort(descending=True)[:kept]] = True
    assert_matches_distribution(tokens, _masked_softmax(logits, keep))


def test_top_p_uses_temperature_scaled_probs_and_follows_top_k():
    logits = NUCLEUS_PROBS.log()
    order = NUCLEUS_PROBS.argsort(descending=True)
    # T = 0.5 squares and renormalises the probabilities: head 0.40^2 / sum, ... -> first token alone is > 0.5
    z = logits / 0.5
    p = z.softmax(-1)
    assert p[order[0]] > 0.55
    tokens, _ = _draw(logits, SamplingParams(temperature=0.5, top_p=0.55))
    keep = torch.zeros(12, dtype=torch.bool)
    keep[order[0]] = True
    assert_matches_distribution(tokens, _masked_softmax(z, keep))
    # top-k first, then top-p on the renormalised top-k mass: [.4,.25,.15,.1]/.9 -> cumulative .44, .72, .89
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.8))
    keep = torch.zeros(12, dtype=torch.bool)
    keep[order[:3]] = True
    assert_matches_distribution(tokens, _masked_softmax(logits, keep))


def test_seeded_rows_sample_the_target_distribution():
    """Each row drawing from its own generator (the per-request seed path) samples the same distribution."""
    logits = random_logits(10, seed=4)
    n = 6000
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0, top_k=6, seed=0), n=n, seeds=range(10_000, 10_000 + n))
    keep = torch.zeros(10, dtype=torch.bool)
    keep[logits.topk(6).indices] = True
    assert_matches_distribution(tokens, _masked_softmax(logits, keep))


def test_greedy_rows_take_the_argmax_in_any_batch():
    logits = (random_logits(40, seed=5).expand(8, -1).clone()
              + torch.randn(8, 40, generator=torch.Generator().manual_seed(6)))
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)
    sampler = Sampler(CPU)
    for mix in ([greedy] * 8, [greedy, sampled] * 4):
        tokens, logprobs = sampler(logits, make_sampling_batch(mix, vocab_size=40))
        for i, p in enumerate(mix):
            if p.greedy:
                assert tokens[i] == logits[i].argmax().item()
                assert logprobs[i] == pytest.approx(logits[i].log_softmax(-1).max().item(), abs=1e-6)


def _run_steps(sampler: Sampler, rows: list[tuple[torch.Tensor, SamplingParams, int | None]],
               steps: int) -> list[list[int]]:
    """Sample `steps` times (positions 0..steps-1) for rows [(logits [steps, V], params, seed or None)]."""
    out = [[] for _ in rows]
    for t in range(steps):
        logits = torch.stack([lg[t] for lg, _, _ in rows])
        sb = make_sampling_batch([p for _, p, _ in rows], seed_keys=[k for _, _, k in rows], positions=[t] * len(rows),
                                 vocab_size=logits.shape[1])
        tokens, _ = sampler(logits, sb)
        for i, tok in enumerate(tokens.tolist()):
            out[i].append(tok)
    return out


def test_seeded_rows_reproduce_and_ignore_batch_composition():
    V, steps = 24, 25
    lg = lambda seed: torch.randn(steps, V, generator=torch.Generator().manual_seed(seed)) * 2  # noqa: E731
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.9, seed=42)

    def row(seed):
        return lg(7), params, seed

    alone = _run_steps(Sampler(CPU, seed=0), [row(42)], steps)[0]
    again = _run_steps(Sampler(CPU, seed=99), [row(42)], steps)[0]
    assert alone == again, "the same seed must give the same tokens whatever the engine's own seed"
    others = [(lg(1), SamplingParams(temperature=1.0), None), (lg(2), SamplingParams(temperature=0.0), None),
              (lg(3), SamplingParams(temperature=1.3, top_k=3), 5)]
    for pos in range(4):
        rows = others[:pos] + [row(42)] + others[pos:]
        assert _run_steps(Sampler(CPU, seed=pos), rows, steps)[pos] == alone, f"row at {pos}"
    assert _run_steps(Sampler(CPU), [row(43)], steps)[0] != alone



def _top_k_keep(z_V: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.zeros(z_V.numel(), dtype=torch.bool)
    keep[z_V.topk(k).indices] = True
    return keep


def _nucleus_keep(z_V: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest most-likely prefix whose mass reaches p, by hand (sort, mass before each token < p)."""
    probs, order = z_V.softmax(-1).sort(descending=True)
    keep = torch.zeros(z_V.numel(), dtype=torch.bool)
    keep[order[(probs.cumsum(-1) - probs) < p]] = True
    return keep


@pytest.mark.parametrize("filt", ["top_k", "top_p"])
def test_processed_logprobs_are_log_softmax_over_the_kept_set(filt):
    """processed = log_softmax over the kept, temperature-scaled logits; raw unchanged; the same tokens."""
    logits, T = random_logits(40, seed=11, scale=1.0), 0.7
    z = logits / T
    knobs, keep = (dict(top_k=6), _top_k_keep(z, 6)) if filt == "top_k" else (dict(top_p=0.8), _nucleus_keep(z, 0.8))
    assert 1 < keep.sum() < 40
    tokens, processed = _draw(logits, SamplingParams(temperature=T, logprobs_mode="processed", **knobs), n=2000)
    raw_tokens, raw = _draw(logits, SamplingParams(temperature=T, logprobs_mode="raw", **knobs), n=2000)
    assert torch.equal(tokens, raw_tokens), "the mode must not change what is sampled"
    assert keep[tokens].all()
    torch.testing.assert_close(processed, z.masked_fill(~keep, float("-inf")).log_softmax(-1)[tokens],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(raw, z.log_softmax(-1)[tokens], rtol=0, atol=1e-6)


def test_processed_probabilities_sum_to_one_and_match_frequencies():
    """exp(processed log-prob) is the distribution sampled from: it sums to 1 over what is drawn, and the
    draws match it (chi-square). Every kept token has prob > 1e-2 here, so all of them are drawn."""
    logits = random_logits(30, seed=12)
    tokens, logprobs = _draw(logits, SamplingParams(temperature=0.9, top_k=8, top_p=0.9, logprobs_mode="processed"))
    target = torch.zeros(30)
    target[tokens] = logprobs.exp()  # one value per token (checked next)
    assert torch.equal(logprobs.exp(), target[tokens])
    assert target.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert target[target > 0].min() > 1e-2
    assert_matches_distribution(tokens, target)


# One row per code path: raw/processed x no filter/top-k/top-p/both, greedy in both modes (with a filter
# set: still log_softmax(logits)), a flat row whose nucleus is wider than sampler.CANDIDATES (full-sort fallback).
MIXED = [(dict(temperature=1.0), 2.0), (dict(temperature=0.8, top_k=5), 2.0),
         (dict(temperature=0.8, top_k=5, logprobs_mode="processed"), 2.0),
         (dict(temperature=1.2, top_p=0.8, logprobs_mode="processed"), 2.0),
         (dict(temperature=0.9, top_k=10, top_p=0.9, logprobs_mode="processed"), 2.0),
         (dict(temperature=1.0, logprobs_mode="processed"), 2.0),
         (dict(temperature=0.0, top_k=3, logprobs_mode="processed"), 2.0), (dict(temperature=0.0), 2.0),
         (dict(temperature=1.0, top_p=0.97, logprobs_mode="processed"), 0.2)]


def test_sequence_logprobs_matches_the_sampler_in_a_mixed_batch():
    """The learner's sequence_logprobs on the sampler's logits and tokens returns the sampler's values exactly."""
    V, reps = 100, 4
    gen = torch.Generator().manual_seed(13)
    rows = [(SamplingParams(**kw), scale) for kw, scale in MIXED for _ in range(reps)]
    logits = torch.stack([torch.randn(V, generator=gen) * scale for _, scale in rows])
    tokens, logprobs = Sampler(CPU, seed=1)(logits, make_sampling_batch([p for p, _ in rows], vocab_size=V))
    for c, (kw, _) in enumerate(MIXED):  # one learner call per config, over its `reps` rows
        r = slice(c * reps, (c + 1) * reps)
        p = rows[c * reps][0]
        got = sequence_logprobs(logits[r], tokens[r], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                mode=p.logprobs_mode)
        assert got.dtype == torch.float32 and got.shape == (reps,)
        assert torch.equal(got, logprobs[r]), f"{kw}: {got.tolist()} != {logprobs[r].tolist()}"


@pytest.mark.parametrize("mode,knobs", [("processed", dict(top_k=7)), ("processed", dict(top_p=0.85)),
                                        ("raw", dict(top_k=7)), ("processed", dict())])
def test_sequence_logprobs_gradient_matches_a_masked_log_softmax(mode, knobs):
    """Forward and d/d logits against autograd through a hand-built masked log_softmax, one upstream gradient."""
    gen = torch.Generator().manual_seed(14)
    T, V, temp = 6, 50, 0.8
    logits = (torch.randn(T, V, generator=gen) * 2).requires_grad_()
    z = logits.detach() / temp
    if mode == "raw" or not knobs:
        keep = torch.ones(T, V, dtype=torch.bool)
    elif "top_k" in knobs:
        keep = torch.stack([_top_k_keep(z[t], knobs["top_k"]) for t in range(T)])
    else:
        keep = torch.stack([_nucleus_keep(z[t], knobs["top_p"]) for t in range(T)])
    targets = torch.stack([torch.multinomial(keep[t].float(), 1, generator=gen)[0] for t in range(T)])
    grad_out = torch.randn(T, generator=gen)
    got = sequence_logprobs(logits, targets, temperature=temp, mode=mode, **knobs)
    (got_grad,) = torch.autograd.grad(got, logits, grad_out)
    ref = (logits / temp).masked_fill(~keep, float("-inf")).log_softmax(-1).gather(1, targets[:, None]).view(-1)
    (ref_grad,) = torch.autograd.grad(ref, logits, grad_out)
    torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=1e-6)
    assert (got_grad[~keep] == 0).all(), "masked-out logits get no gradient"


def test_sequence_logprobs_of_a_filtered_out_target_is_minus_inf():
    logits = random_logits(20, seed=15)[None].requires_grad_()
    outside = logits.detach()[0].argsort()[:1]  # the least likely token: outside top_k=3
    got = sequence_logprobs(logits, outside, temperature=1.0, top_k=3, mode="processed")
    assert got.item() == float("-inf")
    (grad,) = torch.autograd.grad(got, logits)
    assert torch.isfinite(grad).all()


def test_processed_differs_from_raw_only_when_filtered():
    """Negative control: with top_k=3 the modes differ; without a filter they are bit-identical."""
    logits = random_logits(30, seed=16)
    raw, processed = (_draw(logits, SamplingParams(temperature=1.0, top_k=3, logprobs_mode=m), n=200)[1]
                      for m in ("raw", "processed"))
    assert ((processed - raw).abs() > 1e-3).all()
    raw, processed = (_draw(logits, SamplingParams(temperature=1.0, logprobs_mode=m), n=200)[1]
                      for m in ("raw", "processed"))
    assert torch.equal(raw, processed)


def test_invalid_logprobs_mode_raises():
    with pytest.raises(ValueError, match="logprobs_mode.*raw.*processed"):
        SamplingParams(logprobs_mode="filtered")
    with pytest.raises(ValueError, match="mode.*raw.*processed"):
        sequence_logprobs(torch.randn(2, 5), torch.tensor([0, 1]), temperature=1.0, mode="filtered")


# ---- the two-level exponential race and its noise ------------------------------------------------
# chunk size S / chunks: 7 -> 1 x 7 (one level), 50 -> 2 x 25, 97 (prime) -> 8 x 13 padded by 7, 256 -> 16 x 16
@pytest.mark.parametrize("V,S", [(7, 1), (50, 2), (97, 8), (256, 16)])
def test_race_matches_softmax_for_any_vocabulary(V, S):
    """Chi-square of the race against softmax, vocabularies that are and are not a multiple of the chunk."""
    assert chunking(V)[0] == S and chunking(151936) == (128, 1187)  # Qwen3's vocabulary: no padding
    S, nc = chunking(V)
    assert nc * S >= V > (nc - 1) * S
    logits = random_logits(V, seed=V, scale=2.0)
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0))
    assert_matches_distribution(tokens, logits.softmax(-1))


def test_race_with_mass_in_one_chunk_and_excluded_neighbours():
    """Every kept token in one chunk, its neighbours excluded (-inf, as filtering leaves them): the chunk
    level must pick that chunk every time and never an excluded token, at any probability ratio."""
    V = 64
    S, _ = chunking(V)
    logits = torch.full((V,), float("-inf"))
    logits[S + 1:S + 4] = torch.tensor([0.0, 3.0, -2.0])  # inside chunk 1 only
    logits[0] = -30.0                                     # tiny but nonzero mass in chunk 0
    tokens, logprobs = _draw(logits, SamplingParams(temperature=1.0))
    assert_matches_distribution(tokens, logits.softmax(-1))
    assert torch.isfinite(logprobs).all()


def test_seeded_race_matches_softmax():
    """The hashed exponentials (one seed per draw, as seeded requests use) sample the target too."""
    logits = random_logits(50, seed=21)
    tokens, _ = _draw(logits, SamplingParams(temperature=0.8, seed=0), seeds=range(N_DRAWS))
    assert_matches_distribution(tokens, (logits / 0.8).softmax(-1))


def test_chi_square_catches_a_wrong_chunk_level(monkeypatch):
    """Negative control for the race: choosing the chunk by its largest logit instead of its mass (a
    plausible bug) skews the draw, and the chi-square check must see it."""
    logits = random_logits(64, seed=22)
    monkeypatch.setattr(sampler_mod, "chunk_log_mass", lambda x, invariant=False: x.amax(dim=-1))
    tokens, _ = _draw(logits, SamplingParams(temperature=1.0))
    with pytest.raises(AssertionError, match="chi2="):
        assert_matches_distribution(tokens, logits.softmax(-1))


def test_hashed_exponentials_are_unit_exponential():
    """Mean 1 and variance 1 to 5 sigma, and u = exp(-E) uniform in 16 bins (chi-square), over 2000 keys."""
    keys = torch.from_numpy(draw_keys(np.arange(2000, dtype=np.uint64), np.zeros(2000, np.int64)).view(np.int64))
    e = hashed_exponentials(keys, 64).double()
    n = e.numel()
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(e.mean().item() - 1) < 5 / math.sqrt(n)
    assert abs(e.var().item() - 1) < 5 * math.sqrt(8 / n)  # Var of the sample variance of Exp(1): 8 / n
    counts = torch.histc((-e).exp(), bins=16, min=0, max=1)
    expected = n / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < chi2_critical(15)
    # another position of the same keys gives other numbers (draws are not reused across steps)
    keys1 = torch.from_numpy(draw_keys(np.arange(2000, dtype=np.uint64), np.ones(2000, np.int64)).view(np.int64))
    assert (hashed_exponentials(keys1, 64) != hashed_exponentials(keys, 64)).float().mean() > 0.99


def test_draw_keys_are_splitmix64_of_seed_and_position():
    seeds = [0, 1, 42, 2**63 + 5, 2**64 - 1]
    for pos in (0, 1, 1000):
        got = draw_keys(np.array(seeds, dtype=np.uint64), np.full(len(seeds), pos, np.int64)).tolist()
        assert got == [splitmix64((s + pos * 0x9E3779B97F4A7C15) % 2**64) for s in seeds]


def test_sample_seed_is_a_stable_hash():
    """sample_seed(s, 0) = s; no collisions over a grid of seeds and indices (seed + i would collide
    everywhere: seed s sample 1 == seed s+1 sample 0); fixed values, the same in every process."""
    assert sample_seed(7, 0) == 7
    grid = {sample_seed(s, i) for s in range(100) for i in range(100)}
    assert len(grid) == 100 * 100
    assert sample_seed(0, 1) != 1 and sample_seed(5, 1) != sample_seed(6, 0)
    assert [sample_seed(0, 1), sample_seed(1, 2), sample_seed(-1, 3)] == SAMPLE_SEED_VALUES
    with pytest.raises(ValueError, match="index"):
        sample_seed(0, -1)
