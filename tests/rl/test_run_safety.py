"""Runs that lose nothing: a crash at any write point of a run leaves a directory that resumes to the
same history as an uninterrupted run, and no resume, overwrite or failed save touches what is not
the run's own.

Crashes are injected in process at the write points (a metrics line cut short, a checkpoint save
that fails half-way, a crash inside the format warm start) by raising a BaseException there; the
resumed run's records, without their wall-clock fields, must equal an uninterrupted run's
(the same comparison as tests/rl/test_trainer.py's resume test). Checkpoint faults (a truncated
file, a run config edited to another model) end the command in one line, exit 2.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlengine.cli import main
from rlengine.model.loader import CheckpointError
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer import checkpoint as checkpoint_module
from rlengine.rl.trainer import loop as loop_module
from rlengine.rl.trainer import run_outputs
from rlengine.rl.trainer.run_dir import clear_run, resume_config

from tests.support.short_runs import SHORT_RUN, short_run_config, without_timings

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ["--train.updates", "3", "--run.checkpoint_every", "1", "--eval.every", "3"]


class Crash(BaseException):
    """A stand-in for the process dying at this point (nothing after it runs)."""


def _config(tmp_path, name):
    return short_run_config(tmp_path, name, EXTRA)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted run: (its directory, its records without wall-clock fields)."""
    tmp = tmp_path_factory.mktemp("full")
    history = Trainer(_config(tmp, "run")).run()
    return tmp / "run", [without_timings(r) for r in history]


def _resumed(cfg) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(cfg, resume=True)
    return trainer, [without_timings(r) for r in trainer.run()]


