"""`rlengine plot`: run directories' metrics.jsonl to PNGs, top-level and verl-style keys alike, runs
overlaid by name; wrong inputs (a JSON Lines file given as a rows JSON, a directory with no metrics,
no matplotlib) are one-line errors."""

import json
import random

import pytest

pytest.importorskip("matplotlib")

from rlengine.cli import main  # noqa: E402
from rlengine.plots.runs import PANELS, read_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VERL = {"reward_mean": "critic/score/mean", "response_len_mean": "response_length/mean",
        "actor_grad_norm": "actor/grad_norm", "approx_kl": "actor/ppo_kl", "t_gen": "timing_s/gen",
        "t_train": "timing_s/update_actor"}


def _records(rng: random.Random, updates: int, b_train: int) -> list[dict]:
    recs = [{"update": 0, "N": 0, "J": rng.uniform(0.05, 0.2)}]
    for u in range(1, updates + 1):
        rec = {"update": u, "N": u * b_train, "reward_mean": rng.uniform(0.1, 0.9),
               "response_len_mean": rng.uniform(2, 30), "kl_ref": 0.0, "approx_kl": rng.uniform(1e-4, 1e-2),
               "actor_grad_norm": rng.uniform(0.3, 2.0), "t_gen": rng.uniform(0.1, 1.0),
               "t_train": rng.uniform(0.1, 1.0)}
        if u % 3 == 0:
            rec["J"] = rng.uniform(0.2, 0.9)
        recs.append(rec)
    return recs


def _write_run(path, records, *, name="", verl=False):
    path.mkdir(parents=True)
    if verl:  # the same numbers under verl's names only
        records = [{VERL.get(k, k): v for k, v in r.items()} for r in records]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "config.json").write_text(json.dumps({"run": {"name": name}}))
    return path


def test_read_run_takes_values_from_either_naming(tmp_path):
    rng = random.Random(7)
    recs = _records(rng, 9, 64)
    top = read_run(_write_run(tmp_path / "top", recs, name="top"))
    verl = read_run(_write_run(tmp_path / "verl", recs, verl=True))
    assert top.name == "top" and verl.name == "verl"   # run.name, else the directory's name
    clock = 0.0
    want_t = []
    for r in recs:
        clock += r.get("t_gen", 0.0) + r.get("t_train", 0.0)
        want_t.append(clock)
    for run in (top, verl):
        assert run.x["N"] == [r["N"] for r in recs]
        assert run.x["time"] == pytest.approx(want_t, rel=1e-12)
        for _title, _ylabel, series in PANELS:
            for _label, keys in series:
                xs, ys = run.points("N", keys)
                want = [(r["N"], r[keys[0]]) for r in recs if keys[0] in r]
                assert list(zip(xs, ys)) == want, keys


def test_plot_command_writes_both_figures_for_overlaid_runs(tmp_path, capsys):
    rng = random.Random(11)
    a = _write_run(tmp_path / "a" / "run", _records(rng, 12, 64))
    b = _write_run(tmp_path / "b" / "run", _records(rng, 6, 128), verl=True)
    # a run still being written ends in a partial line: skipped, not an error
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"update": 7, "N": 89')
    assert main(["plot", str(a), str(b), "-o", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    for name in ("metrics_vs_N.png", "metrics_vs_time.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG_MAGIC
        assert name in out
    assert read_run(b).x["N"][-1] == 6 * 128


@pytest.mark.parametrize("case", ["jsonl-as-rows", "no-metrics", "bad-line", "no-matplotlib", "two-files"])
def test_plot_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    run = _write_run(tmp_path / "run", _records(random.Random(3), 4, 8))
    argv, named = {
        "jsonl-as-rows": (["plot", "--kind", "ttt", str(run / "metrics.jsonl")], "JSON Lines"),
        "no-metrics": (["plot", str(tmp_path)], "no metrics.jsonl"),
        "bad-line": (["plot", str(run)], "metrics.jsonl:2"),
        "no-matplotlib": (["plot", str(run)], "rlengine[plot]"),
        "two-files": (["plot", "--kind", "decode", str(run), str(run)], "one JSON file"),
    }[case]
    if case == "bad-line":
        lines = (run / "metrics.jsonl").read_text().splitlines()
        lines[1] = lines[1][:-3]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if case == "no-matplotlib":
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and named in err.strip().splitlines()[-1], err


def test_tools_plots_script_names_a_jsonl_input(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    run = _write_run(tmp_path / "run", _records(random.Random(5), 3, 8))
    script = Path(__file__).resolve().parents[2] / "tools" / "plots.py"
    r = subprocess.run([sys.executable, str(script), "ttt", str(run / "metrics.jsonl")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "JSON Lines" in r.stderr and "JSONDecodeError" not in r.stderr, r.stderr


def test_run_name_labels_the_run_and_names_its_default_directory(tmp_path):
    from rlengine.model.config import ConfigError
    from rlengine.rl.config import load_job_config

    named = load_job_config(None, ["--run.name", "plotdemo"])
    assert named.run_dir == "runs/plotdemo" and named.run.out_dir == "runs/default"  # as written; resolved by run_dir
    cfg = load_job_config(None, ["--run.name", "a", "--run.out_dir", str(tmp_path / "elsewhere")])
    assert cfg.run.out_dir == str(tmp_path / "elsewhere")  # a named out_dir wins
    with pytest.raises(ConfigError, match="run.name"):
        load_job_config(None, ["--run.name", "a/b"])
