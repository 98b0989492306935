"""The decode-step profile (rlengine/benchmarks/micro/decode_profile.py) on the tiny preset: every part is
timed, the parts and the host remainder add up to the instrumented step, the engine is left as it was,
and the linear floor takes the fastest candidate of each shape, in the step's order. No assertion on how long anything took."""

import json

import pytest
import torch

from rlengine.benchmarks.micro import decode_profile as prof
from rlengine.model import ops as op_dispatch


def test_profile_rows_parts_add_up_and_engine_is_restored(tmp_path):
    assert prof.main(["--model", "tiny", "--dtypes", "float32", "--batches", "1,3", "--steps", "3", "--rounds", "3",
                      "--clock", "cpu", "--hf-gen-len", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_profile.json").read_text())["rows"]
    assert [(r["dtype"], r["b_act"]) for r in rows] == [("float32", 1), ("float32", 3)]
    for r in rows:
        for part in ("projections", "lm_head", "attention", "norms", "rope", "act", "sampler", "prepare"):
            assert r[f"{part}_ms"] > 0, part                      # every patched piece ran inside the steps
        parts = sum(r[f"{p}_ms"] for p in prof.PARTS) + r["host_ms"]
        assert parts == pytest.approx(r["instrumented_ms"], rel=1e-9)
        assert r["ratio"] == pytest.approx(r["hf_ms"] / r["step_ms"])
        assert set(r["linear_best"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
        assert r["linear_ms"] > 0 and all(v["ms"] > 0 for v in r["linear_best"].values())
        ratios = sorted(x["step_over_linear"] for x in r["rounds"])     # the row is the median round
        assert len(ratios) == 3 and r["step_over_linear"] == pytest.approx(ratios[1])
        assert r["step_over_linear"] == pytest.approx(r["step_ms"] / r["linear_ms"])
    assert op_dispatch.CPU_OPS is op_dispatch.fused_ops_for(torch.device("cpu"))


def test_bad_rounds_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        prof.main(["--rounds", "0"])
    assert exc.value.code == 2 and "--rounds and --steps must be >= 1" in capsys.readouterr().err


def test_instrumented_engine_is_restored_and_counts_calls():
    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(preset("tiny"))
    llm = prof._decode_engine(model, 2, 5, 2)
    original_ops = op_dispatch.CPU_OPS
    timers = prof.Timers()
    with prof.instrumented(llm, timers):
        assert op_dispatch.CPU_OPS is not original_ops
        llm.step()
    assert timers.s["attention"] > 0 and timers.s["projections"] > 0
    assert op_dispatch.CPU_OPS is original_ops
    for obj, name in ((llm.backend, "attend"), (llm.backend, "plan"), (llm.model, "compute_logits"),
                      (llm.model.model.embed_tokens, "forward")):
        assert name not in vars(obj)                               # the class's method again
    before = dict(timers.s)
    llm.step()
    assert timers.s == before                                      # no timer runs outside the block


def test_linear_floor_takes_the_fastest_candidate(monkeypatch):
    """On a fake clock each candidate costs a set time per call: the floor sums the cheapest per shape."""
    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()

    def costs(seconds):
        def call(x, w):
            clock.now += seconds
        return call

    model = Qwen3ForCausalLM(preset("tiny"))
    monkeypatch.setattr(prof, "time", clock)
    monkeypatch.setattr(prof, "_linear_candidates",
                        lambda x, w, logits: {"a": costs(3.0), "b": costs(1.0), "c": costs(2.0)})
    total, best = prof.linear_floor(model, 2, reps=3)
    L = model.config.num_hidden_layers
    assert best["qkv"] == ("b", 1e3 * L) and best["lm_head"] == ("b", 1e3)  # a chain over every layer's weight
    assert total == pytest.approx(4 * L + 1)  # the step's order: every layer's four projections, then the head


def test_linear_floor_chooses_again_in_the_steps_order(monkeypatch):
    """A kernel fastest on one shape's chain (from cache) but slower among the step's other weights (from
    memory) loses the floor's choice: here "fast_alone" costs 1 per call when the previous call had the same
    shape, 5 otherwise; "steady" costs 2 either way."""
    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    class Clock:
        now = 0.0
        last = None

        def perf_counter(self):
            return self.now

    clock = Clock()

    def fast_alone(x, w):
        clock.now += 1.0 if clock.last == tuple(w.shape) else 5.0
        clock.last = tuple(w.shape)

    def steady(x, w):
        clock.now += 2.0
        clock.last = tuple(w.shape)

    model = Qwen3ForCausalLM(preset("tiny"))
    monkeypatch.setattr(prof, "time", clock)
    monkeypatch.setattr(prof, "_linear_candidates", lambda x, w, logits: {"fast_alone": fast_alone, "steady": steady})
    total, best = prof.linear_floor(model, 2, reps=3)
    L = model.config.num_hidden_layers
    assert {impl for impl, _ in best.values()} == {"steady"}
    assert total == pytest.approx(2 * (4 * L + 1))
