"""Multi-turn rollouts in the RL layer: environments (rl/env/), trajectories in the collector and TrainBatch,
limits and their counts, GAE over model tokens, and bad environment input.

A scripted environment (fixed observations, reward from the model's last turn) runs through the real
engine and collector; the packed batch's loss mask must equal each token's role (model 1, observation 0)
at every position, whole and across micro-batches and splits. GAE is checked against verl 0.9.1's
multi-turn recursion (core_algos.compute_gae_advantage_return: values and TD errors on observation
tokens skipped), written out as a plain loop over a right-padded response row.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.cli.commands import _user_errors
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import Problem, Task
from rlengine.rl.env import (End, Environment, EnvError, Observation, TrajectoryDriver, TrajectoryLimits,
                             load_environment)
from rlengine.rl.learner.batching import grpo_batch, ppo_batch
from rlengine.rl.learner.update import packed_gae
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.rollout.trajectories import trajectory_metrics
from rlengine.rl.trainer.run_outputs import samples_rows

G, P = 4, 2
OBS = [[5, 6, 7], list(range(40, 52))]  # the second observation crosses pages (block_size 4)


class ScriptedEnv(Environment):
    """Fixed observations after turns 0 and 1; after turn 2 the episode ends, reward from the last token."""

    def step(self, turn):
        if turn.index < len(OBS):
            return Observation(token_ids=list(OBS[turn.index])) if turn.index else list(OBS[0])
        return End(float(turn.token_ids[-1] % 2), {"turns": turn.index + 1})


class VaryingEnv(ScriptedEnv):
    """As ScriptedEnv, but a prompt row's answer digit d ends its episodes after turn d % 3: lengths differ."""

    def step(self, turn):
        return End(1.0) if turn.index >= int(self.problem.answer) % 3 else super().step(turn)


class BadEnv(Environment):
    def step(self, turn):
        return 3.5


class OutOfVocabEnv(Environment):
    def step(self, turn):
        return [5, 10 ** 6]


def _llm():
    return LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), max_num_seqs=2 * G * P, block_size=4)


def _collector(limits, b_gen=G * P, max_lag=0, env=ScriptedEnv):
    problems = [Problem(f"{i}:", str(i % 10)) for i in range(6)]
    task = Task("t", problems, problems[:2], lambda *a: 0.0)
    driver = TrajectoryDriver(env, Tokenizer.builtin(), limits)
    col = RolloutCollector(_llm(), Tokenizer.builtin(), task, group_size=G, b_train=G * P, b_gen=b_gen,
                           params=SamplingParams(n=G, temperature=1.0), sampler=PrioritySampler(6, 0),
                           dynamic_sampling=False, max_lag=max_lag, env=driver)
    return col, driver


def _rows(groups):
    """(prompt, completion, roles, log-probs) of every trajectory, in packing order."""
    return [(g.prompt_ids, c, r, lp) for g in groups for c, r, lp in zip(g.completions, g.roles, g.logprobs)]


def _check_roles(batch, rows):
    """Every packed position: mask = role of the token it predicts, old log-prob / advantage 0 off model tokens."""
    assert batch.num_seqs == len(rows)
    for b, (prompt, comp, roles, lps) in enumerate(rows):
        a, e = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
        n = len(comp)
        assert e - a == len(prompt) + n - 1
        assert batch.loss_mask[a:e - n].eq(0).all()  # prompt positions
        assert batch.loss_mask[e - n:e].tolist() == [float(r) for r in roles]
        assert batch.targets[e - n:e].tolist() == comp
        obs = torch.tensor(roles) == 0
        assert batch.old_logprobs[e - n:e][obs].eq(0).all() and batch.advantages[e - n:e][obs].eq(0).all()
        assert batch.old_logprobs[e - n:e][~obs].tolist() == pytest.approx([x for x, r in zip(lps, roles) if r])


