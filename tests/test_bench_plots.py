"""tools/plots.py's sweep and serving plots render synthetic JSON to PNG (checked by the magic bytes)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_plots():
    spec = importlib.util.spec_from_file_location("rlengine_tools_plots_sweep",
                                                  Path(__file__).resolve().parents[1] / "tools" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plots = load_plots()
SWEEP = {"name": "bench_x", "rows": [{"B": b, "L": l, "ref_ms": 0.1 * b * l, "new_ms": 0.05 * b * l}
                                     for b in (1, 8, 64) for l in (64, 256)]}
SERVE = {"rows": [{"request_rate": r, "median_ttft_ms": 10.0 * r, "p99_ttft_ms": 20.0 * r, "median_tpot_ms": 2.0,
                   "p99_tpot_ms": 3.0, "median_itl_ms": 2.0, "p99_itl_ms": None} for r in (1.0, 4.0, 16.0)]}


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
