"""What copy-digits' format warm start leaves at the first answer slot, the one read from ":".

The long-response job (rlengine/configs/grpo_long.toml) stalled on some seeds because RL sharpened
that slot onto a wrong prompt position (all G samples agreeing, no signal) while the other 23
slots, each read from the digit before it, learned the copy. Its warm start therefore answers with
the prompt's first digit, then prompt digits at random positions. These tests check both halves:
the first slot reads the first digit after the warm start, and the rest stay at chance (exact match
about 0, so RL still has 23 slots to learn). Chance at a slot is the expected share of the prompt's
24 digits equal to the right one: (1 + 23 / 10) / 24 = 0.1375.
"""

from __future__ import annotations

import random

import torch

from rlengine.model.factory import build_model
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.config import load_job_config
from rlengine.rl.data.tasks import build_task
from rlengine.rl.data.warmstart import format_warmstart

CHANCE = (1 + 23 / 10) / 24


def test_copy_digits_warm_start_answers_give_the_first_digit_and_random_prompt_digits_after_it():
    task, rng = build_task("copy-digits"), random.Random(7)
    hits = total = 0
    for problem in task.train[:300]:
        answer = task.warmstart_answer(problem, rng)
        assert len(answer) == len(problem.answer) == 24
        assert answer[0] == problem.answer[0]
        assert set(answer) <= set(problem.prompt[:-1])
        hits += sum(a == b for a, b in zip(answer[1:], problem.answer[1:]))
        total += 23
    # 6900 draws at p = 0.1375 (sd 0.004): the rule is not taught past the first slot
    assert abs(hits / total - CHANCE) < 0.02, hits / total


def test_after_the_warm_start_the_first_slot_reads_the_first_digit_and_the_others_do_not():
    # one thread: two OpenMP threads on a loaded 2-core machine spin against each other (minutes, not seconds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p_right = _right_digit_probability_per_slot()
    finally:
        torch.set_num_threads(threads)
    assert p_right[0] > 0.4, p_right[0]       # 0.61 here; about chance (0.12-0.14) with random first digits
    assert p_right[1:].max() < 0.25, p_right  # the other slots stay near chance: 1.0 would be the rule


def _right_digit_probability_per_slot() -> torch.Tensor:
    """[24] the teacher-forced probability of the right digit at each answer slot after grpo_long's warm start."""
    tok, task = Tokenizer.builtin(), build_task("copy-digits")
    w = load_job_config("rlengine/configs/grpo_long.toml").warmstart
    model = build_model("tiny", seed=3, device="cpu")
    format_warmstart(model, tok, task, steps=w.steps, lr=w.lr, batch=w.batch, seed=3)
    seqs = [tok.encode(p.prompt) + tok.encode(p.answer) for p in task.eval[:64]]
    L, S = len(tok.encode(task.eval[0].prompt)), len(seqs[0])
    with torch.no_grad():
        logits = model.forward_packed(torch.tensor(sum(seqs, [])), list(range(0, S * len(seqs) + 1, S)))
    logp = logits.float().log_softmax(-1).view(len(seqs), S, -1)
    targets = torch.tensor(seqs)[:, L:]
    return logp[:, L - 1:-1].gather(2, targets.unsqueeze(-1)).squeeze(-1).exp().mean(0)
