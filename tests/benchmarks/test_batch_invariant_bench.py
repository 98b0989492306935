"""`rlengine bench batch_invariant` runs both modes side by side and writes its table as JSON."""

import json

from rlengine.benchmarks.micro.batch_invariant import main


def test_batch_invariant_bench_writes_both_modes_per_phase(tmp_path, capsys):
    assert main(["--models", "tiny", "--dtypes", "bf16", "--batches", "1,2", "--tokens", "3", "--reps", "1",
                 "--train-batch", "8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "batch_invariant.json").read_text())
    assert [(r["phase"], r["B"]) for r in data["rows"]] == [("decode step", 1), ("decode step", 2),
                                                             ("learner fwd+bwd", 8)]
    for r in data["rows"]:
        # ms are rounded to 3 decimals in the table, the ratio is of the unrounded medians
        assert abs(r["ratio"] - r["invariant_ms"] / r["default_ms"]) <= 0.01 * abs(r["ratio"]) + 2e-3
    assert data["conditions"]["cpu"] and "method" in data
    assert "invariant_ms" in capsys.readouterr().out
