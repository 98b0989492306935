"""Overlap scheduling (LLM(async_scheduling=True)) against the synchronous engine, on the CPU.

With overlap, step t+1 is launched before step t is read: its inputs that step t samples come from
step t's device tokens, a sequence that stops at step t runs one step too many (its token dropped),
and sequences at their length limit are not scheduled again. Greedy and seeded sampling do not
depend on batch composition, so every token must equal the synchronous engine's (log-probs to fp32
rounding: batches differ by a step), through forks (copy-on-write), recompute preemption, stop
tokens, max_model_len, an abort while a step is in flight, and CUDA-graph replays (the CPU
stand-in). On a CPU a launch runs to its end, so this checks the bookkeeping, not the speed.
Step records must tile the generation time: with a fake clock their seconds add up to the
wall-clock span of the run.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.engine.cuda_graph import StaticReplay
from rlengine.engine.model_runner import ModelRunner
from rlengine.model import Qwen3ForCausalLM

from tests.support.tolerances import tol

MODEL = Qwen3ForCausalLM(preset("tiny"), seed=3)


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 9, 14, 3, 11, 7)]


def _params(stop_token: int):
    return [SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, stop_token_ids=[stop_token]),
            SamplingParams(n=3, seed=4, max_tokens=12, ignore_eos=True),                 # fork, copy-on-write
            SamplingParams(n=2, seed=9, top_k=20, top_p=0.9, max_tokens=16, ignore_eos=True,
                           stop_token_ids=[stop_token], logprobs_mode="processed"),
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),             # hits max_model_len
            SamplingParams(seed=1, temperature=0.7, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token], ignore_eos=True)]


def _engine(async_scheduling: bool, graphs: bool = False, **kw):
    llm = LLM(MODEL, max_num_seqs=8, block_size=4, max_model_len=32, attention_backend="cpp",
              async_scheduling=async_scheduling, **kw)
    if graphs:
        llm._use_decode_graphs(StaticReplay, sizes=[2, 4, 8])
    return llm


def _stop_token():
    """A token the greedy request 0 produces mid-way: stop tokens then really fire."""
    out = _engine(False).generate(_prompts()[:1], SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True))
    return out[0].outputs[0].token_ids[6]


def _assert_same(outs, refs):
    for out, ref in zip(outs, refs):
        for a, b in zip(out.outputs, ref.outputs):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), **tol(torch.float32))


@pytest.mark.parametrize("graphs,kv_blocks", [(False, None), (False, 20), (True, 20)],
                         ids=["eager", "eager-preempting", "graph-replay-preempting"])
def test_overlap_matches_the_synchronous_engine(graphs, kv_blocks):
    stop = _stop_token()
    prompts, params = _prompts(), _params(stop)
    ref = _engine(False, num_kv_blocks=kv_blocks).generate(prompts, params)
    llm = _engine(True, graphs, num_kv_blocks=kv_blocks)
    outs = llm.generate(prompts, params)
    _assert_same(outs, ref)
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert any(len(o.prompt_token_ids) + len(c.token_ids) == 32 for o in outs for c in o.outputs)
    if kv_blocks:
        assert outs.stats["preemptions"] > 0
    if graphs:
        assert llm.runner.graphs.num_replays > 0
    while llm.has_unfinished():  # a last launched step of stopped sequences may still be unread
        llm.step()
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    assert all(t >= 0 for o in outs for c in o.outputs for t in c.token_ids)


def test_abort_while_a_step_is_in_flight():
    prompts, params = _prompts()[:3], _params(_stop_token())[:3]
    ref = _engine(False).generate(prompts, params)
    llm = _engine(True)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished = {}
    for i in range(60):
        if i == 4:
            assert llm._in_flight is not None
            llm.abort_request(ids[1])  # its sequences are in the launched step
        finished.update((o.request_id, o) for o in llm.step())
        if not llm.has_unfinished():
            break
    assert set(finished) == {ids[0], ids[2]}
    _assert_same([finished[ids[0]], finished[ids[2]]], [ref[0], ref[2]])
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_step_records_add_up_to_the_generation_time(monkeypatch):
    """Fake clock (+1 per reading): with overlap each record runs from the previous step's read to its
    own (the first from its launch), so the records' seconds tile the run: they add up to its span."""
    import time as time_mod

    prompts, params = _prompts(), _params(_stop_token())
    clock = iter(range(10**6))
    monkeypatch.setattr(time_mod, "perf_counter", lambda: float(next(clock)))
    llm = _engine(True)
    start = time_mod.perf_counter()
    outs = llm.generate(prompts, params)
    while llm.has_unfinished():
        llm.step()
    span = time_mod.perf_counter() - start
    total = sum(r.seconds for r in llm.trace)
    assert len(llm.trace) > 10 and all(r.seconds > 0 for r in llm.trace)
    assert 0 <= span - total <= 2, (span, total)  # only the readings before the first launch and after the last read
    assert sum(r.num_seqs_prefilled for r in llm.trace) >= sum(len(o.outputs) for o in outs)


