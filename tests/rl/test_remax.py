"""remax: a greedy rollout per prompt as the baseline, from the same engine, in the same collect, with the
current weights; advantages as verl 0.9.1's compute_remax_outcome_advantage.

The greedy reference is an independent argmax loop over the model's plain causal forward (no KV cache, no
engine), on a random tiny model whose next-token distribution is near uniform: the argmax token is
strictly the most probable (the margin is checked) but far from certain, so sampled responses differ from
it. The advantage is compared with values verl computed itself (the fixture's "remax" part,
tools/verl_golden.py) within 1e-10 in float64.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.cli import main
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.algo.overlong import shape_overlong
from rlengine.rl.algo.registry import ESTIMATORS
from rlengine.rl.data.tasks import Problem, Task
from rlengine.rl.learner.batching import estimate_batch
from rlengine.rl.rollout.baseline import GreedyBaselines, baseline_metrics
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.distributed import Dist
from rlengine.rl.rollout_group import RolloutGroup
from rlengine.rl.trainer.record import UpdateTimes, boundary_since, engine_mark

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())["remax"]
REMAX = ESTIMATORS["remax"]
G, MAX_TOKENS, EOS = 4, 6, 2
# ids 100..255 stop a response (p ~ 0.6 per sampled token under the near-uniform tiny model), so groups
# finish in a step or two; the greedy path of the tiny model (tied embeddings) repeats the prompt's last
# token, 17 ('='), and runs to MAX_TOKENS: baselines outlast their groups
STOPS = list(range(100, 256))


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _reward(completion: str, answer: str) -> float:
    return 0.25 * len(completion) + float(completion.startswith(answer))  # varies with the response


def _collector(model, *, P: int, b_gen: int, baselines: bool = True, prompts: int = 3):
    tok = Tokenizer.builtin()
    problems = [Problem(f"{i}{i}+{i}=", str(i % 10)) for i in range(prompts)]
    task = Task("t", problems, problems[:1], _reward)
    llm = LLM(model, max_num_seqs=b_gen, attention_backend="torch", seed=3)
    params = SamplingParams(n=G, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=STOPS)
    col = RolloutCollector(llm, tok, task, group_size=G, b_train=P * G, b_gen=b_gen, params=params,
                           sampler=PrioritySampler(prompts, 0), dynamic_sampling=False, max_lag=1)
    if baselines:
        col.baselines = GreedyBaselines(llm, tok, col.runner, params)
    return col


def _argmax_path(model, prompt: list[int]) -> list[int]:
    """Greedy decoding by full causal forwards of prompt + the tokens so far (the reference)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids]))[0, -1].double()
            top = logits.topk(2).values
            assert top[0] - top[1] > 1e-4, "precondition: a strict argmax (fp32 engine rounding is ~1e-6)"
            assert logits.softmax(-1).max() < 0.5, "precondition: the argmax is not certain"
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] == EOS or out[-1] in STOPS:
                break
    return out


def _check_baselines(col, groups, model):
    """Each group's baseline is its prompt's argmax path, scored; most sampled responses differ from it."""
    differ = 0
    for g in groups:
        path = _argmax_path(model, g.prompt_ids)
        assert g.baseline_ids == path
        assert g.baseline == _reward(col.tok.decode(path), col.task.train[g.problem_index].answer)
        differ += sum(c != path for c in g.completions)
    assert differ > len(groups) * G // 2


