"""Installed benchmarks run end to end on a tiny preset and reject bad sweeps.

asymmetry: each B is warmed up, one learner (one optimizer) serves the whole sweep, ragged
responses, fits with standard errors and bootstrap intervals. decode: a context sweep with
ragged prompts, per-step percentiles, prefill throughput, B_KV skipping, both transformers
configurations (static cache + torch.compile on the "eager" backend to stay fast), token
agreement over every sequence of every repetition, provenance and a profiler trace.
"""

import json

import pytest

from rlengine.benchmarks import MODULES, asymmetry, decode


def test_asymmetry_bench_runs_and_fits(tmp_path, capsys, monkeypatch):
    learners, calls = [], []
    real_learner, real_one = asymmetry.Learner, asymmetry._one
    monkeypatch.setattr(asymmetry, "Learner", lambda *a, **k: learners.append(1) or real_learner(*a, **k))
    monkeypatch.setattr(asymmetry, "_one", lambda args, llm, learner, b, rep, profiler=None, dist=None:
                        calls.append((b, rep)) or real_one(args, llm, learner, b, rep, profiler, dist))
    assert asymmetry.main(["--model", "tiny", "--batches", "8,16,32", "--gen-len", "4", "--reps", "1",
                           "--length-dist", "uniform", "--out", str(tmp_path), "--profile", str(tmp_path)]) == 0
    assert len(learners) == 1                                   # one optimizer: no state allocation when timed
    assert calls == [(8, -1), (8, 0), (16, -1), (16, 0), (32, -1), (32, 0), (32, 1)]  # every B warmed; + profile
    data = json.loads((tmp_path / "asymmetry.json").read_text())
    assert [r["b"] for r in data["rows"]] == [8, 16, 32]
    assert data["fit"]["d1"] is not None and data["fit"]["d1_se"] is not None and data["fit"]["bootstrap"]
    assert data["critical_generation_batch"] in (8, 16, 32)
    assert any(r["mean_response_len"] != 4 for r in data["rows"])  # ragged: uniform in [2, 6]
    assert data["conditions"]["length_dist"] == "uniform" and "commit" in data["conditions"]
    assert (tmp_path / "asymmetry.pt.trace.json").is_file()
    out = capsys.readouterr().out
    assert "critical generation batch" in out and "bootstrap 90% intervals" in out


@pytest.mark.parametrize("batches,match", [("8", "at least two"), ("8,12", "multiples")])
def test_asymmetry_bench_rejects_bad_sweeps(tmp_path, batches, match):
    from rlengine.model.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        asymmetry.main(["--model", "tiny", "--batches", batches, "--out", str(tmp_path)])


def test_decode_bench_context_sweep_percentiles_and_provenance(tmp_path, capsys):
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"ceilings": {"bandwidth_bytes_per_s": 1e10, "flops_per_s": {"float32": 1e11}}}))
    # KV budget of 10 blocks of 16 tokens: (B_act 3, context 48) needs 3 * 4 = 12 blocks and is skipped
    assert decode.main(["--model", "tiny", "--batches", "1,3", "--contexts", "4,48", "--length-dist", "uniform",
                        "--gen-len", "3", "--reps", "2", "--hf", "eager",
                        "--kv-memory-gb", str(10 * 4096 / 2**30 + 1e-9), "--ceilings", str(ceilings),
                        "--out", str(tmp_path), "--profile", str(tmp_path / "prof")]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    rows = data["rows"]
    assert [(r["context"], r["b_act"]) for r in rows] == [(4, 1), (4, 3), (48, 1)]
    assert [(s["context"], s["b_act"]) for s in data["conditions"]["skipped"]] == [(48, 3)]
    for r in rows:
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["prefill_tokens_per_s"] > 0
        assert r["hf_same_frac"] == 1.0 and r["same_tokens_as_hf"] is True and r["hf_ms_per_step"] is not None
        assert r["peak_mem_mb"] is None and r["decode_j_per_token"] is None  # CPU: no device memory, no NVML
    c = data["conditions"]
    assert c["attention_backend"] in ("cpp", "torch") and c["cuda_graphs"].startswith("off: ")
    assert {"commit", "dirty", "torch", "transformers"} <= set(c)
    assert c["hf_providers"] == {"eager": "HF dynamic cache, eager"}
    assert (tmp_path / "prof" / "decode_b1_ctx4.pt.trace.json").is_file()
    out = capsys.readouterr().out
    assert "hf_*: HF dynamic cache, eager" in out and "p99_ms" in out


def test_hf_static_compile_agrees_with_eager_on_ragged_prompts(tmp_path):
    """The static-cache + torch.compile provider (compiled with the "eager" backend here) on left-padded prompts."""
    import torch

    from rlengine.benchmarks.hf_baseline import HFProvider, load_pair

    ours, hf = load_pair("tiny", torch.float32, torch.device("cpu"), str(tmp_path))
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    eager, static = HFProvider(hf, "eager"), HFProvider(hf, "static", compile_backend="eager")
    assert static.kwargs["cache_implementation"] == "static" and "torch.compile(eager)" in static.label
    steps, tokens = static.step_times(prompts, 3)
    assert len(steps) == 2 and all(s > 0 for s in steps)          # gen-len - 1 decode steps, from the streamer
    assert tokens == eager.step_s(prompts, 3)[1] and [len(t) for t in tokens] == [3, 3]
    from rlengine.engine import LLM, SamplingParams

    outs = LLM(ours, max_num_seqs=2, attention_backend="torch").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == tokens    # left padding leaves HF's greedy tokens unchanged
    with pytest.raises(ValueError, match="mode"):
        HFProvider(hf, "compiled")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_benchmark_is_reachable_from_the_package(name, capsys):
    """`rlengine bench NAME --help` for every benchmark, the kernel micro-benchmarks included: each is a
    module inside the installed package (bench/ holds only their script forms)."""
    import importlib

    from rlengine.cli import main

    module = importlib.import_module(MODULES[name])
    assert module.__name__.startswith("rlengine.benchmarks.") and callable(module.main)
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, "--help"])
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out
