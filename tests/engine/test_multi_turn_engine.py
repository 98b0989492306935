"""Trajectories in the engine (engine/turns.py): a paused sequence keeps its KV, takes an observation and
resumes with one chunk prefill on top of its cache.

Reference: a fresh engine fed the whole conversation so far (prompt, model turns, observations) as its
prompt, with the same sampler seed; the draws are keyed by (seed, position), so the same logits give the
same tokens. Batch-invariant mode promises the same bits (torch.equal); the default mode reduces the
chunk's attention in another order than a fresh prefill, so in bf16 log-probs agree within
low_precision_bounds(L). The step
trace's prefill tokens show that the history is prefilled once: the prompt once for the whole group,
then per turn only the last model token and the observation.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.engine.sampling_params import sample_seed
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM

from tests.support.engine_learner_logprobs import low_precision_bounds

SEED, G, MAX_TOKENS = 11, 2, 6


def _model(dtype, invariant):
    model = Qwen3ForCausalLM(preset("tiny"), seed=3, dtype=dtype)
    model.batch_invariant = invariant
    return model


def _conversation(vocab, seed=4):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (9,), generator=g).tolist()
    # observations of 5 and 11 tokens: chunks that end inside a page and cross pages (block_size 4)
    observations = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11)]
    return prompt, observations


def run_scripted(llm, prompt, observations, params, max_tokens=MAX_TOKENS, delay=0):
    """Drive params.n trajectories through len(observations) + 1 turns; returns per trajectory the list of
    TurnOutputs and the final RequestOutput. delay: trajectory 0's observations come that many engine steps
    after its turn ends (a slow environment), the others' at once."""
    rid = llm.add_request(prompt, params, multi_turn=True)
    turns = {i: [] for i in range(params.n)}
    held = []  # (step at which it is answered, turn)
    final, step = None, 0
    while final is None:
        for out in llm.step():
            final = out
        step += 1
        for t in llm.take_turns():
            turns[t.index].append(t)
            held.append((step + (delay if t.index == 0 else 0), t))
        for due, t in [h for h in held if h[0] <= step]:
            held.remove((due, t))
            k = len(turns[t.index])
            if k <= len(observations):
                llm.continue_turn(rid, t.index, observations[k - 1], max_tokens)
            else:
                llm.end_trajectory(rid, t.index)
    return turns, final


def _reference_turn(model, history, seed_key, invariant, max_tokens, stops=()):
    """A fresh engine's one-turn answer to the whole conversation so far."""
    llm = LLM(model, max_num_seqs=1, block_size=4, batch_invariant=invariant)
    out = llm.generate([history], SamplingParams(temperature=1.0, seed=seed_key, max_tokens=max_tokens,
                                                 ignore_eos=True, stop_token_ids=list(stops)))[0].outputs[0]
    return out.token_ids, torch.tensor(out.token_logprobs)


# first=1: the first turn is the token sampled at the prefill, so the group still shares the prompt's partial
# last page and the first chunk copies it on write (BlockManager.extend). overlap: async scheduling, where the
# step launched before a stop was read still samples for the trajectory (its output must be voided), so its
# turns end at stop tokens (a quarter of the vocabulary), not at a length the scheduler knows in advance.
@pytest.mark.parametrize("dtype,invariant,first,overlap", [(torch.float32, True, MAX_TOKENS, False),
                                                           (torch.bfloat16, False, MAX_TOKENS, False),
                                                           (torch.float32, True, 1, False),
                                                           (torch.float32, True, MAX_TOKENS, True)])
