"""Sampling rules beyond temperature / top-k / top-p: penalties, min_tokens and min_p (vLLM's definitions).

The sampler (sampler.py) applies them to the rows of a step that use them, in vLLM's order: min_tokens
bans the stop ids, the penalties adjust the logits (before temperature), min_p drops tokens after it
(sampling_params.py gives the definitions). Penalties need each sequence's token counts: RuleState keeps
them per engine row on the device, [R, V] int32 output-token counts and a [R, V] bool prompt mask, allocated
at the first request that needs them, rebuilt for a row when its sequence is prefilled (admission or
recompute) and incremented on the device by every step's sampled tokens (no host read, nothing recomputed
per step). Cost when unused: the LLM turns the state on at the first request with a rule (`on`); until
then no step looks at the params, after that a step walks its samples' params once on the host, and only
the rows with a rule pay for the tensor work.
Dimension legend: N samples in the step, M / Q / S rows with a penalty / a banned token / min_p, R engine
rows, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlengine.engine.sequence import Sequence


@dataclass(slots=True)
class StepRules:
    """The rules of one step, as device tensors indexing its N samples (None: no row uses that rule)."""

    counts: torch.Tensor | None          # RuleState.counts [R, V] int32 (penalties only)
    pen_idx: torch.Tensor | None         # [M] int64 samples with a penalty
    pen_rows: torch.Tensor | None        # [M] int64 their engine rows
    pen_params: torch.Tensor | None      # [M, 3] fp32 repetition, frequency, presence penalty
    prompt_mask: torch.Tensor | None     # RuleState.prompt_mask [R, V] bool
    ban_idx: torch.Tensor | None         # [Q] int64 sample of each banned (sample, stop id) pair (min_tokens)
    ban_tok: torch.Tensor | None         # [Q] int64 its token id
    min_p_idx: torch.Tensor | None       # [S] int64 sampled rows with min_p > 0
    min_p: torch.Tensor | None           # [S, 1] fp32 their min_p
    processed: torch.Tensor | None       # [N, 1] bool rows in "processed" mode with a rule (their log-prob
    #                                      is taken after the rules)

    def before_temperature(self, logits_NV: torch.Tensor) -> torch.Tensor:
        """min_tokens and the penalties on fp32 logits [N, V] -> a new [N, V] tensor."""
        out = logits_NV.clone()
        if self.ban_idx is not None:
            out[self.ban_idx, self.ban_tok] = float("-inf")
        if self.pen_idx is not None:
            out[self.pen_idx] = apply_penalties(out[self.pen_idx], self.counts[self.pen_rows],
                                                self.prompt_mask[self.pen_rows], self.pen_params)
        return out

    def apply_min_p(self, z_NV: torch.Tensor) -> torch.Tensor:
        """min_p on temperature-scaled logits [N, V]: tokens with p < min_p * p_max -> -inf (in place)."""
        if self.min_p_idx is not None:
            z_NV[self.min_p_idx] = apply_min_p(z_NV[self.min_p_idx], self.min_p)
        return z_NV

    def count(self, tokens_N: torch.Tensor) -> None:
        """Add the step's sampled tokens [N] int64 to the penalised rows' counts (on the device)."""
        if self.pen_idx is not None:
            self.counts.index_put_((self.pen_rows, tokens_N[self.pen_idx]),
                                   torch.ones_like(self.pen_rows, dtype=torch.int32), accumulate=True)


def apply_penalties(logits_MV: torch.Tensor, counts_MV: torch.Tensor, prompt_MV: torch.Tensor,
                    params_M3: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on logits [M, V] fp32: repetition r on tokens of the prompt (prompt [M, V] bool) or the
    output (counts [M, V] int32 > 0): logit / r if logit > 0 else logit * r; then logit -= f * count + p *
    [count > 0]. params [M, 3] = (r, f, p). Returns a new tensor."""
    rep, freq, pres = params_M3[:, 0:1], params_M3[:, 1:2], params_M3[:, 2:3]
    seen = counts_MV > 0
    out = torch.where(seen | prompt_MV, torch.where(logits_MV > 0, logits_MV / rep, logits_MV * rep), logits_MV)
    return out - freq * counts_MV.to(out.dtype) - pres * seen.to(out.dtype)


