"""A run's life on disk: stopping on SIGINT / SIGTERM, run directories, checkpoint retention.

Signals go to real `rlengine train` processes; the interrupted run is resumed and compared with an
uninterrupted one (float64, so the two agree exactly, update by update).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlengine.model.config import ConfigError
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer.run_dir import fresh_run_dir, holds_run
from tests.support.short_runs import short_run_config, without_timings

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--warmstart.steps", "20", "--train.prompts_per_step", "4", "--train.group_size", "4", "--task.num_eval", "8",
       "--task.num_train", "50", "--eval.every", "5", "--run.progress", "false", "--model.dtype", "float64",
       "--train.updates", "40"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlengine", "train", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def _wait_for_updates(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        path = run_dir / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) > n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no {n} updates in {timeout} s")


def _same_run(a: list[dict], b: list[dict]) -> None:
    assert [r["update"] for r in a] == [r["update"] for r in b]
    for x, y in zip(a, b):
        assert without_timings(x) == without_timings(y)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_update_saves_and_resumes_as_if_never_stopped(tmp_path, sig):
    out = tmp_path / "run"
    proc = _start(*JOB, "--run.out_dir", str(out))
    _wait_for_updates(out, 3, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    stopped_at = len(_metrics(out)) - 1
    assert last == f"interrupted at update {stopped_at}; resume with: rlengine train --resume {out}", stderr
    assert 3 <= stopped_at < 40
    assert (out / "checkpoints" / "latest").read_text() == f"update-{stopped_at:06d}"
    resumed = subprocess.run([sys.executable, "-m", "rlengine", "train", "--resume", str(out)], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    if sig == signal.SIGINT:  # one uninterrupted run is the reference for both signals' runs
        whole = subprocess.run([sys.executable, "-m", "rlengine", "train", *JOB, "--run.out_dir", str(tmp_path / "w")],
                               cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert whole.returncode == 0, whole.stderr[-2000:]
        _same_run(_metrics(out), _metrics(tmp_path / "w"))
    else:
        assert _metrics(out)[-1]["update"] == 40


def test_a_second_signal_exits_at_once_without_saving(tmp_path):
    out = tmp_path / "run"
    proc = _start(*JOB, "--train.updates", "400", "--run.out_dir", str(out))
    _wait_for_updates(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    seen = ""
    while "stopping after this update" not in seen:  # the first one was handled (two at once coalesce)
        seen = proc.stderr.readline()
        assert seen, "the run ended before announcing the stop"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted at update" not in stderr and "Traceback" not in stderr
    assert not (out / "checkpoints").exists()


def test_a_named_run_directory_is_never_replaced_silently(tmp_path):
    cfg = short_run_config(tmp_path, "r", ["--train.updates", "1", "--run.checkpoint_every", "1"])
    Trainer(cfg).run()
    assert holds_run(tmp_path / "r")
    r = subprocess.run([sys.executable, "-m", "rlengine", "train", "--train.updates", "1", "--warmstart.steps", "2",
                        "--run.out_dir", str(tmp_path / "r")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "already holds a run" in r.stderr and "--run.overwrite true" in r.stderr
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(cfg)
    (tmp_path / "r" / "notes.txt").write_text("mine")
    old = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    again = short_run_config(tmp_path, "r", ["--train.updates", "2", "--run.overwrite", "true"])
    history = Trainer(again).run()
    assert [r["update"] for r in history] == [0, 1, 2] == [r["update"] for r in _metrics(tmp_path / "r")]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["latest", "update-000002"] != old
    assert (tmp_path / "r" / "notes.txt").read_text() == "mine"  # only the run's own files are replaced


def test_without_a_named_directory_each_run_gets_a_fresh_one(tmp_path):
    base = tmp_path / "runs" / "default"
    assert fresh_run_dir(base) == base
    seen = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "rlengine", "train", "--train.updates", "1", "--warmstart.steps", "2",
                            "--task.num_eval", "4", "--run.progress", "false"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        first = r.stdout.splitlines()[0]
        assert first.startswith("run directory: ")
        seen.append(first.removeprefix("run directory: "))
    assert seen == ["runs/default", "runs/default-1"]
    assert all(len(_metrics(tmp_path / d)) == 2 for d in seen)


def test_checkpoints_kept_saved_once_and_a_finished_resume_rewrites_nothing(tmp_path):
    cfg = short_run_config(tmp_path, "k", ["--run.checkpoint_every", "1", "--run.keep_checkpoints", "2"])
    Trainer(cfg).run()
    ckpts = tmp_path / "k" / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["latest", "update-000003", "update-000004"]  # 4 updates, the last saved once
    stamps = {p.name: p.stat().st_mtime_ns for p in ckpts.iterdir()}
    metrics = (tmp_path / "k" / "metrics.jsonl").read_text()
    from rlengine.rl.trainer.run_dir import resume_config

    Trainer(resume_config(tmp_path / "k"), resume=True).run()
    assert {p.name: p.stat().st_mtime_ns for p in ckpts.iterdir()} == stamps
    assert (tmp_path / "k" / "metrics.jsonl").read_text() == metrics


def test_sigterm_to_the_two_rank_launcher_stops_every_rank_at_one_update_and_resumes(tmp_path):
    """`rlengine train --nproc 2`: SIGTERM to the launcher alone reaches both ranks, which finish the same
    update, save and exit; the launcher exits 130 with rank 0's resume line as its one line, and the
    resumed 2-rank run equals an uninterrupted one in every non-timing field."""
    job = [*JOB, "--train.updates", "8", "--eval.every", "4"]
    out = tmp_path / "run"
    proc = _start("--nproc", "2", *job, "--run.out_dir", str(out))
    _wait_for_updates(out, 3, proc, timeout=240)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 130, stderr[-2000:]
    stopped_at = len(_metrics(out)) - 1
    line = f"interrupted at update {stopped_at}; resume with: rlengine train --resume {out}"
    assert stderr.strip().splitlines()[-1] == line and stderr.count("interrupted at update") == 1, stderr
    assert "Traceback" not in stderr and 3 <= stopped_at < 8
    resumed = subprocess.run([sys.executable, "-m", "rlengine", "train", "--nproc", "2", "--resume", str(out)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = subprocess.run([sys.executable, "-m", "rlengine", "train", "--nproc", "2", *job, "--run.out_dir",
                            str(tmp_path / "w")], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-2000:]
    per_rank_times = ("t_gen_ranks", "t_train_ranks", "b_act_mean_ranks")
    strip = lambda rows: [{k: v for k, v in without_timings(r).items() if k not in per_rank_times} for r in rows]
    assert strip(_metrics(out)) == strip(_metrics(tmp_path / "w"))


def test_a_signal_during_the_warm_start_of_two_ranks_stops_both_in_one_line_and_a_resume_starts_over(tmp_path):
    """`rlengine train --nproc 2`, Ctrl-C (SIGINT to the launcher, which passes it to both ranks) while
    the ranks are setting up and warm-starting: every rank stops (the launcher returns, 130) with rank
    0's one line and no traceback; the directory is the one process's (its config, no checkpoint, an
    unfinished warm start not cached), which a resume accepts and starts over."""
    from rlengine.rl.trainer.run_dir import prepare_run_dir, resume_config

    out, cache, sig = tmp_path / "run", tmp_path / "cache", signal.SIGINT
    proc = _start("--nproc", "2", *JOB, "--warmstart.steps", "100000", "--run.dist_timeout_s", "20",
                  "--run.warmstart_cache", str(cache), "--run.out_dir", str(out))
    end = time.monotonic() + 240
    while not (out / "plan.json").is_file():  # rank 0 writes it just before its warm start
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    line = (f"{signal.Signals(sig).name}: interrupted before the first update (no checkpoint yet); start it over "
            f"with: rlengine train --resume {out}")
    assert stderr.strip().splitlines()[-1] == line and stderr.count("interrupted") == 1, stderr[-2000:]
    assert "Traceback" not in stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.jsonl", "plan.json"]
    assert not any(cache.iterdir())
    assert resume_config(out).run_dir == str(out) and prepare_run_dir(out, out, False) is None
