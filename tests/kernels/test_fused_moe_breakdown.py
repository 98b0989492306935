"""`rlengine bench moe --breakdown` on the CPU: the launch list of a fused MoE call, recorded from the
real call under the interpreter, for both backward variants, with FLOPs that add up to the model's."""

import pytest
import torch

from rlengine.benchmarks.micro import moe, moe_breakdown as bd

from tests.support.moe_cases import make_inputs

V1 = ["sort (kernel)", "gate/up + SwiGLU", "down", "dh + SwiGLU bwd + d router weights", "dx per pair", "dW13", "dW2"]
SORTED = ["sort (kernel)", "gate/up + SwiGLU", "down", "dh + SwiGLU bwd + d router weights",
          "dx + top-k sum (atomic epilogue)", "dW13 + dW2 (persistent)"]


@pytest.mark.parametrize("variant,labels", [("v1", V1), ("sorted", SORTED)])
def test_launch_list_is_what_the_call_launches(variant, labels):
    T, C, F, E, K = 12, 32, 16, 4, 2
    leaves, ids, dy = make_inputs(T, C, F, E, K, torch.float32, seed=3)
    rows = bd.launch_rows(leaves, ids, dy, variant, iters=1, ceilings=None, dtype="float32")
    assert [r["launch"] for r in rows] == labels
    assert [r["phase"] for r in rows] == ["fwd"] * 3 + ["bwd"] * (len(labels) - 3)
    # forward 6 N C F, backward 12 N C F: every GEMM of the call is counted once
    assert sum(r["gflop"] for r in rows) * 1e9 == pytest.approx(18 * T * K * C * F)
    assert all("ms" not in r for r in rows)  # no times without a GPU
    # the kernels are restored after recording
    from rlengine.kernels import moe_gemm
    assert not isinstance(moe_gemm._pair_gemm_kernel, bd._Wrapped)


@pytest.mark.parametrize("argv", [["--breakdown", "--variants", "fast"], ["--breakdown", "--iters", "0"]])
def test_bad_breakdown_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        moe.main(argv)
    assert exc.value.code == 2
    assert "--variants" in capsys.readouterr().err or "--iters" in " ".join(argv)


def test_cpu_breakdown_writes_the_launch_list(tmp_path):
    """What `rlengine bench moe --breakdown` runs in its interpreted child on a CPU: one table and JSON."""
    import json

    assert moe.main(["--breakdown", "--interpreted", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_moe_breakdown.json").read_text())
    assert [r["launch"] for r in data["rows"]] == V1 + SORTED and data["timed"] is False
    assert data["shape"] == moe.CPU_SHAPE