def test_one_output_read_per_launched_step(monkeypatch):
    prompts, params = _prompts(), _params(_stop_token())
    reads = []
    orig = ModelRunner._read_outputs
    monkeypatch.setattr(ModelRunner, "_read_outputs", lambda self, step: reads.append(step.step_id) or orig(self, step))
    llm = _engine(True)
    llm.generate(prompts, params)
    while llm.has_unfinished():
        llm.step()
    assert reads == list(range(1, len(reads) + 1)) and len(reads) == len(llm.trace)


def test_the_comparison_catches_stale_input_tokens(monkeypatch):
    """Negative control: without the device gather of the in-flight step's tokens, inputs are the stale
    host tokens and the overlap engine's outputs differ from the synchronous engine's."""
    from rlengine.engine.step_inputs import StepInputs

    prompts, params = _prompts(), _params(_stop_token())
    ref = _engine(False).generate(prompts, params)
    orig = StepInputs._prepare_decode
    monkeypatch.setattr(StepInputs, "_prepare_decode",
                        lambda self, batch, pad_to, prev: orig(self, batch, pad_to, None))
    with pytest.raises(AssertionError):
        _assert_same(_engine(True).generate(prompts, params), ref)


class _GpuLikeStaging:
    """The GPU's staging on the CPU: two host slots and a separate device buffer (StepInputs' layout under
    overlap on a GPU). Each upload's source bytes are kept until a point that, on a GPU, orders after the
    non_blocking copy: the read of a step's outputs (its event follows every queued copy) or a device wait
    (graph_cls.wait_device). A slot whose bytes changed before then would have been copied half-rewritten:
    `races` counts those uploads."""

    def __init__(self, llm, monkeypatch):
        inputs = self.inputs = llm.runner.inputs
        n = inputs.dev.numel()
        inputs._hosts = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
        inputs._hosts_np = [h.numpy() for h in inputs._hosts]
        inputs.dev = torch.zeros(n, dtype=torch.uint8)
        inputs._views.clear()
        self.pending, self.races = [], 0
        upload = inputs._upload

        def recorded_upload(nbytes):
            self.pending.append((inputs._slot, nbytes, inputs.host[:nbytes].clone()))
            upload(nbytes)
        monkeypatch.setattr(inputs, "_upload", recorded_upload)
        read = ModelRunner._read_outputs
        monkeypatch.setattr(ModelRunner, "_read_outputs", lambda runner, step: self.settle() or read(runner, step))

    def settle(self) -> None:
        for slot, n, snapshot in self.pending:
            self.races += not torch.equal(self.inputs._hosts[slot][:n], snapshot)
        self.pending.clear()


def test_capturing_a_bucket_waits_for_the_step_in_flight(monkeypatch):
    """With overlap, the first decode step in a new bucket captures it from launch(), while the previous step's
    input copy may still read the staging slot the capture's fill_padding rewrites. The capture must wait for
    the device first: no upload may see its slot rewritten before the copy is known done, and the tokens
    equal the synchronous engine's."""
    prompts, params = _prompts(), _params(_stop_token())
    ref = _engine(False).generate(prompts, params)
    llm = LLM(MODEL, max_num_seqs=8, block_size=4, max_model_len=32, attention_backend="cpp", async_scheduling=True)
    staging = _GpuLikeStaging(llm, monkeypatch)

    class WaitingReplay(StaticReplay):
        wait_device = staticmethod(staging.settle)
    llm._use_decode_graphs(WaitingReplay, sizes=[2, 4, 8])
    outs = llm.generate(prompts, params)
    while llm.has_unfinished():
        llm.step()
    _assert_same(outs, ref)
    assert llm.runner.graphs.num_replays > 0 and len(llm.runner.graphs.graphs) == 3  # captured mid-run
    assert staging.races == 0, f"{staging.races} staging uploads were rewritten before their copy was done"
