"""Installed benchmarks run end to end on a tiny preset and reject bad sweeps."""

import json

import pytest

from rlengine.benchmarks import asymmetry


def test_asymmetry_bench_runs_and_fits(tmp_path, capsys):
    assert asymmetry.main(["--model", "tiny", "--batches", "8,16,32", "--gen-len", "4", "--reps", "1",
                           "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "asymmetry.json").read_text())
    assert [r["b"] for r in data["rows"]] == [8, 16, 32]
    assert data["fit"]["d1"] is not None and data["critical_generation_batch"] in (8, 16, 32)
    assert "critical generation batch" in capsys.readouterr().out


@pytest.mark.parametrize("batches,match", [("8", "at least two"), ("8,12", "multiples")])
def test_asymmetry_bench_rejects_bad_sweeps(tmp_path, batches, match):
    with pytest.raises(SystemExit, match=match):
        asymmetry.main(["--model", "tiny", "--batches", batches, "--out", str(tmp_path)])