def test_trajectories_collect_pack_and_keep_their_roles_across_micro_batches():
    col, driver = _collector(TrajectoryLimits(max_turns=4, max_turn_tokens=5, max_obs_tokens=64,
                                              max_total_tokens=200))
    stats = CollectStats()
    groups = col.collect(stats)
    assert len(groups) == P and sum(len(g.completions) for g in groups) == G * P  # N counts trajectories
    for g in groups:
        assert g.end_reasons == ["env"] * G and len(g.roles) == G
        for comp, roles, segs, lps, versions in zip(g.completions, g.roles, g.turns, g.logprobs, g.versions):
            assert [s[0] for s in segs] == ["model", "observation", "model", "observation", "model"]
            for role, a, e in segs:
                assert roles[a:e] == [1 if role == "model" else 0] * (e - a)
            assert [comp[a:e] for role, a, e in segs if role == "observation"] == OBS
            assert len(versions) == sum(roles) and len(lps) == len(comp)
        assert g.rewards == [float(c[-1] % 2) for c in g.completions]
    assert col.llm.block_manager.num_free == col.llm.block_manager.num_blocks
    batch = grpo_batch(groups, normalize_std=True)
    rows = _rows(groups)
    _check_roles(batch, rows)
    for parts in [batch.micro_batches(size) for size in (1, 3, 5)] + [batch.split(3)]:
        b = 0
        for mb in parts:
            _check_roles(mb, rows[b:b + mb.num_seqs])
            b += mb.num_seqs
        assert b == len(rows)
    rows = samples_rows(groups, [0.0] * len(rows), Tokenizer.builtin(), update=1, n=G * P)
    for row, (_, comp, roles, _) in zip(rows, _rows(groups)):
        assert [t["role"] for t in row["turns"]] == ["model", "observation"] * 2 + ["model"]
        assert sum(t["tokens"] for t in row["turns"]) == len(comp) and row["end_reason"] == "env"
        assert (row["model_tokens"], row["observation_tokens"]) == (sum(roles), sum(map(len, OBS)))
    m = trajectory_metrics(groups, driver.counts)
    assert m["num_turns/mean"] == 3 and m["multi_turn/obs_tokens_mean"] == sum(map(len, OBS))
    assert m["multi_turn/ended_env"] == G * P


def test_limits_cut_and_count_each_reason():
    # observations cut to 4 tokens; 2 model turns at most -> every trajectory cut at its second turn
    col, driver = _collector(TrajectoryLimits(max_turns=2, max_turn_tokens=3, max_obs_tokens=4,
                                              max_total_tokens=200))
    stats = CollectStats()
    groups = col.collect(stats)
    assert all(e == "max_turns" for g in groups for e in g.end_reasons)
    assert driver.counts["cut_max_turns"] == G * P and driver.counts["obs_truncated"] == G * P
    assert stats.trajectory_counts == dict(driver.counts)
    m = trajectory_metrics(groups, stats.trajectory_counts)
    assert m["multi_turn/cut_max_turns"] == G * P and m["multi_turn/obs_truncated_total"] == G * P
    assert all(sum(1 for r in roles if r == 0) == 3 for g in groups for roles in g.roles)  # OBS[0] fits
    # a per-trajectory budget of 8 tokens: turn 1 (3) + observation (3) leave 2 -> turn 2, then cut
    col, driver = _collector(TrajectoryLimits(max_turns=4, max_turn_tokens=3, max_obs_tokens=64, max_total_tokens=8))
    groups = col.collect(CollectStats())
    assert driver.counts["cut_max_total_tokens"] == G * P
    assert all(len(c) <= 8 for g in groups for c in g.completions)
    assert all(g.rewards == [0.0] * G for g in groups)  # Environment.on_cut's default reward


