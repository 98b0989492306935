"""Per-token GRPO credit (train.credit = "token"): the digit tasks' position credit and the per-slot
group-relative advantages, against hand-derived values."""

from __future__ import annotations

import math
import random

import pytest

from rlengine.rl.algo.advantages import grpo_token_advantages
from rlengine.rl.data.tasks import position_credit


def test_position_credit_scores_each_slot_of_the_answer():
    answer = "3141"
    assert position_credit(list("3141") + [""], answer) == [1, 1, 1, 1, 1]
    assert position_credit(list("3941") + [""], answer) == [1, 0, 1, 1, 1]
    assert position_credit(list("31") + [""], answer) == [1, 1, 0]        # <eos> too early
    # past the answer's <eos> slot every token costs one: "31415" + <eos> has 6 tokens, the last extra
    assert position_credit(list("31415") + [""], answer) == [1, 1, 1, 1, 0, -1]
    assert position_credit(list("3141999"), answer) == [1, 1, 1, 1, 0, -1, -1]


def _slot_adv(vals, normalize_std=True, eps=1e-6):
    m = sum(vals) / len(vals)
    if max(vals) == min(vals):
        return [0.0] * len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if normalize_std else 1.0
    return [(v - m) / (sd + (eps if normalize_std else 0.0)) for v in vals]


def test_equal_lengths_judge_each_token_by_its_own_slot():
    rng = random.Random(0)
    G, L = 6, 9
    credits = [[float(rng.random() < 0.4) for _ in range(L)] for _ in range(G)]
    adv = grpo_token_advantages(credits)
    for t in range(L):
        want = _slot_adv([c[t] for c in credits])
        assert [a[t] for a in adv] == pytest.approx(want, abs=1e-12)
    flat = grpo_token_advantages(credits, normalize_std=False)
    for t in range(L):
        assert [a[t] for a in flat] == pytest.approx(_slot_adv([c[t] for c in credits], False), abs=1e-12)


def test_an_early_stop_is_charged_with_the_slots_it_left_empty():
    # A stops at slot 1 (an early <eos>, credit 0); B and C write slot 2 right
    credits = [[1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    adv = grpo_token_advantages(credits)
    s = _slot_adv([0.0, 1.0, 1.0])                  # slots 1 and 2 both compare A's 0 with B, C's 1
    assert adv[0] == pytest.approx([0.0, s[0] + s[0]])  # slot 1 (its <eos>) plus the empty slot 2
    assert adv[1] == pytest.approx([0.0, s[1], s[1]]) and adv[2] == adv[1]
    assert adv[0][1] == pytest.approx(-2 * 2 / 3 / math.sqrt(1 / 3), rel=1e-5)


def test_stopping_in_time_earns_what_the_others_wrote_past_the_answer():
    answer = "12"
    texts = [["1", "2", ""], ["1", "2", "3", "4", ""], ["1", "2", "3", "3", "3", "3"]]
    credits = [position_credit(t, answer) for t in texts]
    assert credits == [[1, 1, 1], [1, 1, 0, -1, -1], [1, 1, 0, -1, -1, -1]]
    adv = grpo_token_advantages(credits)
    s2 = _slot_adv([1.0, 0.0, 0.0])
    s34 = _slot_adv([0.0, -1.0, -1.0])
    s5 = _slot_adv([0.0, 0.0, -1.0])
    assert adv[0] == pytest.approx([0.0, 0.0, s2[0] + 2 * s34[0] + s5[0]])
    assert adv[1] == pytest.approx([0.0, 0.0, s2[1], s34[1], s34[1] + s5[1]])
    assert adv[2] == pytest.approx([0.0, 0.0, s2[2], s34[2], s34[2], s5[2]])
    assert adv[0][2] > 0 > adv[2][3]


def test_a_group_with_no_difference_has_no_advantage():
    assert grpo_token_advantages([[1.0, 0.0, 1.0]] * 4) == [[0.0, 0.0, 0.0]] * 4
    assert grpo_token_advantages([[1.0, 0.0]]) == [[0.0, 0.0]]


def test_a_group_of_equal_rewards_can_still_teach_its_tokens():
    from rlengine.rl.algo.advantages import token_credits_uniform

    # 3 of 4 right in both, at different slots: the same reward, but each wrong slot has a signal
    a, b = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]
    assert not token_credits_uniform([a, b])
    assert any(x != 0 for row in grpo_token_advantages([a, b]) for x in row)
    assert token_credits_uniform([a, list(a)])
    # an empty slot counts as 0: a shorter response differs from one with credit 1 there
    assert not token_credits_uniform([[1.0, 1.0], [1.0]]) and token_credits_uniform([[1.0, 0.0], [1.0]])
    for credits in ([a, b], [a, a], [[1.0, 1.0], [1.0]], [[1.0, 0.0], [1.0]]):
        assert token_credits_uniform(credits) == all(x == 0 for row in grpo_token_advantages(credits) for x in row)