def test_scripted_environment_equals_a_fresh_engine_on_the_whole_conversation(dtype, invariant, first, overlap):
    stops = tuple(range(3, 67)) if overlap else ()
    model = _model(dtype, invariant)
    prompt, observations = _conversation(model.config.vocab_size)
    llm = LLM(model, max_num_seqs=4, block_size=4, batch_invariant=invariant, async_scheduling=overlap)
    params = SamplingParams(n=G, temperature=1.0, seed=SEED, max_tokens=first, ignore_eos=True,
                            stop_token_ids=list(stops))
    trace_start = len(llm.trace)
    turns, final = run_scripted(llm, prompt, observations, params)
    worst = torch.zeros(())
    for i in range(G):
        history = list(prompt)
        assert len(turns[i]) == len(observations) + 1
        for k, turn in enumerate(turns[i]):
            ref_tokens, ref_lps = _reference_turn(model, history, sample_seed(SEED, i), invariant,
                                                  first if k == 0 else MAX_TOKENS, stops)
            assert turn.token_ids == ref_tokens, (i, k)
            lps = torch.tensor(turn.logprobs)
            if invariant:
                assert torch.equal(lps, ref_lps), (i, k)
            worst = torch.maximum(worst, (lps - ref_lps).abs().max())
            history += turn.token_ids + (observations[k] if k < len(observations) else [])
        out = final.outputs[i]
        assert prompt + out.token_ids == history  # the request's output: every generated and observation token
        assert out.token_logprobs == [lp for t in turns[i] for lp in t.logprobs]
    if not invariant:
        assert worst <= low_precision_bounds(model.config.num_hidden_layers)[0]
    prefill = sum(r.tokens for r in llm.trace[trace_start:] if r.kind == "prefill")
    assert prefill == len(prompt) + G * sum(1 + len(o) for o in observations)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_a_trajectory_preempted_while_waiting_and_while_decoding_gives_the_same_trajectory():
    """Too few blocks for three trajectories: parked ones are preempted first (recomputed whole on resume),
    decoding ones too; each trajectory's tokens and log-probs equal an unpressured run's."""
    model = _model(torch.float32, True)
    prompt, observations = _conversation(model.config.vocab_size)
    params = SamplingParams(n=3, temperature=1.0, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    roomy, _ = run_scripted(LLM(model, max_num_seqs=4, block_size=4, batch_invariant=True), prompt, observations,
                            params)
    # one trajectory reaches 9 + 3 * 6 + 16 = 43 tokens = 11 blocks, the whole cache: three cannot fit
    tight_llm = LLM(model, max_num_seqs=4, block_size=4, num_kv_blocks=11, batch_invariant=True)
    tight, final = run_scripted(tight_llm, prompt, observations, params, delay=2)
    assert tight_llm.scheduler.num_parked_preemptions > 0
    assert tight_llm.scheduler.num_preemptions > tight_llm.scheduler.num_parked_preemptions
    for i in range(3):
        assert [t.token_ids for t in tight[i]] == [t.token_ids for t in roomy[i]]
        assert [t.logprobs for t in tight[i]] == [t.logprobs for t in roomy[i]]
    assert tight_llm.block_manager.num_free == 11


def test_waiting_trajectories_keep_their_blocks_and_count_toward_max_num_seqs():
    model = _model(torch.float32, False)
    prompt, observations = _conversation(model.config.vocab_size)
    llm = LLM(model, max_num_seqs=G, block_size=4)
    params = SamplingParams(n=G, temperature=1.0, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    rid = llm.add_request(prompt, params, multi_turn=True)
    other = llm.add_request(prompt, SamplingParams(max_tokens=3))
    ended = []
    while len(ended) < G:
        llm.step()
        ended += llm.take_turns()
    sched = llm.scheduler
    assert len(sched.parked) == G and all(s.block_table for s in sched.parked)
    assert not sched.running and len(sched.waiting) == 1  # the other request waits: the cap is full
    held = llm.block_manager.num_blocks - llm.block_manager.num_free
    assert llm.step() == [] and llm.block_manager.num_blocks - llm.block_manager.num_free == held
    for t in ended:
        llm.end_trajectory(rid, t.index)
    outs = [o for _ in range(20) for o in llm.step()]
    assert {o.request_id for o in outs} == {rid, other}


def test_bad_continuations_are_refused_and_leave_the_trajectory_waiting():
    model = _model(torch.float32, False)
    prompt, _ = _conversation(model.config.vocab_size)
    llm = LLM(model, max_num_seqs=2, block_size=4, max_model_len=32)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), multi_turn=True)
    while not llm.scheduler.parked:
        llm.step()
    turn, = llm.take_turns()
    with pytest.raises(ValueError, match="outside"):
        llm.continue_turn(rid, 0, [5, 10 ** 6], 4)
    with pytest.raises(ValueError, match="no room"):
        llm.continue_turn(rid, 0, [5] * 40, 4)
    with pytest.raises(ValueError, match="no trajectory"):
        llm.continue_turn(rid, 3, [5], 4)
    assert len(llm.requests[rid].seqs[0]) == turn.num_tokens  # nothing appended
    llm.continue_turn(rid, 0, [5, 6], 4)
    with pytest.raises(ValueError, match="not waiting"):
        llm.continue_turn(rid, 0, [5], 4)
    with pytest.raises(ValueError, match="token-in/token-out"):
        llm.add_request(prompt, SamplingParams(logprobs=2), multi_turn=True)