def test_gae_skips_observation_tokens_as_verl_does():
    g = torch.Generator().manual_seed(3)
    col, _ = _collector(TrajectoryLimits(max_turns=4, max_turn_tokens=4, max_total_tokens=200))
    groups = col.collect(CollectStats())
    batch = ppo_batch(groups)
    values = torch.randn(batch.input_ids.shape[0], generator=g)
    batch.rewards = torch.rand(batch.num_seqs, generator=g)
    gamma, lam = 0.9, 0.8
    adv, ret = packed_gae(batch, values, None, gamma=gamma, lam=lam, kl_coef=0.0)
    for b, (a, e) in enumerate(zip(batch.cu_seqlens, batch.cu_seqlens[1:])):
        mask = batch.loss_mask[a:e]
        first = int(mask.nonzero()[0])  # the response row starts at the first model token
        m, v = mask[first:].double(), values[a + first:e].double()
        r = torch.zeros_like(v)
        r[int(m.nonzero()[-1])] = batch.rewards[b]
        nextvalues, lastgaelam, out = 0.0, 0.0, []
        for t in reversed(range(len(m))):  # verl 0.9.1 compute_gae_advantage_return
            delta = r[t] + gamma * nextvalues - v[t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = v[t] * m[t] + (1 - m[t]) * nextvalues
            lastgaelam = lastgaelam_ * m[t] + (1 - m[t]) * lastgaelam
            out.append(lastgaelam)
        ref = torch.stack(out[::-1])
        keep = m > 0
        assert (m == 0).any()  # observation tokens inside the row: the case this checks
        torch.testing.assert_close(adv[a + first:e][keep].double(), ref[keep], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret[a + first:e][keep].double(), (ref + v)[keep], rtol=1e-5, atol=1e-6)
        assert adv[a:e][mask == 0].eq(0).all()


def test_async_lag_aborts_stale_trajectories_and_a_checkpoint_boundary_drops_the_rest_counted():
    """Async (B_gen = 2 B_train): trajectories left in flight hold KV between turns; once the weights move past
    max_lag = 0 they are aborted (lag = the oldest version of any of their tokens); drain() (a checkpoint
    boundary, what a resumed run restarts from) drops the others, counted; every block comes back."""
    col, driver = _collector(TrajectoryLimits(max_turns=4, max_turn_tokens=4, max_total_tokens=200),
                             b_gen=2 * G * P, max_lag=0, env=VaryingEnv)
    stats = CollectStats()
    col.collect(stats)
    assert driver.live and col.in_flight
    col.llm.weight_version += 1
    old = {rid for rid in col.in_flight if any(s.versions for s in col.llm.requests[rid].seqs)}
    col.abort_stale(stats)
    assert old and stats.stale_aborted == len(old) and not old & set(col.in_flight)
    assert driver.counts["dropped_in_flight"] == G * len(old)
    left = len(col.in_flight)
    col.drain()
    assert driver.counts["dropped_in_flight"] == G * (len(old) + left) and not driver.live
    assert col.llm.block_manager.num_free == col.llm.block_manager.num_blocks and not col.llm.requests


def test_bad_environments_stop_with_one_line():
    with pytest.raises(EnvError, match="cannot import module 'no_such_env_module'") as e:
        load_environment("no_such_env_module:Env")
    assert isinstance(e.value, _user_errors()) and "\n" not in str(e.value)  # the CLI: one line, exit 2
    with pytest.raises(EnvError, match="no attribute"):
        load_environment("tests.rl.test_multi_turn_trajectories:Missing")
    assert load_environment("tests.rl.test_multi_turn_trajectories:ScriptedEnv") is ScriptedEnv
    llm = _llm()
    for env, message in ((BadEnv, r"BadEnv.step \(turn 1\): step\(\) returned float"),
                         (OutOfVocabEnv, r"OutOfVocabEnv.step \(turn 1\): its observation was refused: .*outside")):
        driver = TrajectoryDriver(env, Tokenizer.builtin(), TrajectoryLimits())
        rid = llm.add_request([3, 4, 5], driver.first_turn(SamplingParams(n=2, max_tokens=3)), multi_turn=True)
        driver.add(rid, 2, Problem("p", "a"))
        with pytest.raises(EnvError, match=message) as e:
            while True:
                llm.step()
                driver.advance(llm)
        assert "\n" not in str(e.value)
        seq = llm.requests[rid].seqs[0]  # nothing lost: the trajectory still waits, its tokens and KV intact
        assert seq.status.value == "paused" and seq.block_table and len(seq) == 3 + len(seq.logprobs)
        llm.abort_request(rid)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
