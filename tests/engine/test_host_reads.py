"""One device-to-host read per engine step, counted on the CPU.

On a GPU every read of a device value (.item(), .tolist(), .cpu(), bool(t), a pageable copy) is a
sync that stalls the host in the middle of the step. The engine allows exactly one per step:
ModelRunner._read_outputs, which brings back the sampled tokens, their log-probs and the routing
ids in one packed transfer. Here (no GPU) the same code runs with the tensor methods that would
read the device wrapped to count their calls, outside and inside that one read: a decode step must
make exactly one _read_outputs call and no other device read, eagerly and through the CUDA-graph
stand-in. tests/gpu/test_engine_sync_and_backends_gpu.py runs the same steps under
torch.cuda.set_sync_debug_mode("error").
The negative control plants a .tolist() in the sampler and checks that the counter sees it.
Top-k / top-p batches are left out of the strict check on purpose: on the CPU filter_logits reads
the host to pick and compact its rows (free there; a GPU runs masked passes and reads nothing).
Steps with logprobs requests are checked too: their top-k records travel in the packed copy.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.engine.cuda_graph import StaticReplay
from rlengine.engine.model_runner import ModelRunner

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class HostReadCounter:
    """Counts calls of the device-reading tensor methods and of ModelRunner._read_outputs."""

    def __init__(self, monkeypatch):
        self.reads, self.outputs = [], 0
        self._inside = False
        for name in READS:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, orig))
        orig_read = ModelRunner._read_outputs

        def read_outputs(runner, *args):
            self.outputs += 1
            self._inside = True
            try:
                return orig_read(runner, *args)
            finally:
                self._inside = False
        monkeypatch.setattr(ModelRunner, "_read_outputs", read_outputs)

    def _counting(self, name, orig):
        def method(t, *args, **kwargs):
            if not self._inside:
                self.reads.append(name)
            return orig(t, *args, **kwargs)
        return method

    def reset(self):
        self.reads, self.outputs = [], 0


def _engine(graphs: bool, **kw):
    llm = LLM("tiny", dtype="float32", max_num_seqs=8, block_size=4, attention_backend="cpp", **kw)
    if graphs:
        llm._use_decode_graphs(StaticReplay)
        llm.capture_decode_graphs()  # capture is not a step: it may read what it likes
    return llm


MIXED = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
         SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
         SamplingParams(n=2, temperature=0.7, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
def test_one_host_read_per_step(monkeypatch, graphs):
    llm = _engine(graphs)
    for prompt, p in zip([[5, 6, 7], [8] * 9, [9, 10]], MIXED):
        llm.add_request(prompt, p)
    counter = HostReadCounter(monkeypatch)
    steps = 0
    while llm.has_unfinished():
        counter.reset()
        kind_before = len(llm.trace)
        llm.step()
        if len(llm.trace) == kind_before:
            continue
        steps += 1
        assert counter.outputs == 1, f"{llm.trace[-1].kind} step made {counter.outputs} output reads"
        if llm.trace[-1].kind == "decode":
            assert counter.reads == [], f"decode step read the device outside the output read: {counter.reads}"
    assert steps > 10 and sum(r.kind == "decode" for r in llm.trace) >= 10
    if graphs:
        assert llm.runner.graphs.num_replays > 0


def test_the_counter_sees_a_planted_read(monkeypatch):
    """Negative control: a .tolist() hidden in the sampler shows up as a read outside the allowed one."""
    from rlengine.engine import sampler as sampler_mod

    llm = _engine(False)
    llm.add_request([5, 6, 7], MIXED[2])
    llm.step()  # prefill
    orig = sampler_mod.Sampler.__call__
    monkeypatch.setattr(sampler_mod.Sampler, "__call__", lambda self, logits, sb, rules=None: (
        sb.temperature.tolist(), orig(self, logits, sb, rules))[1])
    counter = HostReadCounter(monkeypatch)
    llm.step()
    assert counter.outputs == 1 and counter.reads == ["tolist"]


def test_one_host_read_per_step_with_overlap(monkeypatch):
    """Overlap: each step() launches one step and reads the one before; with both of them decode
    steps, that read is the only device read."""
    llm = _engine(True, async_scheduling=True)
    for prompt, p in zip([[5, 6, 7], [8] * 9, [9, 10]], MIXED):
        llm.add_request(prompt, p)
    counter = HostReadCounter(monkeypatch)
    strict = 0
    while llm.has_unfinished():
        counter.reset()
        records = len(llm.trace)
        llm.step()
        read_kind = llm.trace[-1].kind if len(llm.trace) > records else None
        launched = llm._in_flight.step.batch.kind if llm._in_flight is not None else None
        assert counter.outputs == (read_kind is not None)
        if read_kind == launched == "decode":
            assert counter.reads == [], counter.reads
            strict += 1
    assert strict >= 8 and llm.runner.graphs.num_replays > 0


LOGPROBS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=0),
            SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("graphs,overlap", [(False, False), (True, False), (True, True)],
                         ids=["eager", "graph-replay", "graph-replay-overlap"])
def test_logprobs_records_come_with_the_one_read(monkeypatch, graphs, overlap):
    """A decode step with logprobs requests: the top ids, top log-probs and ranks travel in the packed copy
    behind the step's event, so the step still makes one output read and no other device read."""
    llm = _engine(graphs, async_scheduling=overlap)
    ids = [llm.add_request(prompt, p) for prompt, p in zip([[5, 6, 7], [8] * 9, [9, 10]], LOGPROBS)]
    counter = HostReadCounter(monkeypatch)
    strict, finished = 0, {}
    while llm.has_unfinished():
        counter.reset()
        records = len(llm.trace)
        finished.update((o.request_id, o) for o in llm.step())
        read_kind = llm.trace[-1].kind if len(llm.trace) > records else None
        launched = llm._in_flight.step.batch.kind if llm._in_flight is not None else None
        if read_kind == "decode" and launched in (None, "decode"):
            assert counter.outputs == 1 and counter.reads == [], counter.reads
            strict += 1
    assert strict >= 8
    for rid, k in zip(ids, (3, 0)):
        for c in finished[rid].outputs:
            assert len(c.logprobs) == len(c.token_ids)
            for tok, lp, entry in zip(c.token_ids, c.token_logprobs, c.logprobs):
                assert len(entry) in (k, k + 1) and entry[tok].logprob == pytest.approx(lp, abs=1e-6)
                if k:
                    top = [entry[i].logprob for i in list(entry)[:k]]
                    assert top == sorted(top, reverse=True) and [entry[i].rank for i in list(entry)[:k]] == [1, 2, 3]
