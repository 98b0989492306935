"""What a run prints: one compact line per update off a terminal, one live line on a terminal, status
lines for the set-up phases, the dynamic-sampling state, and the GPU-telemetry notice only on a GPU run."""

import io
import re

from rich.console import Console

from rlengine.rl.trainer.progress import RunConsole
from rlengine.rl.trainer.record import write_telemetry
from rlengine.rl.distributed import Dist
from rlengine.telemetry.nvml import NvmlSampler


def _record(update, **extra):
    return {"update": update, "N": 128 * update, "critic/score/mean": 0.1234 * update, "reward_mean": 0.5,
            "t_gen": 0.5 + update, "t_train": 0.25, "retained_fraction": 0.625, "filter_fallback": False, **extra}


def _run(console: RunConsole, records):
    with console.status("building the job"):
        pass
    with console.updates(len(records)) as c:
        for r in records:
            c.advance(r)


def test_non_terminal_prints_one_plain_line_per_update():
    out = io.StringIO()
    con = RunConsole(enabled=True, filtering=True, console=Console(file=out, width=40))
    records = [_record(1), _record(2, J=0.75), _record(3, filter_fallback=True, retained_fraction=0.125)]
    _run(con, records)
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"building the job \.\.\. \d+\.\d s", lines[0]), lines[0]
    # no wrapping at the console's 40 columns, no padding, no logging location
    assert lines[1:] == [
        "update 1/3 N=128 J=- reward=0.123 t_gen=1.50s t_train=0.25s kept=0.62",
        "update 2/3 N=256 J=0.750 reward=0.247 t_gen=2.50s t_train=0.25s kept=0.62",
        "update 3/3 N=384 J=0.750 reward=0.370 t_gen=3.50s t_train=0.25s kept=0.12 filter_fallback",
    ]


def test_without_dynamic_sampling_no_filter_state_and_disabled_prints_nothing():
    out = io.StringIO()
    _run(RunConsole(enabled=True, filtering=False, console=Console(file=out)), [_record(1)])
    assert out.getvalue().splitlines()[1] == "update 1/1 N=128 J=- reward=0.123 t_gen=1.50s t_train=0.25s"
    quiet = io.StringIO()
    _run(RunConsole(enabled=False, console=Console(file=quiet)), [_record(1)])
    assert quiet.getvalue() == ""


def test_a_failed_status_phase_ends_its_line():
    out = io.StringIO()
    con = RunConsole(enabled=True, console=Console(file=out))
    try:
        with con.status("format warm start"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert out.getvalue() == "format warm start ... failed\n"


def test_terminal_rewrites_one_live_line():
    out = io.StringIO()
    con = RunConsole(enabled=True, filtering=True, console=Console(file=out, force_terminal=True, width=160))
    assert con.live
    _run(con, [_record(1), _record(2), _record(3, J=0.5)])
    status, _, bar = out.getvalue().partition("building the job ... ")
    assert "\x1b[1A" in status  # the spinner's line was erased and replaced by the finished status line
    # after it: the status line's end, then ONE line the bar rewrote in place (\r) at every update,
    # ended once when the loop stops; no log line per update
    assert bar.count("\n") == 2 and bar.index("\n") < bar.index("update 0/3"), repr(bar)
    frames = bar.split("\n")[1].split("\r")
    assert len(frames) >= 2 and "update 3/3 N=384 J=0.500 reward=0.370" in frames[-1]
    assert "progress.py" not in bar and re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", bar).count("update 3/3") <= len(frames)


class _NoNvml:
    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def test_gpu_telemetry_notice_only_when_the_run_asked_for_a_gpu(tmp_path, capsys):
    sampler = NvmlSampler(nvml=_NoNvml())
    write_telemetry(sampler, [], b_train=8, dist=Dist(), run_dir=tmp_path, gpu=False)
    assert capsys.readouterr().out == ""
    assert (tmp_path / "telemetry.json").is_file()
    write_telemetry(sampler, [], b_train=8, dist=Dist(), run_dir=tmp_path, gpu=True)
    assert "GPU telemetry unavailable" in capsys.readouterr().out
