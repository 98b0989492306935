"""verl's metric names in every update row: explained variance and the row's fields by hand, the
scores of every scored response (before the dynamic-sampling filter), critic-only rows, timings."""

import json
import math
import random
import resource

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.algo.value import explained_variance, explained_variance_sums
from rlengine.rl.config import TrainSection, load_job_config
from rlengine.rl.data.tasks import Problem, Task
from rlengine.rl.distributed import Dist
from rlengine.rl.learner.batching import pack
from rlengine.rl.learner.learner import Learner
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer.verl_metrics import advantage_sums, verl_fields

from tests.support.short_runs import SHORT_RUN, short_run_config

VERL_KEYS = {
    "actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
    "actor/grad_norm", "critic/vf_loss", "critic/vf_explained_var", "critic/score/mean", "critic/score/max",
    "critic/score/min", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/max", "timing_s/gen", "timing_s/update_actor", "timing_s/testing",
    "timing_s/save_checkpoint", "timing_s/step", "perf/throughput", "perf/max_memory_allocated_gb"}


def _by_hand_ev(values, returns, valid):
    d = [r - v for r, v, ok in zip(returns, values, valid) if ok]
    r = [x for x, ok in zip(returns, valid) if ok]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    return 1.0 - var(d) / var(r)


def test_explained_variance_by_hand():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(97, generator=g) * 2 + 0.5
    values = returns + torch.randn(97, generator=g) * 0.7
    valid = torch.rand(97, generator=g) > 0.3
    want = _by_hand_ev(values.tolist(), returns.tolist(), valid.tolist())
    got = explained_variance(explained_variance_sums(values, returns, valid))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)  # float64 sums of 97 fp32 inputs
    # two ranks' sums added give the one-batch answer
    halves = [explained_variance_sums(values[s], returns[s], valid[s]) for s in (slice(0, 40), slice(40, None))]
    assert explained_variance([a + b for a, b in zip(*halves)]) == pytest.approx(want, rel=1e-9, abs=1e-12)
    # constant returns: no variance to explain
    assert explained_variance(explained_variance_sums(values, torch.full((97,), 0.3), valid)) is None


def test_learner_reports_the_critic_explained_variance():
    model = Qwen3ForCausalLM(preset("tiny"), seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (3, 5, 4, 6)]
    comps = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (4, 2, 5, 3)]
    lps = [(-torch.rand(len(c), generator=g)).tolist() for c in comps]
    batch = pack(prompts, comps, lps, [0.0] * 4, [0.8, -0.3, 1.5, 0.1])
    learner = Learner(model, TrainSection(algo="ppo", prompts_per_step=4, group_size=1, kl_coef=0.0))
    with torch.no_grad():  # a critic that is not zero everywhere (its head starts at zero)
        learner.critic.head.weight.normal_(0.0, 1.0, generator=g)
    values, returns = learner.ppo_advantages(batch)
    want = _by_hand_ev(values.tolist(), returns.tolist(), (batch.loss_mask > 0).tolist())
    m = learner.compute_grads(batch)
    assert m["vf_explained_var"] == pytest.approx(want, rel=1e-6, abs=1e-9)  # fp32 critic values
    assert learner.compute_grads(batch, critic_only=True)["vf_explained_var"] == pytest.approx(want, rel=1e-6)


def _fields(m, *, critic_only=False, has_critic=True):
    return verl_fields(m=m, critic_only=critic_only, has_critic=has_critic, scores=[0.0, 1.0, 0.25, 1.0],
                       advantages=advantage_sums(torch.tensor([0.5, -1.5, 2.0, 9.0]),
                                                 torch.tensor([True, True, True, False])),
                       response_lengths=[3, 8, 5], prompt_lengths=[4, 4, 7], finish_reasons=["stop", "length", "stop"],
                       dist=Dist())


