"""Async rollouts (B_gen > B_train): a request whose policy lag passes max_lag is aborted in flight
as soon as the weights move on, its KV blocks come back, and B_gen stays in flight."""

import pytest

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.data.tasks import Problem, Task

G, P, B_GEN = 4, 2, 32


def _collector(max_lag: int) -> RolloutCollector:
    tok = Tokenizer.builtin()
    problems = [Problem(f"{i}:", str(i % 10)) for i in range(20)]
    task = Task("t", problems, problems[:2], lambda c, a: float(len(c) % 2))
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), max_num_seqs=B_GEN, attention_backend="torch", seed=3)
    # ids 3..34 stop a sample (p ~ 1/8 per token under the random tiny model): lengths spread out,
    # so requests are at different points when collect() returns
    params = SamplingParams(n=G, temperature=1.0, max_tokens=24, stop_token_ids=list(range(3, 35)))
    return RolloutCollector(llm, tok, task, group_size=G, b_train=G * P, b_gen=B_GEN, params=params,
                            sampler=PrioritySampler(20, 0), dynamic_sampling=False, max_lag=max_lag)


def _oldest(col: RolloutCollector, rid: str) -> int | None:
    versions = [v for s in col.llm.requests[rid].seqs for v in s.versions]
    return min(versions) if versions else None


def _blocks(col: RolloutCollector, rids) -> set[int]:
    return {b for rid in rids for s in col.llm.requests[rid].seqs for b in s.block_table}


@pytest.mark.parametrize("max_lag", [0, 1])
def test_stale_requests_are_aborted_and_free_their_blocks(max_lag):
    col = _collector(max_lag)
    assert col.async_mode
    stats = CollectStats()
    col.collect(stats)
    # lag == max_lag is still fresh: nothing is aborted until the weights are max_lag + 1 ahead
    col.llm.weight_version += max_lag
    col.abort_stale(stats)
    assert stats.stale_aborted == 0
    col.llm.weight_version += 1
    version = col.llm.weight_version
    stale = [rid for rid in col.in_flight if (v := _oldest(col, rid)) is not None and version - v > max_lag]
    fresh = [rid for rid in col.in_flight if rid not in stale]
    assert stale, "precondition: requests with generated tokens are in flight"
    held = _blocks(col, stale)
    free_before = col.llm.block_manager.num_free
    col.abort_stale(stats)
    assert stats.stale_aborted == len(stale)
    assert set(col.in_flight) == set(fresh) and not set(stale) & set(col.llm.requests)
    assert col.llm.block_manager.num_free == free_before + len(held)
    # the next collect() refills to B_gen before its first step, and every group it returns is fresh
    in_flight_at_step = []
    step = col.llm.step
    col.llm.step = lambda: (in_flight_at_step.append(len(col.in_flight)), step())[1]
    groups = col.collect(stats)
    assert in_flight_at_step[0] == B_GEN // G
    assert len(groups) == P and all(g.lag(version) <= max_lag for g in groups)
    col.drain()
    assert col.llm.block_manager.num_free == col.llm.block_manager.num_blocks   # nothing leaked


def test_collect_aborts_at_its_top_and_drops_nothing_late():
    """Through collect() alone; with the abort switched off the same run drops stale groups at
    the end instead (so the scenario really has stale requests)."""
    results = {}
    for abort in (True, False):
        col = _collector(0)
        if not abort:
            col.abort_stale = lambda stats: None
        col.collect(CollectStats())
        col.ready.clear()                       # only what was in flight matters here
        col.llm.weight_version += 1
        stats = CollectStats()
        groups = col.collect(stats)
        assert all(g.lag(col.llm.weight_version) == 0 for g in groups)
        results[abort] = stats
    assert results[True].stale_aborted > 0 and results[True].groups_stale == 0
    assert results[False].stale_aborted == 0 and results[False].groups_stale > 0


def test_coupled_mode_never_aborts():
    col = _collector(0)
    col.b_gen = col.b_train                     # B_gen == B_train: synchronous, nothing carries over
    stats = CollectStats()
    col.collect(stats)
    col.llm.weight_version += 5
    col.abort_stale(stats)
    col.collect(stats)
    assert stats.stale_aborted == 0