def _updates(run_dir: Path) -> list[int]:
    return [json.loads(ln)["update"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_metrics_line_cut_short_by_a_crash_is_skipped_and_restored(full, tmp_path, monkeypatch, capsys):
    """Killed while writing update 2's line (after its checkpoint): the half line is skipped with one
    note, the record comes back from the checkpoint, and the run continues at update 3."""
    write = run_outputs.append_lines

    def cut(path, lines):
        if path.name == "metrics.jsonl" and json.loads(lines[0])["update"] == 2:
            with open(path, "a") as f:
                f.write(lines[0][: len(lines[0]) // 2])
            raise Crash
        write(path, lines)

    cfg = _config(tmp_path, "run")
    with monkeypatch.context() as m:
        m.setattr(run_outputs, "append_lines", cut)
        with pytest.raises(Crash):
            Trainer(cfg).run()
    trainer, history = _resumed(cfg)
    assert trainer.N == full[1][-1]["N"] and history == full[1]
    assert "skipped 1 unreadable line(s) (line 3" in capsys.readouterr().out
    assert _updates(tmp_path / "run") == [0, 1, 2, 3]


def test_garbage_last_metrics_line_never_stops_a_resume(full, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(full[0], run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\x00\xff garbage {\n")
    trainer, history = _resumed(resume_config(run))
    assert history == full[1] and trainer.update == 3
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().out


def test_failed_checkpoint_save_removes_its_directory_and_the_run_resumes(full, tmp_path, monkeypatch):
    """A full disk half-way through update 2's save: one CheckpointError, no .tmp-update-* left,
    `latest` still names update 1, from which the run resumes to the uninterrupted history."""
    write = checkpoint_module._write_files

    def disk_full(out, files, *, model, state, on_stage):
        write(out, files, model=model, state=state, on_stage=on_stage)
        if state["update"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    cfg = _config(tmp_path, "run")
    with monkeypatch.context() as m:
        m.setattr(checkpoint_module, "_write_files", disk_full)
        with pytest.raises(CheckpointError, match="No space left on device"):
            Trainer(cfg).run()
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "update-000001"]
    trainer, history = _resumed(cfg)
    assert trainer.N == full[1][-1]["N"] and history == full[1]


def test_crash_in_the_warm_start_leaves_a_run_that_a_resume_starts_over(full, tmp_path, monkeypatch):
    def crash(*a, **k):
        raise Crash

    cfg = _config(tmp_path, "run")
    with monkeypatch.context() as m:
        m.setattr(loop_module, "format_warmstart", crash)
        with pytest.raises(Crash):
            Trainer(cfg)
    assert (tmp_path / "run" / "config.json").is_file() and not (tmp_path / "run" / "checkpoints").exists()
    trainer, history = _resumed(resume_config(tmp_path / "run"))
    assert history == full[1] and trainer.update == 3


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_the_warm_start_is_one_line_exit_130_and_resumable(signum, tmp_path, monkeypatch, capsys):
    def signalled(*a, **k):
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the warm start")

    monkeypatch.setattr(loop_module, "format_warmstart", signalled)
    out = tmp_path / "run"
    code = main(["train", *SHORT_RUN, *EXTRA, "--run.out_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"{signal.Signals(signum).name}: interrupted before the first update (no checkpoint yet); "
                       f"start it over with: rlengine train --resume {out}")
    assert resume_config(out).run_dir == str(out)  # the resume the line names is accepted (it starts over)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_resume_forks_into_a_new_directory_and_leaves_the_source_alone(full, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(full[0], src)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    fork = tmp_path / "fork"
    trainer = Trainer(resume_config(src, ["--run.out_dir", str(fork), "--train.updates", "5"]), resume_from=src)
    assert trainer.update == 3 and [without_timings(r) for r in trainer.history] == full[1]
    assert _updates(fork) == [0, 1, 2, 3]
    assert (fork / "checkpoints" / "latest").read_text() == "update-000003"   # resumable on its own
    assert json.loads((fork / "config.json").read_text())["train"]["updates"] == 5   # extended
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before


def _cli(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("damage,named", [
    ("truncate-optim", "optim.safetensors"),
    ("other-model-size", "the checkpoint's model differs"),
])
def test_damaged_checkpoint_is_one_line_exit_2(damage, named, full, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(full[0], run)
    if damage == "truncate-optim":
        optim = run / "checkpoints" / "update-000003" / "optim.safetensors"
        optim.write_bytes(optim.read_bytes()[:100])
    else:
        saved = json.loads((run / "config.json").read_text())
        saved["model"]["name"] = "tiny-moe"
        (run / "config.json").write_text(json.dumps(saved))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "plan.json"}
    code, last = _cli(["train", "--resume", str(run)], capsys)
    assert code == 2 and last.startswith("rlengine train: error: ") and named in last, last
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "plan.json"} == before


def test_overwrite_removes_the_runs_own_files_only(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "update-000002" / "model").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-update-000003").mkdir()
    (run / "checkpoints" / "notes").mkdir()
    (run / "checkpoints" / "notes" / "keep.txt").write_text("mine")
    (run / "checkpoints" / "latest").write_text("update-000002")
    for name in ("config.json", "metrics.jsonl", "samples.jsonl", "telemetry.json", "plan.json",
                 "events.out.tfevents.1.host", "README.md"):
        (run / name).write_text("x")
    clear_run(run)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "README.md", "checkpoints", "checkpoints/notes", "checkpoints/notes/keep.txt"]


def test_jsonl_task_takes_a_plugin_reward(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text("def score(completion, answer, prompt='', extra=None):\n    return 0.5\n")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    monkeypatch.syspath_prepend(str(tmp_path))
    from rlengine.rl.data.tasks import build_task

    task = build_task("jsonl", path=str(data), reward="myreward:score")
    assert task.reward_fn("1", "1") == 0.5


def test_tune_interrupted_is_one_line_exit_130(monkeypatch, tmp_path, capsys):
    import rlengine.tune

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlengine.tune, "tune", interrupted)
    code = main(["tune", "--out", str(tmp_path / "tune")])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rlengine tune: interrupted; finished runs are kept in")


CHILD = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("child_lifetime", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
mod.end_with_parent(int(sys.argv[2]))
print("ready", flush=True)
time.sleep(60)
"""
PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())], stdout=subprocess.PIPE)
assert child.stdout.readline().strip() == b"ready"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_worker_ends_when_its_parent_is_killed():
    """A worker that called end_with_parent (tune's and the reward pool's do) dies with a SIGKILLed parent."""
    lifetime = str(ROOT / "rlengine" / "rl" / "child_lifetime.py")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, lifetime], stdout=subprocess.PIPE)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(50):
        try:  # gone, or a zombie nobody reaped yet: either way it stopped computing
            if Path(f"/proc/{child_pid}/stat").read_text().split(") ")[1][0] in "ZX":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    pytest.fail("the worker outlived its killed parent")