def apply_min_p(z_SV: torch.Tensor, min_p_S1: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p on temperature-scaled logits [S, V]: p = softmax(z); p < min_p * max(p) -> -inf."""
    probs = z_SV.softmax(dim=-1)
    drop = probs < min_p_S1 * probs.amax(dim=-1, keepdim=True)
    return z_SV.masked_fill(drop, float("-inf"))


class RuleState:
    """Per-row token counts for the penalties, and the per-step StepRules (see the module docstring)."""

    def __init__(self, device: torch.device, vocab_size: int):
        self.device, self.V = device, vocab_size
        self.on = False                          # set by the LLM at the first request with a rule
        self.counts: torch.Tensor | None = None  # [R, V] int32 output-token counts of penalised rows
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool tokens of the row's prompt

    def _rows(self, R: int) -> None:
        """Grow the per-row tensors to at least R rows (the BlockManager grows its rows too)."""
        have = 0 if self.counts is None else self.counts.shape[0]
        if R <= have:
            return
        R = max(R, 2 * have, 8)
        counts = torch.zeros(R, self.V, dtype=torch.int32, device=self.device)
        mask = torch.zeros(R, self.V, dtype=torch.bool, device=self.device)
        if have:
            counts[:have], mask[:have] = self.counts, self.prompt_mask
        self.counts, self.prompt_mask = counts, mask

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def for_step(self, samples: list[Sequence], sample_rows: np.ndarray, prefill: bool) -> StepRules | None:
        """The StepRules of a step's samples (sample_rows [N] their engine rows), or None when no sample has
        a rule. A prefill rebuilds the counts and prompt mask of its penalised rows from their tokens."""
        if not self.on:
            return None
        pen, ban, min_p, processed = [], [], [], []
        for i, seq in enumerate(samples):
            p = seq.params
            if not p.has_rules:
                continue
            if p.penalized:
                pen.append(i)
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                ban.extend((i, t) for t in seq.stop_ids)
            if p.min_p > 0.0 and not p.greedy:
                min_p.append(i)
            if p.logprobs_mode == "processed":
                processed.append(i)
        if not (pen or ban or min_p):
            return None
        rules = StepRules(None, None, None, None, None, None, None, None, None, None)
        if pen:
            rows = sample_rows[pen]
            self._rows(int(rows.max()) + 1)
            if prefill:
                self._rebuild([samples[i] for i in pen], rows)
            rules.counts, rules.prompt_mask = self.counts, self.prompt_mask
            rules.pen_idx, rules.pen_rows = self._tensor(pen, torch.int64), self._tensor(rows.tolist(), torch.int64)
            ps = [samples[i].params for i in pen]
            rules.pen_params = self._tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                             for p in ps], torch.float32)
        if ban:
            pairs = self._tensor(ban, torch.int64)
            rules.ban_idx, rules.ban_tok = pairs[:, 0], pairs[:, 1]
        if min_p:
            rules.min_p_idx = self._tensor(min_p, torch.int64)
            rules.min_p = self._tensor([[samples[i].params.min_p] for i in min_p], torch.float32)
        if processed:
            mask = np.zeros((len(samples), 1), dtype=bool)
            mask[processed] = True
            rules.processed = torch.from_numpy(mask).to(self.device, non_blocking=True)
        return rules

    def _rebuild(self, seqs: list[Sequence], rows: np.ndarray) -> None:
        """Counts and prompt mask of the rows of sequences being prefilled, from their token ids."""
        rows_t = self._tensor(rows.tolist(), torch.int64)
        self.counts[rows_t] = 0
        self.prompt_mask[rows_t] = False
        p_rows, p_tok, o_rows, o_tok = [], [], [], []
        for seq, row in zip(seqs, rows.tolist()):
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            out = [t for t in seq.token_ids[seq.num_prompt_tokens:] if t >= 0]  # overlap: no placeholders
            p_rows += [row] * len(prompt)
            p_tok += prompt
            o_rows += [row] * len(out)
            o_tok += out
        self.prompt_mask[self._tensor(p_rows, torch.int64), self._tensor(p_tok, torch.int64)] = True
        if o_tok:
            self.counts.index_put_((self._tensor(o_rows, torch.int64), self._tensor(o_tok, torch.int64)),
                                   torch.ones(len(o_tok), dtype=torch.int32, device=self.device), accumulate=True)
