"""A CPU install has no triton (it is in the gpu and test extras only): training and generation still run.

Each check is a subprocess whose sys.path starts with a `triton` package that raises ImportError on
import, which is what a machine without triton sees.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GENERATE = """
import importlib
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("the stand-in did not hide triton")
from rlengine import LLM, SamplingParams
from rlengine.model.ops import triton_ops
from rlengine.model.moe import SparseMoeBlock
out = LLM("tiny").generate([[5, 8, 3, 0, 2]], SamplingParams(temperature=0, max_tokens=6))
print("TOKENS", len(out[0].outputs[0].token_ids))
assert triton_ops() is None, "the Triton norm kernels were offered without triton"
fl = importlib.import_module("rlengine.kernels.fused_logprob")  # its torch reference imports
try:
    SparseMoeBlock(8, 8, 2, 1, True, impl="triton")
except ImportError as exc:
    print("MOE", exc)
"""


def _env(tmp_path: Path) -> dict:
    fake = tmp_path / "no_triton" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named triton (hidden by the test)')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_generate_runs_without_triton(tmp_path):
    r = subprocess.run([sys.executable, "-c", GENERATE], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "TOKENS 6" in r.stdout
    assert "moe_impl 'triton' needs triton" in r.stdout


def test_train_runs_without_triton(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "rlengine", "train", "--train.updates", "2", "--warmstart.steps", "20",
                        "--run.out_dir", str(out), "--run.progress", "false"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [rec for rec in records if "actor_grad_norm" in rec]
    assert len(updates) == 2 and all(rec["actor_grad_norm"] > 0 for rec in updates)
