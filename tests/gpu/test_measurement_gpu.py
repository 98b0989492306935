"""GPU tier of the measurement layer: real CUDA events with the L2 flush, CUDA-graph timing, NVTX,
the profiler's CUDA activity and NVML on a real device. Deselected without a CUDA device
(tests/conftest.py); tools/gpu_check.sh runs them. Nothing asserts on timings."""

import json

import pytest
import torch

from bench import harness
from rlengine.telemetry.nvml import NvmlSampler
from rlengine.telemetry.nvtx import PhaseRanges
from rlengine.telemetry.profiler import ProfileWindow, StepProfiler

pytestmark = pytest.mark.gpu


def test_event_timing_with_flush_and_graphs():
    a = torch.randn(1024, 1024, device="cuda")
    m = harness.measure(lambda: a @ a, device="cuda", iters=5, rep_ms=20)
    assert m["method"] == "cuda-events" and m["l2_flush"] and m["iters"] >= 5 and m["ms"] > 0
    g = harness.measure(lambda: a @ a, device="cuda", cuda_graph=True, graph_calls=5, iters=5)
    assert g["method"] == "cuda-graph x5" and g["ms"] > 0
    bad = harness.measure(lambda: a.sum().item(), device="cuda", cuda_graph=True, iters=3)  # a host sync
    assert "graph capture failed" in bad["method"]
    assert "cudaProfilerStart" in harness.one_launch(lambda: a @ a, label="mm", device="cuda")


def test_nvtx_and_cuda_trace(tmp_path):
    r = PhaseRanges.for_device("cuda")
    assert r.nvtx is not None and r.enabled
    a = torch.randn(256, 256, device="cuda")
    prof = StepProfiler(tmp_path, name="g", window=ProfileWindow(1, 3), device="cuda", ranges=[r])
    with prof:
        for _ in range(4):
            with r("engine.forward"):
                a @ a
            prof.step()
    assert prof.note == ""
    events = json.loads(prof.trace_path.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events) and any(e.get("name") == "engine.forward" for e in events)


def test_nvml_samples_this_process_gpu():
    s = NvmlSampler(cuda_devices=[torch.cuda.current_device()], interval_s=0.01)
    if not s.available:
        pytest.skip(s.reason)
    assert len(s.devices) == 1
    with s:
        with s.phase("decode"):
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(50):
                a @ a
            torch.cuda.synchronize()
    summary = s.summary(tokens=100)
    assert summary.available and summary.power_source in ("instant", "average")
    assert summary.phases["decode"].seconds > 0
    s.close()


def test_cuda_trainer_measures_the_learner_peak_under_the_estimate(tmp_path, capsys):
    """The CUDA trainer runs one learner micro-step before sizing the KV pool: the plan says
    "measured", and the measured peak lies under the estimate (an upper bound) and above its saved part."""
    from rlengine.analysis.activations import activation_parts
    from rlengine.model.config import preset
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer
    from rlengine.plan.memory import learner_head

    tc = load_job_config("rlengine/configs/grpo.toml", [
        "--model.dtype", "bfloat16", "--warmstart.steps", "0", "--train.updates", "1", "--train.prompts_per_step", "8",
        "--train.group_size", "4", "--task.num_eval", "4", "--run.progress", "false", "--gen.num_kv_blocks", "4096",
        "--run.out_dir", str(tmp_path / "run")])
    tr = Trainer(tc)
    plan = tr.memory_plan
    assert plan.activations_measured and "activations: measured" in capsys.readouterr().out
    head, mode = learner_head(tc, "cuda")
    est = activation_parts(preset(tc.model.name), plan.micro_batch * plan.max_model_len, "bfloat16", head=head,
                           mode=mode)
    assert est.saved < plan.activations <= est.total, (est.saved, plan.activations, est.total)
    tr.parts.close()
