"""rlengine/benchmarks/harness.py (also `bench.harness`) and the provenance every benchmark JSON records, on the CPU.

The GPU timing loop (events + L2 flush, one sync) runs here with a perf_counter stand-in for
torch.cuda.Event; the real events, the flush buffer and CUDA-graph timing need a GPU
(tests/gpu/test_measurement_gpu.py). Nothing here asserts on how long anything took.
"""

import json
import re
import time

import pytest

from bench import harness
from rlengine.telemetry.provenance import engine_state, git_state, provenance


class CpuEvent:
    """torch.cuda.Event's record / elapsed_time on the host clock."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_event_loop_flushes_before_every_call_and_syncs_once():
    log = []
    times = harness.event_times(lambda: log.append("call"), 5, event=CpuEvent,
                                flush=lambda: log.append("flush"), sync=lambda: log.append("sync"))
    assert log == ["flush", "call"] * 5 + ["sync"]
    assert len(times) == 5 and all(t >= 0 for t in times)


def test_measure_on_cpu_reports_method_and_spread():
    calls = []
    m = harness.measure(lambda: calls.append(1), warmup=2, iters=7)
    assert len(calls) == 9 and m["iters"] == 7 and m["method"] == "perf_counter" and m["l2_flush"] is False
    assert m["min_ms"] <= m["p10_ms"] <= m["ms"] <= m["p90_ms"] <= m["max_ms"]
    assert "no CUDA device" in harness.measure(lambda: None, iters=2, cuda_graph=True)["method"]
    assert "nothing for ncu" in harness.one_launch(lambda: None, label="x")


def test_parse_grid_is_a_cartesian_product_in_order():
    cases = harness.parse_grid("B=1,8 L=128,1024 mode=fwd")
    assert cases == [{"B": 1, "L": 128, "mode": "fwd"}, {"B": 1, "L": 1024, "mode": "fwd"},
                     {"B": 8, "L": 128, "mode": "fwd"}, {"B": 8, "L": 1024, "mode": "fwd"}]
    assert harness.parse_grid("x=0.5;y=a,b") == [{"x": 0.5, "y": "a"}, {"x": 0.5, "y": "b"}]
    for bad in ("", "B", "B=", "=1"):
        with pytest.raises(ValueError):
            harness.parse_grid(bad)


def test_rates_against_ceilings():
    ceilings = {"bandwidth_bytes_per_s": 2e11, "flops_per_s": {"float32": 1e12, "bfloat16": 4e12}}
    r = harness.rates(2.0, nbytes=1e8, flops=1e9, ceilings=ceilings, dtype="bfloat16")
    assert r["GBps"] == pytest.approx(50.0) and r["bw_frac"] == pytest.approx(0.25)
    assert r["TFLOPs"] == pytest.approx(0.5) and r["flops_frac"] == pytest.approx(0.125)
    assert set(harness.rates(1.0, nbytes=1.0)) == {"GBps"}           # no ceilings: no fractions


def test_provenance_fields():
    g = git_state()
    if g["commit"] is None:
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{40}", g["commit"]) and g["commit_short"] == g["commit"][:7]
    assert isinstance(g["dirty"], bool) and (g["dirty_diff_sha1"] is not None) == g["dirty"]
    p = provenance("cpu", extra_field=3)
    for key in ("time", "commit", "dirty", "torch", "python", "device", "cpu_count", "torch_threads", "triton"):
        assert key in p
    assert p["extra_field"] == 3 and p["device"] == "cpu"
    # the CPU by name (lscpu's Model name) and by the flags that decide kernel choices
    assert p["cpu_model"] not in ("", "x86_64") and isinstance(p["cpu_isa"], list)
    if "avx2" in open("/proc/cpuinfo").read():
        assert "avx2" in p["cpu_isa"]


def test_engine_state_says_what_actually_ran():
    from rlengine.model.config import preset
    from rlengine.engine import LLM
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=0), max_num_seqs=2, attention_backend="auto")
    s = engine_state(llm)
    assert s["attention_backend"] in ("cpp", "torch")                # "auto" resolved to a real backend
    assert s["cuda_graphs"].startswith("off: ") and s["cuda_graph_buckets"] is None


def test_report_writes_rows_with_provenance_and_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"B": b, "L": l, "ref_ms": 1.0 * b, "new_ms": 0.5 * b} for b in (1, 2, 4, 16) for l in (8, 32)]
    path = harness.report("demo", rows, out=tmp_path, extra={"grid": "B=1,2,4,16 L=8,32"},
                          plot={"path": tmp_path / "demo.png", "x": "B", "y": ["ref_ms", "new_ms"], "group": ["L"]})
    data = json.loads(path.read_text())
    assert data["rows"] == rows and data["grid"] == "B=1,2,4,16 L=8,32"
    assert {"commit", "dirty", "device", "torch"} <= set(data["conditions"])
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
