"""tools/gpu_check.sh on the CPU with stand-in results (GPU_CHECK_DRY): what a device call brings back.

A device call returns at most 8 files, no folder deeper than 2, and the last 12,000 characters of
output. Both steps together must leave at most 8 files in $OUT, the summary must be the last lines
printed, a failed stand-in test must fail the step, and a failed build must stop it before any test.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(step: str, out: Path, dry: str = "1") -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_DRY": dry, "OUT": str(out)}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), step, "abc1234"], env=env,
                          capture_output=True, text=True, timeout=120)


def _last_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return (proc.stdout + proc.stderr).rstrip("\n").splitlines()


def test_both_steps_return_two_files_each_with_the_summary_last(tmp_path):
    out = tmp_path / "out"
    test, bench = _run("test", out), _run("bench", out)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 2 for p in files)
    assert sorted(p.name for p in files) == ["gpu_check_bench.json", "gpu_check_bench.tar.gz",
                                             "gpu_check_test.json", "gpu_check_test.tar.gz"]
    for step, proc in (("test", test), ("bench", bench)):
        summary = json.loads((out / f"gpu_check_{step}.json").read_text())
        assert summary["conditions"]["commit"] == "abc1234" and summary["conditions"]["dry"]
        tail = _last_lines(proc)[-len(summary["summary"]):]
        assert tail == [f"SUMMARY {line}" for line in summary["summary"]], "the summary must be printed last"
        with tarfile.open(out / f"gpu_check_{step}.tar.gz") as tar:
            names = {Path(n).name for n in tar.getnames()}
        assert "build.log" in names and "part_build.json" in names
    # the stand-in "others" shard has one failing test: it is named and fails the step
    assert test.returncode == 1 and any("failed: tests.gpu.standin::test_bad" in x for x in _last_lines(test))
    assert bench.returncode == 0
    with tarfile.open(out / "gpu_check_test.tar.gz") as tar:
        assert {f"junit_{s}.xml" for s in ("paged_decode", "kernels", "engine", "others")} <= \
            {Path(n).name for n in tar.getnames()}
    goals = json.loads((out / "gpu_check_bench.json").read_text())["goals"]
    assert goals["decode_ms_B1"] == 0.9 and goals["moe_vs_grouped_mm"] == 1.3


def test_a_failed_build_stops_the_step(tmp_path):
    proc = _run("test", tmp_path, dry="build-fails")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "BUILD FAILED: stopping" in text
    summary = json.loads((tmp_path / "gpu_check_test.json").read_text())
    assert [p["name"] for p in summary["parts"]] == ["build"], "nothing may run after a failed build"
    assert any(line.startswith("BUILD FAILED") for line in summary["summary"])


def test_part_time_limits_fit_one_call_with_room_for_a_rerun():
    """Part limits run one after another (the test shards side by side): test then bench in one call, the
    bench reusing the build, <= 540 s (a 15-minute lease keeps ~5 minutes for a rerun); a bench on a fresh
    machine, with its own build, <= 420 s."""
    import re
    src = (ROOT / "tools" / "gpu_check.sh").read_text()
    test_body = src[src.index("run_test_step() {"):src.index("bench() {")]
    bench_body = src[src.index("run_bench_step() {"):src.index("grpo_long() {")]
    shards = [int(x) for x in re.findall(r"part \w+ (\d+) shard", test_body)]
    test_total = int(re.search(r"build_or_stop (\d+)", test_body).group(1)) + max(shards)
    bench_parts = sum(int(x) for x in re.findall(r"part \w+ (\d+) bench", bench_body))
    bench_build = int(re.search(r"build_or_stop (\d+)", bench_body).group(1))
    assert len(shards) == 4 and test_total + bench_parts <= 540 and bench_build + bench_parts <= 420, (
        test_total, bench_parts, bench_build)


def test_the_rl_step_returns_two_files_with_the_summary_last_and_fits_one_call(tmp_path):
    """The rl step in a dry run: its stand-in tests, grpo_long metrics, q ladder, fits and cost table are read
    back into summary lines; its parts' limits with its own build (a fresh machine) stay <= 420 s."""
    import re
    proc = _run("rl", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["gpu_check_rl.json", "gpu_check_rl.tar.gz"]
    summary = json.loads((tmp_path / "gpu_check_rl.json").read_text())
    assert _last_lines(proc)[-len(summary["summary"]):] == [f"SUMMARY {line}" for line in summary["summary"]]
    text = "\n".join(summary["summary"])
    assert "tests[rl_tests]: 1 passed" in text and "generation share 0.90" in text and "J >= 0.8 at update 20" in text
    assert "1024: 3000/s (5.00x)" in text and "critical generation batch 64" in text and "cost table tiny" in text
    goals = summary["goals"]
    assert goals["grpo_long_updates"] == 20 and goals["job_ladder_q"] == {"32": 600.0, "1024": 3000.0}
    src = (ROOT / "tools" / "gpu_check.sh").read_text()
    body = src[src.index("run_rl_step() {"):src.index("export DRY WORK STEP")]
    limits = [int(x) for x in re.findall(r"part \w+ (\d+) ", body)] + [int(x) for x in re.findall(
        r"gpu_check_summary.py part rl \"\$WORK\" grpo_long \"\$rc\" \"[^\"]+\" (\d+)", body)]
    build = int(re.search(r"build_or_stop (\d+)", body).group(1))
    assert len(limits) == 5 and build + sum(limits) <= 420, (build, limits)