def test_verl_fields_by_hand():
    rng = random.Random(1)
    m = {k: rng.uniform(0.1, 2.0) for k in ("pg_loss", "entropy", "clip_frac", "approx_kl", "kl_ref",
                                           "actor_grad_norm", "value_loss", "critic_grad_norm", "vf_explained_var")}
    f = _fields(m)
    assert f["actor/pg_loss"] == m["pg_loss"] and f["actor/entropy"] == m["entropy"]
    assert f["actor/pg_clipfrac"] == m["clip_frac"] and f["actor/ppo_kl"] == m["approx_kl"]
    assert f["actor/grad_norm"] == m["actor_grad_norm"] and f["actor/pg_clipfrac_lower"] is None
    assert f["critic/vf_loss"] == m["value_loss"] and f["critic/vf_explained_var"] == m["vf_explained_var"]
    assert (f["critic/score/mean"], f["critic/score/max"], f["critic/score/min"]) == (2.25 / 4, 1.0, 0.0)
    # the masked token (9.0) is not a trained one
    assert f["critic/advantages/mean"] == pytest.approx(1.0 / 3, rel=1e-12)
    assert (f["critic/advantages/max"], f["critic/advantages/min"]) == (2.0, -1.5)
    assert (f["response_length/mean"], f["response_length/max"], f["response_length/min"]) == (16 / 3, 8, 3)
    assert f["response_length/clip_ratio"] == 1 / 3 and (f["prompt_length/mean"], f["prompt_length/max"]) == (5, 7)
    assert _fields({**m, "clip_frac_dual": 0.125})["actor/pg_clipfrac_lower"] == 0.125
    # a critic-only update has no actor terms; a job without a critic no value loss
    assert all(v is None for k, v in _fields(m, critic_only=True).items() if k.startswith("actor/"))
    assert _fields(m, has_critic=False)["critic/vf_loss"] is None


@pytest.mark.parametrize("b_gen", [8, 16], ids=["coupled", "async"])
def test_scores_are_every_scored_response_before_the_filter(b_gen):
    rng, seen = random.Random(3), []

    def reward(completion, answer):
        seen.append(float(rng.random() < 0.15))  # most groups all-fail: the filter drops them
        return seen[-1]

    problems = [Problem(f"{i}:", str(i % 10)) for i in range(20)]
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), max_num_seqs=b_gen, attention_backend="torch")
    col = RolloutCollector(llm, Tokenizer.builtin(), Task("t", problems, problems[:2], reward), group_size=4,
                           b_train=8, b_gen=b_gen, params=SamplingParams(n=4, temperature=1.0, max_tokens=3),
                           sampler=PrioritySampler(20, 0), dynamic_sampling=True, max_lag=4, max_filter_factor=4)
    stats = CollectStats()
    col.collect(stats)
    assert stats.groups_dropped > 0, "the filter dropped groups (else this checks nothing)"
    # async: groups scored but still pending at the end of the call count in a later one
    assert stats.scores == seen[:len(stats.scores)] and len(stats.scores) == 4 * stats.groups_scored
    assert len(stats.scores) == len(seen) or b_gen > 8
    assert sum(stats.rewards) / len(stats.rewards) != sum(seen) / len(seen)  # the retained batch's is biased


def test_every_row_has_the_verl_keys_and_consistent_timings(tmp_path):
    history = Trainer(short_run_config(tmp_path, "run", ["--run.checkpoint_every", "3"])).run()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(history))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30
    for r in rows[1:]:
        assert VERL_KEYS <= set(r), VERL_KEYS - set(r)
        assert r["critic/vf_loss"] is None and r["actor/entropy"] > 0  # GRPO: no critic
        assert r["timing_s/gen"] == r["t_gen"] and r["timing_s/update_actor"] == r["t_train"]
        assert (r["timing_s/testing"] > 0) == ("J" in r)                      # eval every 2 updates
        assert (r["timing_s/save_checkpoint"] > 0) == (r["update"] == 3)
        parts = r["t_gen"] + r["t_train"] + r["timing_s/testing"] + r["timing_s/save_checkpoint"]
        assert r["timing_s/step"] >= parts
        tokens = 16 * (r["prompt_length/mean"] + r["response_length/mean"])  # B_train = 16, one process
        assert r["perf/throughput"] == pytest.approx(tokens / r["timing_s/step"], rel=1e-12)
        assert 0 < r["perf/max_memory_allocated_gb"] <= peak
        assert r["critic/score/min"] <= r["critic/score/mean"] <= r["critic/score/max"]
        assert r["response_length/clip_ratio"] == r["overlong_frac"]


def test_critic_only_rows_log_no_actor_terms(tmp_path):
    cfg = load_job_config("rlengine/configs/ppo.toml", SHORT_RUN + [
        "--train.group_size", "1", "--train.critic_warmup", "2", "--train.updates", "3", "--run.out_dir",
        str(tmp_path / "ppo")])
    steps = Trainer(cfg).run()[1:]
    assert [r["critic_only"] for r in steps] == [True, True, False]
    actor = [k for k in VERL_KEYS if k.startswith("actor/")] + ["loss", "logprob_diff", "kl_ref"]
    for r in steps:
        assert all((r[k] is None) == r["critic_only"] for k in actor if k != "actor/pg_clipfrac_lower"), r
        assert r["critic/vf_loss"] >= 0 and r["critic/grad_norm"] >= 0  # logged (not None) on every PPO row
        assert r["critic/vf_explained_var"] is None or math.isfinite(r["critic/vf_explained_var"])