def test_baseline_is_the_argmax_path_of_the_current_weights():
    """Coupled collection: each group's baseline is the argmax path under the weights of that collect();
    after the weights change in place between two collects, the baseline follows the new weights."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=1)
    col = _collector(model, P=2, b_gen=2 * G, prompts=1)
    first = col.collect(CollectStats())
    _check_baselines(col, first, model)
    before = _argmax_path(model, first[0].prompt_ids)
    with torch.no_grad():  # an in-place write, as the optimizer's: every logit flips sign, argmax -> old argmin
        model.model.norm.weight.neg_()
    col.llm.weight_version += 1
    second = col.collect(CollectStats())
    _check_baselines(col, second, model)
    assert second[0].baseline_ids != before, "precondition: the new weights have another argmax path"


def test_async_collection_holds_groups_for_their_baselines_and_drains_them():
    """Async (B_gen > B_train): every returned group carries its own prompt's greedy baseline; requests
    left in flight keep theirs, and drain() aborts them and frees every KV block."""
    model = Qwen3ForCausalLM(preset("tiny"), seed=1)
    col = _collector(model, P=2, b_gen=6 * G)
    assert col.async_mode
    groups = col.collect(CollectStats())
    assert len(groups) == 2
    _check_baselines(col, groups, model)
    b = col.baselines
    assert set(b.decoding) | set(b.scored) | set(b.held) <= set(col.in_flight) | {p.out.request_id for p in col.pending}
    col.drain()
    assert not (b.decoding or b.scored or b.held or b.group_of or b.problems)
    assert not col.llm.requests and col.llm.block_manager.num_free == col.llm.block_manager.num_blocks


def test_baseline_decode_is_counted_in_the_update_and_never_trained_on():
    """The collect() the trainer times as t_gen decodes the baselines: the boundary's gen_tokens are the
    sampled tokens plus the greedy ones (without baselines: the sampled ones alone), no request is left
    in the engine afterwards, and the update's batch packs exactly the P * G sampled responses."""
    for with_baselines in (True, False):
        col = _collector(Qwen3ForCausalLM(preset("tiny"), seed=1), P=3, b_gen=3 * G, baselines=with_baselines)
        mark = engine_mark(col.llm)
        stats = CollectStats()
        groups = col.collect(stats)
        assert not col.llm.has_unfinished()
        boundary = boundary_since(col.llm, mark, responses=3 * G, times=UpdateTimes(1.0, 1.0, 1.0, 1.0))
        sampled = sum(len(c) for g in groups for c in g.completions)
        greedy = sum(len(g.baseline_ids) for g in groups)
        assert (greedy > 0) == with_baselines and stats.greedy_baselines == with_baselines
        assert not with_baselines or any(len(g.baseline_ids) > max(map(len, g.completions)) for g in groups), \
            "precondition: a baseline decodes past the end of its group"
        assert boundary.generated_tokens == sampled + greedy
        if with_baselines:
            groups_with = groups
    metrics = baseline_metrics(groups_with, Dist())
    assert metrics["remax/baseline_tokens"] == sum(len(g.baseline_ids) for g in groups_with)
    batch = estimate_batch(groups_with, REMAX, SimpleNamespace())
    assert batch.num_seqs == 3 * G
    packed = [batch.input_ids[a:b].tolist() + [batch.targets[b - 1].item()]
              for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
    assert packed == [g.prompt_ids + c for g in groups_with for c in g.completions]


def test_a_remax_job_decodes_and_logs_its_baselines(tmp_path):
    """`rlengine train --train.adv_estimator remax` end to end (one update): the plan asks the rollout for
    greedy baselines, the record logs remax/*, and its gen_tokens are the sampled tokens plus the greedy ones."""
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    cfg = load_job_config("grpo", ["--warmstart.steps", "0", "--train.updates", "1", "--train.prompts_per_step", "2",
                                   "--train.group_size", "2", "--eval.every", "100", "--task.num_eval", "2",
                                   "--task.num_train", "8", "--run.progress", "false", "--train.adv_estimator", "remax",
                                   "--run.out_dir", str(tmp_path / "r")])
    record = Trainer(cfg).run()[-1]
    assert record["remax/baseline_tokens"] == 2 * record["remax/baseline_length_mean"] > 0
    sampled = record["response_length/mean"] * cfg.train.b_train
    assert record["gen_tokens"] == pytest.approx(sampled + record["remax/baseline_tokens"], abs=1e-9)


@pytest.mark.parametrize("case", FIXTURE, ids=lambda c: c["case"])
def test_advantage_matches_verl(case):
    """verl's advantages on model tokens (verl keeps the return on observation tokens, which no loss reads;
    rlengine gives 0 on every masked token). Each term matters: the baseline, and the reverse cumsum."""
    rewards, mask, base = _t(case["rewards"]), _t(case["mask"]), _t(case["reward_baselines"])
    got = REMAX.token_level_fn(rewards, mask, torch.tensor(case["index"]), None, baseline_B=base)
    torch.testing.assert_close(got, _t(case["advantages"]) * mask, atol=1e-10, rtol=0)
    assert bool((got[mask == 0] == 0).all())
    no_base = REMAX.token_level_fn(rewards, mask, None, None, baseline_B=torch.zeros_like(base))
    assert (no_base - _t(case["advantages"]) * mask).abs().max() > 1e-3
    if case["case"] == "dense":  # per-token rewards: the reward-to-go, not the token's own reward
        assert (rewards - base[:, None] * mask - _t(case["advantages"]) * mask).abs().max() > 1e-3


def test_packed_batch_gets_score_minus_its_prompts_baseline():
    """Through estimate_batch: outcome rewards on each response's last token, so every trained token of
    response i of group p gets r_pi - b_p; prompt positions 0. A group without a baseline is named."""
    gen = torch.Generator().manual_seed(5)
    groups = []
    for p in range(3):
        lengths = torch.randint(1, 6, (G,), generator=gen).tolist()
        comps = [torch.randint(3, 40, (n,), generator=gen).tolist() for n in lengths]
        rewards = torch.rand(G, generator=gen).tolist()
        groups.append(RolloutGroup(p, [1, 5 + p, 7], comps, [[-1.0] * len(c) for c in comps], rewards,
                                   [[0] * len(c) for c in comps], ["stop"] * G,
                                   baseline=float(torch.rand((), generator=gen)), baseline_ids=[9, 9]))
    batch = estimate_batch(groups, REMAX, SimpleNamespace())
    want = torch.cat([torch.tensor([0.0] * 2 + [r - g.baseline] * len(c))
                      for g in groups for c, r in zip(g.completions, g.rewards)])
    torch.testing.assert_close(batch.advantages, want, atol=1e-6, rtol=0)  # fp32 subtraction of two [0, 1) values
    groups[1].baseline = None
    with pytest.raises(ValueError, match=r"problems \[1\]"):
        estimate_batch(groups, REMAX, SimpleNamespace())


def test_soft_overlong_shapes_the_baseline_by_its_own_length():
    """train.overlong = soft: the greedy baseline is the same shaped reward as the samples it is compared with."""
    group = RolloutGroup(0, [1], [[5] * 3, [5] * 8], [[-1.0] * 3, [-1.0] * 8], [1.0, 1.0], [[0] * 3, [0] * 8],
                         ["stop", "length"], baseline=1.0, baseline_ids=[5] * 7)
    shape_overlong([group], "soft", max_tokens=8, buffer=4)
    assert group.rewards == [1.0, 0.0] and group.baseline == 0.25  # R_len(7) = (4 - 7) / 4


@pytest.mark.parametrize("argv,named", [
    (["--train.algo", "ppo", "--train.adv_estimator", "remax"], "train.adv_estimator = 'remax' takes no critic"),
    (["--train.adv_estimator", "remax", "--env.name", "tools", "--env.tools", "lookup"], "env.name"),
])
def test_a_config_remax_cannot_run_is_one_line_exit_2(argv, named, tmp_path, capsys, monkeypatch):
    import rlengine.rl.trainer

    def reached(*a, **k):
        raise AssertionError("the config check let a job remax cannot run through to the trainer")

    monkeypatch.setattr(rlengine.rl.trainer.Trainer, "__init__", reached)
    monkeypatch.chdir(tmp_path)
    code = main(["train", *argv, "--run.out_dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().count("\n") == 0 and named in err, err
    assert not (tmp_path / "r").exists()
