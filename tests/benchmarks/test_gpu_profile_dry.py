"""tools/gpu_check.sh profile with stand-in results (GPU_CHECK_DRY=1): what its device call brings back.

Two files in $OUT (the summary JSON with the per-kernel tables in its goals, and the archive), the summary
printed last. The profiler itself (rlengine/benchmarks/decode_gpu_profile.py) needs a CUDA device: here only
its pure helpers and its refusal without one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

from rlengine.benchmarks import decode_gpu_profile as gp

ROOT = Path(__file__).resolve().parents[2]


def test_dry_profile_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out)}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "profile", "abc1234"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check_profile.json", "gpu_check_profile.tar.gz"]
    summary = json.loads((out / "gpu_check_profile.json").read_text())
    tail = (proc.stdout + proc.stderr).rstrip("\n").splitlines()[-len(summary["summary"]):]
    assert tail == [f"SUMMARY {line}" for line in summary["summary"]]
    assert [p["name"] for p in summary["parts"]] == ["build", "profile_kernels", "profile_events", "profile_paged"]
    assert all(p["limit"] <= 180 for p in summary["parts"]) and sum(p["limit"] for p in summary["parts"]) <= 430
    goals = summary["goals"]
    assert goals["profile_kernels_B1"][0] == {"name": "_split_kernel", "count": 28.0, "us": 90.0}
    assert goals["profile_busy_B64"]["wall_us_per_step"] == 1000.0
    assert {"profile_events_B1_async", "profile_events_B64_sync"} <= set(goals)
    text = "\n".join(summary["summary"])
    assert "host gap 20%" in text and "their kernels in the trace: yes" in text and "at 33 splits" in text
    with tarfile.open(out / "gpu_check_profile.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"profile_kernels.json", "profile_events.json", "profile_paged.json"} <= names


def test_dry_profile_step_names_a_missing_part(tmp_path):
    """A part that leaves no JSON (failed, timed out) is named in the summary."""
    from importlib import util

    spec = util.spec_from_file_location("gpu_check_summary", ROOT / "tools" / "gpu_check_summary.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.standin("profile", str(tmp_path))
    os.remove(tmp_path / "profile_events.json")
    lines = mod._profile_lines(str(tmp_path), {})
    assert lines[-1].startswith("no result from: profile_events")


def test_busy_time_is_the_union_of_kernel_intervals():
    assert gp._busy([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert gp._busy([]) == 0


def test_profiler_refuses_without_a_device(capsys):
    if not gp.torch.cuda.is_available():
        assert gp.main(["kernels", "--out", "unused"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().out
