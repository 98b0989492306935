"""tools/plots.py renders each plot (decode, asymmetry, time to target, benchmark sweeps, serving) from
synthetic JSON to a PNG (checked by its magic bytes)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_plots():
    path = Path(__file__).resolve().parents[2] / "tools" / "plots.py"
    spec = importlib.util.spec_from_file_location("rlengine_tools_plots", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plots = load_plots()

DECODE = {"rows": [{"b_act": b, "tokens_per_s": 700.0 * b / (1 + b / 64), "ms_per_step": 1.3 * (1 + b / 64),
                    "roofline_tokens_per_s": 760.0 * b / (1 + b / 100)} for b in (1, 8, 64, 256)]}
ASYMMETRY = {"rows": [{"b": 256, "responses": 256, "t_gen": 39.0, "t_train": 20.0},
                      {"b": 1024, "responses": 1024, "t_gen": 68.0, "t_train": 80.0}]}
TTT = {"rows": [{"P": 64, "T_norm": 1.14}, {"P": 128, "T_norm": 1.0}, {"P": 1024, "T_norm": 0.71},
                {"P": 4096, "T_norm": 1.18}, {"P": 256, "T_norm": 1.42, "label": "256 fixed LR"}]}
SWEEP = {"name": "bench_x", "rows": [{"B": b, "L": l, "ref_ms": 0.1 * b * l, "new_ms": 0.05 * b * l}
                                     for b in (1, 8, 64) for l in (64, 256)]}
SERVE = {"rows": [{"request_rate": r, "median_ttft_ms": 10.0 * r, "p99_ttft_ms": 20.0 * r, "median_tpot_ms": 2.0,
                   "p99_tpot_ms": 3.0, "median_itl_ms": 2.0, "p99_itl_ms": None} for r in (1.0, 4.0, 16.0)]}


@pytest.mark.parametrize("kind, data", [("decode", DECODE), ("asymmetry", ASYMMETRY), ("ttt", TTT)])
def test_cli_writes_png(tmp_path, kind, data):
    src = tmp_path / f"{kind}.json"
    src.write_text(json.dumps(data))
    out = tmp_path / "sub" / f"{kind}.png"
    assert plots.main([kind, str(src), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_decode_without_roofline_and_default_output(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "roofline_tokens_per_s"} for r in DECODE["rows"]]
    src = tmp_path / "decode.json"
    src.write_text(json.dumps({"rows": rows}))
    plots.main(["decode", str(src)])
    assert (tmp_path / "decode.png").read_bytes()[:8] == PNG_MAGIC


def test_missing_fields_are_named(tmp_path):
    with pytest.raises(ValueError, match="t_gen"):
        plots.plot_asymmetry({"rows": [{"b": 1, "responses": 1}]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="rows"):
        plots.plot_time_to_target({}, tmp_path / "x.png")


def test_sweep_cli_writes_png(tmp_path):
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(SWEEP))
    assert plots.main(["sweep", str(src), "--x", "B", "--y", "ref_ms,new_ms", "--group", "L"]) == 0
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit):
        plots.main(["sweep", str(src)])                       # --x and --y are required
    with pytest.raises(ValueError, match="no numeric values"):
        plots.plot_sweep(SWEEP, tmp_path / "x.png", x="B", y=["missing_ms"])


def test_serving_plot(tmp_path):
    out = plots.plot_serving(SERVE, tmp_path / "serve.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
