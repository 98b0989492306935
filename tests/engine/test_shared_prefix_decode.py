"""Shared-prefix (cascade) decode in the engine equals plain paged decode.

The same requests run with LLM(shared_prefix_decode=True) and =False on the tiny presets in fp32:
greedy tokens identical, log-probs to fp32 rounding (the two attention orders sum differently). Each
case also checks that the cascade path really ran (the backend counts its cascade steps) and that
the plain engine never took it. Covered: several GRPO groups with ragged prompts (partial and exact
shared last pages), groups mixed with n = 1 requests, preemption in the middle of a group (a tight KV
pool: the group splits, the rest decode as a smaller group, the preempted member comes back alone),
members finishing at different lengths (stop tokens), and the Triton backend under the interpreter.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams

from tests.support.tolerances import tol


def _prompts(lengths, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _run(prompts, params, shared, **kw):
    kw.setdefault("dtype", "float32")
    llm = LLM(kw.pop("model", "tiny"), shared_prefix_decode=shared, **kw)
    outs = llm.generate(prompts, params)
    return llm, outs


def _assert_same(outs, refs):
    for out, ref in zip(outs, refs, strict=True):
        for a, b in zip(out.outputs, ref.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs),
                                       **tol(torch.float32))


def _check(prompts, params, **kw):
    llm, outs = _run(prompts, params, True, **kw)
    ref_llm, refs = _run(prompts, params, False, **kw)
    _assert_same(outs, refs)
    assert llm.backend.num_cascade_steps > 0, "the cascade path never ran"
    assert ref_llm.backend.num_cascade_steps == 0
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    return llm, outs


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_groups_greedy_and_sampled_equal_plain_decode(model):
    prompts = _prompts([37, 16, 9, 50])
    params = [SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=6, seed=11, top_p=0.9, max_tokens=12, ignore_eos=True)]
    _check(prompts, params, model=model, block_size=8, max_num_seqs=16)


def test_preemption_in_the_middle_of_a_group():
    """Two groups of 4 with 24-token prompts in a pool with room for about five full sequences: members
    are preempted mid-group and recomputed alone while their siblings keep decoding as a smaller group."""
    prompts = _prompts([24, 27], seed=3)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=24, ignore_eos=True)
    P = 4
    llm, outs = _check(prompts, params, block_size=P, max_num_seqs=8, num_kv_blocks=5 * (24 + 24) // P)
    assert outs.stats["preemptions"] > 0


def test_members_finishing_early_leave_a_smaller_group():
    prompts = _prompts([33], seed=4)
    # seeded sampling over the full vocabulary with stop tokens: members stop at different steps
    params = SamplingParams(n=8, seed=2, temperature=1.5, max_tokens=30, stop_token_ids=list(range(3, 40)))
    llm, outs = _check(prompts, params, block_size=8, max_num_seqs=8)
    assert len({len(c.token_ids) for c in outs[0].outputs}) > 1


def test_triton_backend_under_the_interpreter():
    prompts = _prompts([21, 12], seed=6)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    _check(prompts, params, block_size=8, max_num_seqs=8, attention_backend="triton")


def test_off_switch_and_backends_without_it():
    prompts = _prompts([20])
    params = SamplingParams(n=4, temperature=0.0, max_tokens=4, ignore_eos=True)
    llm, _ = _run(prompts, params, True, block_size=4, attention_backend="torch")
    assert not llm.backend.shared_prefix and llm.backend.num_cascade_steps == 0  # the oracle stays plain


@pytest.mark.parametrize("backend,on", [("cpp", True), ("triton", False), ("torch", False)])
def test_default_is_the_backends_measured_choice(backend, on):
    """shared_prefix_decode=None: on where cascade decode was measured faster (cpp), off for triton (slower on
    an H200) and for the oracle; True still forces it on triton. 40-token prompts in 4-token pages: 10 shared
    pages against 1-2 own ones, so the plan saves well over AUTO_SHARED_FRACTION of the reads."""
    prompts = _prompts([40], seed=3)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=4, ignore_eos=True)
    llm, _ = _run(prompts, params, None, block_size=4, attention_backend=backend)
    assert llm.backend.shared_prefix is on and (llm.backend.num_cascade_steps > 0) is on
    if backend == "triton":
        forced, _ = _run(prompts, params, True, block_size=4, attention_backend=backend)
        assert forced.backend.num_cascade_steps > 0


def test_auto_runs_plain_decode_where_little_is_shared():
    """The long-response job's shape: one shared page of a ~4-page context saves ~20% of the reads, under
    AUTO_SHARED_FRACTION, so the default runs plain decode (and skips the planner while the rows stay the
    same); True still runs cascade there, and both give the same tokens."""
    prompts = _prompts([17, 18], seed=4)
    params = SamplingParams(n=8, temperature=0.0, max_tokens=30, ignore_eos=True)
    auto, outs = _run(prompts, params, None, block_size=16, max_num_seqs=16)
    forced, refs = _run(prompts, params, True, block_size=16, max_num_seqs=16)
    assert auto.backend.shared_prefix and auto.backend.num_cascade_steps == 0
    assert forced.backend.num_cascade_steps > 0
    _assert_same(outs, refs)


def test_auto_takes_cascade_when_the_batch_changes_to_one_worth_it():
    """A batch found not worth it is remembered by its rows; a new batch (long shared prompts) is planned again."""
    params = SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM("tiny", dtype="float32", block_size=4)
    llm.generate(_prompts([3], seed=1), params)  # no whole shared page: plain
    assert llm.backend.num_cascade_steps == 0
    llm.generate(_prompts([40], seed=2), params)
    assert llm.backend.num_cascade_steps > 0
