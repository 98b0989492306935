"""Profiling tools on the CPU: NVTX ranges (a fake NVTX module stands in for torch.cuda.nvtx, which
a CPU build lacks), record_function labels and the torch.profiler window driver (the trace file is
written, loads as Chrome-trace JSON and holds exactly the chosen steps)."""

import json

import pytest
import torch

from rlengine.telemetry.nvtx import ENGINE_PHASES, LEARNER_PHASES, PhaseRanges, nvtx_unavailable_reason
from rlengine.telemetry.profiler import NullProfiler, ProfileWindow, StepProfiler, step_profiler


class FakeNvtx:
    def __init__(self):
        self.calls = []

    def range_push(self, name):
        self.calls.append(("push", name))

    def range_pop(self):
        self.calls.append(("pop",))


def test_ranges_are_inert_on_cpu():
    r = PhaseRanges.for_device("cpu")
    assert r.nvtx is None and not r.enabled and "cpu" in nvtx_unavailable_reason("cpu")
    a, b = r("engine.forward"), r("engine.sample")
    assert a is b                                # one shared null context: no allocation per call
    with a:
        with b:                                  # re-entrant
            pass
    r.push("x")
    r.pop()                                      # nothing open: a no-op
    with pytest.raises(ValueError, match="nvtx=True"):
        PhaseRanges.for_device("cpu", nvtx=True)


def test_ranges_push_and_pop_nvtx_in_order():
    nv = FakeNvtx()
    r = PhaseRanges(nvtx=nv)
    with r("engine.forward"):
        with r("engine.sample"):
            pass
    r.push("learner.optimizer")
    r.pop()
    assert nv.calls == [("push", "engine.forward"), ("push", "engine.sample"), ("pop",), ("pop",),
                        ("push", "learner.optimizer"), ("pop",)]
    with pytest.raises(KeyError):                # an exception in the body still closes the range
        with r("engine.postprocess"):
            raise KeyError("x")
    assert nv.calls[-1] == ("pop",)
    assert set(ENGINE_PHASES) == {f"engine.{p}" for p in ("schedule", "prepare", "forward", "sample", "postprocess")}
    assert LEARNER_PHASES == ("learner.forward-backward", "learner.optimizer")


def _names(trace_path):
    data = json.loads(trace_path.read_text())
    return [e.get("name", "") for e in data["traceEvents"]]


def test_step_profiler_records_the_window_with_labels(tmp_path):
    r = PhaseRanges()
    prof = StepProfiler(tmp_path, name="t", window=ProfileWindow.parse("2:4"), ranges=[r])
    with prof:
        for i in range(6):
            with r("engine.forward"):
                torch.randn(16, 16) @ torch.randn(16, 16)
            prof.step()
    assert not r.record and not r.enabled        # labels off again after the window
    assert prof.trace_path == tmp_path / "t.pt.trace.json" and "CPU activity only" in prof.note
    names = _names(prof.trace_path)
    steps = sorted({n for n in names if n.startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert "engine.forward" in names and any(n.startswith("aten::mm") for n in names)
    assert "steps 2..3" in prof.table_path.read_text()


def test_window_cut_short_is_still_written(tmp_path):
    prof = step_profiler(tmp_path, name="short", window=ProfileWindow(0, 100))
    prof.start()
    torch.ones(3).sum()
    prof.step()
    prof.stop()
    assert prof.trace_path.is_file() and "traceEvents" in json.loads(prof.trace_path.read_text())


def test_null_profiler_and_bad_windows():
    prof = step_profiler(None)
    assert isinstance(prof, NullProfiler)
    with prof:
        prof.step()
    assert prof.trace_path is None
    for bad in ("3", "a:b", "4:4", "-1:2"):
        with pytest.raises(ValueError):
            ProfileWindow.parse(bad)


def _engine_outputs(nv=None):
    from rlengine.model.config import preset
    from rlengine.engine import LLM, SamplingParams
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=0), max_num_seqs=2, attention_backend="torch")
    if nv is not None:
        llm.ranges = llm.runner.ranges = PhaseRanges(nvtx=nv)
    return llm, llm.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))


def test_engine_step_emits_its_phase_ranges():
    """Every engine step opens schedule, prepare, forward, sample and postprocess, balanced."""
    nv = FakeNvtx()
    llm, outs = _engine_outputs(nv)
    assert not _engine_outputs()[0].ranges.enabled            # CPU default: inert
    pushed = [c[1] for c in nv.calls if c[0] == "push"]
    assert set(ENGINE_PHASES) <= set(pushed)
    assert pushed.count("engine.schedule") == len(outs.trace)      # one per engine step
    assert len(pushed) == sum(c[0] == "pop" for c in nv.calls)


def test_learner_update_emits_its_phase_ranges():
    from rlengine.rl.learner.batching import grpo_batch
    from rlengine.rl.config import TrainSection
    from rlengine.rl.learner.learner import Learner
    from rlengine.rl.rollout_group import RolloutGroup

    llm, outs = _engine_outputs()
    learner = Learner(llm.model, TrainSection(prompts_per_step=2, group_size=2, lr=1e-9))
    assert not learner.ranges.enabled                         # CPU: inert
    nv = FakeNvtx()
    learner.ranges = PhaseRanges(nvtx=nv)
    groups = [RolloutGroup(i, o.prompt_token_ids, [c.token_ids for c in o.outputs], [c.token_logprobs for c in o.outputs],
                           [0.0, 1.0], [c.policy_versions for c in o.outputs], ["length"] * 2)
              for i, o in enumerate(outs)]
    learner.step(grpo_batch(groups, normalize_std=True))
    assert nv.calls == [("push", "learner.forward-backward"), ("pop",), ("push", "learner.optimizer"), ("pop",)]


def test_train_profile_writes_a_trace(tmp_path):
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    cfg = load_job_config("rlengine/configs/grpo.toml", [
        "--warmstart.steps", "2", "--train.updates", "2", "--train.prompts_per_step", "2", "--train.group_size", "2",
        "--eval.every", "2", "--task.num_eval", "4", "--task.num_train", "8", "--run.progress", "false",
        "--run.out_dir", str(tmp_path / "run")])
    Trainer(cfg, profile=tmp_path / "prof", profile_window="1:2").run()
    names = _names(tmp_path / "prof" / "train.pt.trace.json")
    assert "ProfilerStep#1" in names and "learner.optimizer" in names and "engine.forward" in names
