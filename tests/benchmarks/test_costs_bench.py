"""`rlengine bench costs` writes a valid cost table on the CPU; the table format refuses what is not one."""

import json

import pytest
import torch

from rlengine.analysis.cost_table import FORMAT, CostTable
from rlengine.benchmarks.costs import main, optimizer_cost
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM


def test_bench_costs_measures_every_curve_on_this_cpu(tmp_path, capsys):
    assert main(["--model", "tiny", "--batches", "1,4", "--contexts", "8,24", "--steps", "3", "--prefill", "8,32",
                 "--learner-tokens", "32,64", "--seq-len", "32", "--reps", "1", "--out", str(tmp_path)]) == 0
    table = CostTable.load(tmp_path / "costs-tiny-float32.json")
    assert table.kind == "measured" and table.model == "tiny" and table.dtype == "float32"
    assert [(b, c) for b, c, _ in table.decode] == [(1, 9), (1, 25), (4, 9), (4, 25)]  # context + steps // 2
    assert [t for t, _ in table.prefill] == [8, 32] and [t for t, _ in table.learner] == [32, 64]
    assert all(s > 0 for *_, s in table.decode + table.prefill + table.learner) and table.optimizer_s > 0
    assert {"commit", "torch", "device"} <= set(table.provenance) and "learner forward+backward" in \
        table.provenance["method"]
    assert "optimizer step" in capsys.readouterr().out


def test_timing_the_optimizer_leaves_the_weights_as_they_were():
    model = Qwen3ForCausalLM(preset("tiny"), seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    assert optimizer_cost(model, reps=1) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_table_format_names_what_is_wrong(tmp_path):
    good = dict(format=FORMAT, model="tiny", dtype="float32", kind="measured", decode=[[1, 8, 0.001]],
                prefill=[[8, 0.002]], learner=[[64, 0.01]], optimizer_s=0.001)
    assert CostTable.from_dict(good).decode == ((1, 8, 0.001),)
    with pytest.raises(ValueError, match="format must be"):
        CostTable.from_dict({**good, "format": "other"})
    with pytest.raises(ValueError, match="missing field 'learner'"):
        CostTable.from_dict({k: v for k, v in good.items() if k != "learner"})
    with pytest.raises(ValueError, match="decode needs"):
        CostTable.from_dict({**good, "decode": [[1, 8, 0.0]]})
    with pytest.raises(ValueError, match="kind must be"):
        CostTable.from_dict({**good, "kind": "guessed"})
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        CostTable.load(tmp_path / "t.json")
    assert json.loads(json.dumps(CostTable.from_dict(good).to_dict())) == {**good, "provenance": {}}
