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
EXTRA = ["--train.updates", "3", "--run.checkpoint_every", "1", "--eval.every", "3", "--run.samples_every", "1"]


class Crash(BaseException):
    """A stand-in for the process dying at this point (nothing after it runs)."""


def _config(tmp_path, name):
    return short_run_config(tmp_path, name, EXTRA)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted run: (its directory, its records without wall-clock fields)."""
    tmp = tmp_path_factory.mktemp("full")
    history = Trainer(_config(tmp, "run")).run()
    assert {r["update"] for r in _rows(tmp / "run" / "samples.jsonl")} == {1, 2, 3}
    return tmp / "run", [without_timings(r) for r in history]


def _rows(path: Path) -> list[dict]:
    """samples.jsonl (or any JSON-lines file) as records; every line must parse."""
    return [json.loads(ln) for ln in path.read_text().splitlines()]


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


def test_samples_append_cut_short_by_a_crash_resumes_with_no_row_lost_or_repeated(full, tmp_path, monkeypatch):
    """Killed half-way through appending update 2's responses (some rows whole, then half a row, before
    update 2's checkpoint): the resume drops the rows past its checkpoint (update 1), the cut line
    included, and writes them again, so samples.jsonl equals the uninterrupted run's, line for line."""
    write = run_outputs.append_lines

    def cut(path, lines):
        if path.name == "samples.jsonl" and json.loads(lines[0])["update"] == 2:
            with open(path, "a") as f:
                f.write("".join(ln + "\n" for ln in lines[:3]) + lines[3][: len(lines[3]) // 2])
            raise Crash
        write(path, lines)

    cfg = _config(tmp_path, "run")
    with monkeypatch.context() as m:
        m.setattr(run_outputs, "append_lines", cut)
        with pytest.raises(Crash):
            Trainer(cfg).run()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "update-000001"
    trainer, history = _resumed(cfg)
    assert history == full[1]
    assert _rows(tmp_path / "run" / "samples.jsonl") == _rows(full[0] / "samples.jsonl")


class _FullDiskFile:
    """A file whose write of a chunk that `fills(data)` picks puts half of it on disk, then fails: ENOSPC."""

    def __init__(self, f, fills):
        self._f, self._fills = f, fills

    def write(self, data):
        if self._fills(data):
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _disk_full_at(monkeypatch, name: str, fills=lambda data: True) -> None:
    """Run files named `name` (run_outputs writes them: metrics, samples, telemetry, ...) hit a full disk."""
    real_open = open

    def opened(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return _FullDiskFile(f, fills) if Path(path).name == name and mode[0] in "wa" else f

    monkeypatch.setattr(run_outputs, "open", opened, raising=False)


def test_full_disk_at_the_metrics_append_is_one_line_exit_2_and_the_resume_restores_the_line(full, tmp_path,
                                                                                              monkeypatch, capsys):
    """The disk fills while update 4's metrics line is written (after its checkpoint): one line naming
    metrics.jsonl (exit 2), half a line on disk; once space is freed, the resume skips the half line
    with one note and restores update 4's record from the checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(full[0], run)
    with monkeypatch.context() as m:
        _disk_full_at(m, "metrics.jsonl", fills=lambda data: '"update": 4' in data)
        code, last = _cli(["train", "--resume", str(run), "--train.updates", "4"], capsys)
    assert code == 2 and last == f"rlengine train: error: cannot write {run / 'metrics.jsonl'}: No space left on device"
    assert (run / "checkpoints" / "latest").read_text() == "update-000004"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5  # updates 0-3, then half of 4's line
    trainer, history = _resumed(resume_config(run))
    assert "skipped 1 unreadable line(s) (line 5" in capsys.readouterr().out
    assert history[:4] == full[1] and [r["update"] for r in history] == [0, 1, 2, 3, 4]
    assert _rows(run / "metrics.jsonl")[4]["update"] == 4


def test_full_disk_writing_telemetry_is_one_line_exit_2_after_the_last_checkpoint(full, tmp_path, monkeypatch, capsys):
    """telemetry.json is written after the run's last checkpoint, whole or not at all: a full disk there
    ends `rlengine train` with one line naming the file (exit 2), the update it ran saved and logged, the
    previous telemetry.json as it was."""
    run = tmp_path / "run"
    shutil.copytree(full[0], run)
    before = (run / "telemetry.json").read_bytes()
    _disk_full_at(monkeypatch, "telemetry.json.tmp")
    code, last = _cli(["train", "--resume", str(run), "--train.updates", "4"], capsys)
    assert code == 2 and last == f"rlengine train: error: cannot write {run / 'telemetry.json'}: No space left on device"
    assert (run / "checkpoints" / "latest").read_text() == "update-000004" and _updates(run) == [0, 1, 2, 3, 4]
    assert (run / "telemetry.json").read_bytes() == before and not (run / "telemetry.json.tmp").exists()


def test_full_disk_storing_the_warm_start_cache_is_one_line_exit_2_and_loses_nothing(tmp_path, monkeypatch, capsys):
    """The warm start is done and its cache entry is half written when the disk fills: one line naming the
    entry (exit 2), no partial entry, the other entries untouched, and a run directory a resume starts over."""
    import safetensors.torch

    from rlengine.rl.trainer.run_dir import prepare_run_dir

    cache, out = tmp_path / "cache", tmp_path / "run"
    (cache / "other").mkdir(parents=True)
    (cache / "other" / "model.safetensors").write_bytes(b"kept")
    (cache / "other" / "warmstart.json").write_text('{"losses": [1.0]}')

    def full_disk(model, filename, *a, **k):
        Path(filename).write_bytes(b"\x00" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    code, last = _cli(["train", *SHORT_RUN, *EXTRA, "--run.out_dir", str(out), "--run.warmstart_cache", str(cache)],
                      capsys)
    (entry,) = [p for p in cache.iterdir() if p.name != "other"] or [None]
    assert code == 2 and entry is None, (code, last)
    assert last.startswith(f"rlengine train: error: cannot write the warm-start cache entry {cache}/")
    assert last.endswith("(run.warmstart_cache): No space left on device")
    assert sorted(p.name for p in cache.rglob("*")) == ["model.safetensors", "other", "warmstart.json"]
    assert (cache / "other" / "model.safetensors").read_bytes() == b"kept"
    assert (out / "config.json").is_file() and not (out / "checkpoints").exists()
    assert prepare_run_dir(out, out, False) is None  # `--resume` is accepted and starts the run over


def test_warm_start_cache_entry_damaged_or_store_interrupted(tmp_path, monkeypatch, capsys):
    """A cache entry cut short is a miss (trained again, replaced, one line), never a wrong load; a store
    interrupted by a signal leaves no partial entry."""
    import safetensors.torch
    import torch

    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM
    from rlengine.rl.data.warmstart import cached_warmstart

    trained = []

    def train_into(model):
        def train():
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            trained.append(1)
            return [float(len(trained))]
        return train

    first = Qwen3ForCausalLM(preset("tiny"), seed=0)
    assert cached_warmstart(first, tmp_path, "k", train_into(first)) == ([1.0], False)
    weights = tmp_path / "k" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    second = Qwen3ForCausalLM(preset("tiny"), seed=0)
    assert cached_warmstart(second, tmp_path, "k", train_into(second)) == ([2.0], False)
    assert f"warm-start cache entry {tmp_path / 'k'} is damaged" in capsys.readouterr().out
    third = Qwen3ForCausalLM(preset("tiny"), seed=1)
    assert cached_warmstart(third, tmp_path, "k", train_into(third)) == ([2.0], True) and len(trained) == 2
    assert all(torch.equal(a, b) for a, b in zip(second.state_dict().values(), third.state_dict().values()))

    def interrupted(model, filename, *a, **k):
        Path(filename).write_bytes(b"\x00" * 64)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cached_warmstart(third, tmp_path, "other", train_into(third))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


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

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # SIG_IGN when started in the background
    monkeypatch.setattr(loop_module, "format_warmstart", signalled)
    out = tmp_path / "run"
    code = main(["train", *SHORT_RUN, *EXTRA, "--run.out_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"{signal.Signals(signum).name}: interrupted before the first update (no checkpoint yet); "
                       f"start it over with: rlengine train --resume {out}")
    assert resume_config(out).run_dir == str(out)  # the resume the line names is accepted (it starts over)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers restored


def test_resume_forks_into_a_new_directory_and_leaves_the_source_alone(full, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(full[0], src)
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    fork = tmp_path / "fork"
    trainer = Trainer(resume_config(src, ["--run.out_dir", str(fork), "--train.updates", "5"]), resume_from=src)
    assert trainer.update == 3 and [without_timings(r) for r in trainer.history] == full[1]
    assert _updates(fork) == [0, 1, 2, 3]
    assert (fork / "checkpoints" / "latest").read_text() == "update-000003"   # resumable on its own
    assert (fork / "trace.jsonl").read_text() == (src / "trace.jsonl").read_text()  # the device clock's history
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


def test_checkpoints_path_that_is_a_file_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    def reached(*a, **k):
        raise AssertionError("the run started although it could never save a checkpoint")

    monkeypatch.setattr(Trainer, "__init__", reached)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("mine")
    code, last = _cli(["train", "--run.out_dir", str(tmp_path / "run")], capsys)
    assert code == 2 and last == (f"rlengine train: error: run.out_dir '{tmp_path / 'run'}': {tmp_path / 'run'}/checkpoints "
                                  "is a file, not a directory (the run keeps its checkpoints there)")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]


def test_overwrite_removes_the_runs_own_files_only(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "update-000002" / "model").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-update-000003").mkdir()
    (run / "checkpoints" / "notes").mkdir()
    (run / "checkpoints" / "notes" / "keep.txt").write_text("mine")
    (run / "checkpoints" / "latest").write_text("update-000002")
    for name in ("config.json", "metrics.jsonl", "samples.jsonl", "telemetry.json", "plan.json", "trace.jsonl",
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
