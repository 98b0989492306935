"""tools/gpu_check.sh decode2 on the CPU with stand-in results (GPU_CHECK_DRY=1): the fused decode layer's
GPU step returns two files with its summary last, fits one device call, and its verdict on
gen.decode_kernels' default says fused only where it was measured faster at both B_act 1 and 64."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import gpu_check_summary as summary  # noqa: E402


def test_decode2_step_returns_two_files_with_the_summary_last(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "decode2", "abc1234"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["gpu_check_decode2.json",
                                                                           "gpu_check_decode2.tar.gz"]
    data = json.loads((tmp_path / "gpu_check_decode2.json").read_text())
    tail = (proc.stdout + proc.stderr).rstrip("\n").splitlines()[-len(data["summary"]):]
    assert tail == [f"SUMMARY {line}" for line in data["summary"]]
    assert data["goals"]["decode2_ms_B1"] == {"torch": 1.5, "fused": 0.8, "fused_over_torch": 0.533}
    assert data["goals"]["decode2_fused_faster_at_1_and_64"] is True
    src = (ROOT / "tools" / "gpu_check.sh").read_text()
    body = src[src.index("run_decode2_step() {"):src.index("run_rl_step() {")]
    limits = [int(x) for x in re.findall(r"part \S+ (\d+) ", body)]
    build = int(re.search(r"build_or_stop (\d+)", body).group(1))
    # the decode part runs twice (torch, then fused)
    assert len(limits) == 3 and build + limits[0] + 2 * limits[1] + limits[2] <= 420, (build, limits)


def test_verdict_keeps_torch_unless_fused_is_faster_at_both(tmp_path):
    for k, ms in (("torch", (1.5, 1.0)), ("fused", (0.8, 1.1))):  # fused slower at B_act 64
        (tmp_path / f"decode_{k}.json").write_text(json.dumps(
            {"rows": [{"b_act": 1, "ms_per_step": ms[0]}, {"b_act": 64, "ms_per_step": ms[1]}]}))
    goals: dict = {}
    lines = summary._decode2_lines(str(tmp_path), goals)
    assert goals["decode2_fused_faster_at_1_and_64"] is False
    assert any(line.startswith("decode2 verdict: keep torch") for line in lines)
